"""Time-sharing one host's cores between engines (``kvseal serve``: prefill and decode on one machine).

Two engines that each run a full OpenMP team on the same cores oversubscribe them, and an OpenMP barrier
waits for its slowest, descheduled thread; two one-thread teams waste a core whenever the other engine is
idle. Instead each engine holds an exclusive ``flock`` on a shared file while its forward pass runs, with
every core: steps of the two engines interleave, as prefill and decode steps do in a colocated engine.
The kernel drops the lock when a process dies, so a crashed worker never blocks the other.

The lock is taken and released at every step, so its cost is per token. ``fcntl.flock`` lets go of the GIL around the
system call, and the server's event-loop thread takes it: getting it back cost the engine 0.2 ms a step
(2% of a one-stream step, measured). An uncontended lock is therefore tried, and always released, by calling
libc's ``flock`` with the GIL held (``ctypes.PyDLL``: non-blocking, so it cannot stall the process); only a
lock another engine holds is waited for with the GIL released.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from typing import Self

try:
    _flock = ctypes.PyDLL(None, use_errno=True).flock  # keeps the GIL: for calls that never block
    _flock.argtypes, _flock.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
except (OSError, AttributeError):  # no libc flock to call this way: fcntl's for every call
    _flock = None


def _try(fd: int, op: int) -> bool:
    """``flock(fd, op | LOCK_NB)`` without letting go of the GIL; False if another holder has it."""
    if _flock is None:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
    while _flock(fd, op | fcntl.LOCK_NB) != 0:
        err = ctypes.get_errno()
        if err in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))
    return True


class CoreLock:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> Self:
        if not _try(self.fd, fcntl.LOCK_EX):
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # another engine's step: wait for it with the GIL released
        return self

    def __exit__(self, *exc: object) -> None:
        _try(self.fd, fcntl.LOCK_UN)
