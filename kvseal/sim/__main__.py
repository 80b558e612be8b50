"""``python -m kvseal.sim --seeds N [--first S] [--variant NAME] [--jobs J] [--replay SEED]``

Runs seeds (in J processes), stops at the first violation, prints its seed, the smallest replay (fewest requests
that still fail) and that replay's trace. ``--replay SEED`` replays one seed and prints its trace.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from kvseal.protocol.machine import SAFE, Variants
from kvseal.sim.run import Outcome, run_seed, shrink


def _chunk(args: tuple[int, int, str]) -> tuple[int, Outcome | None]:
    first, n, variant = args
    v = Variants.only(variant) if variant != "safe" else SAFE
    served = 0
    for s in range(first, first + n):
        o = run_seed(s, v)
        served += o.served
        if o.violation:
            return served, o
    return served, None


def search(seeds: int, first: int = 0, variant: str = "safe", jobs: int = 2, chunk: int = 50) -> tuple[Outcome | None, int]:
    """The first violating seed in [first, first + seeds) (lowest seed among those found), and requests served."""
    tasks = [(s, min(chunk, first + seeds - s), variant) for s in range(first, first + seeds, chunk)]
    served, found = 0, []
    if jobs <= 1:
        results = map(_chunk, tasks)
    else:
        pool = ProcessPoolExecutor(jobs)
        results = pool.map(_chunk, tasks)
    for n, o in results:
        served += n
        if o is not None:
            found.append(o)
            break
    if jobs > 1:
        pool.shutdown(cancel_futures=True)
    return (min(found, key=lambda o: o.seed) if found else None), served


def report(o: Outcome, variant: str) -> str:
    v = Variants.only(variant) if variant != "safe" else SAFE
    knobs, small = shrink(o.seed, v)
    lines = [f"VIOLATION at seed {o.seed} ({variant}): {o.violation}",
             f"replay: python -m kvseal.sim --replay {o.seed}" + (f" --variant {variant}" if variant != "safe" else ""),
             f"smallest replay: {knobs.requests} request(s); its trace:"]
    return "\n".join(lines + small.trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=2000)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--variant", default="safe", choices=("safe", *Variants.NAMES, *Variants.SIM_NAMES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--replay", type=int, default=None)
    a = ap.parse_args()
    if a.replay is not None:
        o = run_seed(a.replay, Variants.only(a.variant) if a.variant != "safe" else SAFE)
        print("\n".join(o.trace) if o.violation else f"seed {a.replay}: no violation")
        sys.exit(1 if o.violation else 0)
    t = time.time()
    o, served = search(a.seeds, a.first, a.variant, a.jobs)
    if o is not None:
        print(report(o, a.variant))
        sys.exit(1)
    print(f"{a.seeds} seeds from {a.first} ({a.variant}): no violation, {served} requests served, "
          f"{time.time() - t:.1f} s")


if __name__ == "__main__":
    main()
