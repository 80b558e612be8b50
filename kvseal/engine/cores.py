"""Time-sharing one host's cores between engines (``kvseal serve``: prefill and decode on one machine).

Two engines that each run a full OpenMP team on the same cores oversubscribe them, and an OpenMP barrier
waits for its slowest, descheduled thread; two one-thread teams waste a core whenever the other engine is
idle. Instead each engine holds an exclusive ``flock`` on a shared file while its forward pass runs, with
every core: steps of the two engines interleave, as prefill and decode steps do in a colocated engine.
The kernel drops the lock when a process dies, so a crashed worker never blocks the other.
"""

from __future__ import annotations

import fcntl
import os
from typing import Self


class CoreLock:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> Self:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
