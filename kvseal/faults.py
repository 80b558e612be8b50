"""Named fault points, seeded so a failing run replays exactly. Off unless ``KVSEAL_FAULTS`` names them.

``KVSEAL_FAULTS="name[=probability],…"`` (probability defaults to 1), ``KVSEAL_FAULT_SEED=N``,
``KVSEAL_FAULT_DELAY=seconds`` (for the ``delay_*`` points, default 2). When off, a fault point costs one
dict lookup. ``KVSEAL_FAULTS=armable`` starts a worker with no fault and lets a signed ``POST /faults``
(router role) set them later, so that tests run many faults on one cluster; without ``armable`` that route
answers 404. Points, by where they fire and in protocol order:

prefill
- ``legacy_placeholder``: the 2026 bug. An over-long prompt is swapped for a 1-token placeholder, one page
  is written, and the transfer is committed as complete.
- ``crash_before_write``: die (os._exit) after the prefill forward, before any page is written.
- ``delay_page_write``: sleep before writing the pages (a slow link; the client may leave meanwhile).
- ``skip_page_write`` / ``corrupt_page_write``: commit without writing the pages, or flip bytes after.
- ``crash_after_write``: die between the page writes and the commit.
- ``reorder_commit``: send the commit first, write the pages a delay after decode answered it.
- ``corrupt_commit``: the commit message arrives with a wrong ``first_token``.
- ``delay_commit`` / ``drop_commit`` / ``duplicate_commit``: the commit is late, lost, or sent twice.
- ``crash_after_commit``: die after decode accepted the commit, before answering the router.

decode
- ``delay_reserve``: answer the reservation late (the client may leave meanwhile).
- ``crash_at_reserve`` / ``crash_at_commit``: die on receiving a reservation or a commit.

router
- ``crash_after_reserve``: die holding a fresh lease, before prefill has heard of the request.
"""

from __future__ import annotations

import os
import random

PREFILL_POINTS = ("legacy_placeholder", "delay_prefill_admit", "crash_before_write", "delay_page_write", "skip_page_write",
                  "corrupt_page_write", "crash_after_write", "reorder_commit", "corrupt_commit", "delay_commit",
                  "drop_commit", "duplicate_commit", "crash_after_commit")
DECODE_POINTS = ("delay_reserve", "crash_at_reserve", "crash_at_commit")
WORKER_POINTS = ("slow_health",)  # prefill: while it has work in flight, /health answers only after the delay
ROUTER_POINTS = ("crash_after_reserve",)
POINTS = PREFILL_POINTS + DECODE_POINTS + WORKER_POINTS + ROUTER_POINTS
CRASH_EXIT = 17  # the exit status of a worker killed by a crash_* point
ARMABLE = "armable"  # in KVSEAL_FAULTS: the faults may be set again at run time (``Faults.arm``)


class Faults:
    def __init__(self, spec: str = "", seed: int = 0, delay: float = 2.0) -> None:
        self.armable = False
        self._set(spec, seed, delay)

    def _set(self, spec: str, seed: int, delay: float) -> None:
        probs: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, p = item.partition("=")
            if name == ARMABLE:
                self.armable = True
                continue
            if name not in POINTS:
                raise ValueError(f"unknown fault point {name!r}; known: {', '.join(POINTS)}")
            probs[name] = float(p) if p else 1.0
        self.probs, self.rng, self.delay = probs, random.Random(seed), delay
        self.fired: dict[str, int] = {}

    def arm(self, spec: str, seed: int = 0, delay: float = 2.0) -> None:
        """Replace the fault points (``""``: none), as if the process had started with them. Only in a process
        started with ``armable``: a serving cluster's faults are fixed at start."""
        if not self.armable:
            raise PermissionError("this process was not started with KVSEAL_FAULTS=armable")
        self._set(spec, seed, delay)

    @classmethod
    def from_env(cls) -> Faults:
        return cls(os.environ.get("KVSEAL_FAULTS", ""), int(os.environ.get("KVSEAL_FAULT_SEED", "0")),
                   float(os.environ.get("KVSEAL_FAULT_DELAY", "2")))

    def fire(self, name: str) -> bool:
        p = self.probs.get(name)
        if p is None or self.rng.random() >= p:
            return False
        self.fired[name] = self.fired.get(name, 0) + 1
        return True

    def crash(self, name: str) -> None:
        """Die on the spot, as ``kill -9`` would: no cleanup, no answer."""
        if self.fire(name):
            os._exit(CRASH_EXIT)
