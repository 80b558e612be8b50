"""Running seeds: one, many (stopping at the first violation), and the shrinker that finds the smallest replay."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvseal.protocol.machine import SAFE, Variants
from kvseal.sim.base import Knobs, Violation
from kvseal.sim.world import World


@dataclass
class Outcome:
    seed: int
    violation: str = ""
    trace: list[str] = field(default_factory=list)
    requests: int = 0
    served: int = 0


def run_seed(seed: int, variants: Variants = SAFE, knobs: Knobs | None = None) -> Outcome:
    w = World(seed, variants, knobs)
    try:
        w.run()
    except Violation as v:
        return Outcome(seed, str(v), w.trace, len(w.requests), sum(r.served for r in w.requests.values()))
    return Outcome(seed, "", [], len(w.requests), sum(r.served for r in w.requests.values()))


def run_seeds(seeds: range, variants: Variants = SAFE, knobs: Knobs | None = None,
              stop_at_first: bool = True) -> list[Outcome]:
    bad = []
    for s in seeds:
        o = run_seed(s, variants, knobs)
        if o.violation:
            bad.append(o)
            if stop_at_first:
                break
    return bad


def shrink(seed: int, variants: Variants = SAFE, knobs: Knobs | None = None) -> tuple[Knobs, Outcome]:
    """The same seed with as few requests as still fail: the smallest replay, and its trace."""
    k = knobs or Knobs()
    best = run_seed(seed, variants, k)
    for n in range(1, k.requests):
        smaller = Knobs(**{**k.__dict__, "requests": n})
        o = run_seed(seed, variants, smaller)
        if o.violation:
            return smaller, o
    return k, best
