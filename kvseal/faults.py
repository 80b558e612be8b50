"""Named fault points, seeded so a failing run replays exactly. Off unless ``KVSEAL_FAULTS`` names them.

``KVSEAL_FAULTS="name[=probability],…"`` (probability defaults to 1), ``KVSEAL_FAULT_SEED=N``. When off, a
fault point costs one dict lookup. Points:

- ``legacy_placeholder`` (prefill): the 2026 bug. An over-long prompt is swapped for a 1-token placeholder,
  one page is written, and the transfer is committed as complete.
- ``corrupt_page_write`` (prefill): flip bytes in the pages after writing them to decode.
- ``skip_page_write`` (prefill): commit without writing the pages at all.
- ``drop_commit`` / ``duplicate_commit`` (prefill): lose the commit, or send it twice.
- ``crash_after_write`` (prefill): die (os._exit) between the page writes and the commit.
"""

from __future__ import annotations

import os
import random

POINTS = ("legacy_placeholder", "corrupt_page_write", "skip_page_write", "drop_commit", "duplicate_commit",
          "crash_after_write")


class Faults:
    def __init__(self, spec: str = "", seed: int = 0) -> None:
        self.probs: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, p = item.partition("=")
            if name not in POINTS:
                raise ValueError(f"unknown fault point {name!r}; known: {', '.join(POINTS)}")
            self.probs[name] = float(p) if p else 1.0
        self.rng = random.Random(seed)
        self.fired: dict[str, int] = {}

    @classmethod
    def from_env(cls) -> Faults:
        return cls(os.environ.get("KVSEAL_FAULTS", ""), int(os.environ.get("KVSEAL_FAULT_SEED", "0")))

    def fire(self, name: str) -> bool:
        p = self.probs.get(name)
        if p is None or self.rng.random() >= p:
            return False
        self.fired[name] = self.fired.get(name, 0) + 1
        return True
