"""Hot-path cost of each protection, measured in-process on the real model (bf16), as a share of the work
it guards. Writes bench/out/protections.json.

- page tags: ``Runner.tag_check`` for a 32-request decode batch vs that batch's decode step.
- checksum: xxh3-128 over a 128-token prompt's pages (done twice: prefill and decode) vs its prefill.
- scrub-on-free: zeroing a finished request's 16 pages vs one 32-request decode step.
- coverage / admission / deferred release: integer comparisons and one ack round trip per request; the
  end-to-end hardened-vs-unsafe run in bench/run_all.py measures them together.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from kvseal.engine.build import WorkerSpec, build_engine, off_main_thread
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Sequence
from kvseal.transfer import messages as P


def timed(fn, reps: int = 20) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def measure() -> dict:
    engine, lm, _ = build_engine(WorkerSpec(kv_pool_tokens=32768))
    engine.stop()  # drive the pool and runner directly on this (non-main) thread
    pool, runner = engine.pool, engine.runner
    seqs = []
    for i in range(32):
        s = Sequence(i + 1, list(range(100, 292)), SamplingParams(max_tokens=64, temperature=0), lambda ev: None)
        s.run = pool.allocate(s.rid, 16)
        s.num_cached = 191
        seqs.append(s)
    step = timed(lambda: lm.model.forward(pool.kv, runner.build([(s, 1) for s in seqs])), reps=5)
    tags = timed(lambda: runner.tag_check(seqs))
    pre = Sequence(99, list(range(100, 228)), SamplingParams(max_tokens=1, temperature=0), lambda ev: None)
    pre.run = pool.allocate(99, 8)
    prefill = timed(lambda: lm.model.forward(pool.kv, runner.build([(pre, 128)])), reps=3)
    pages = list(pre.run.pages)
    digest = timed(lambda: P.checksum(pool.kv, pages, 128, 99, 1, pages, [0] * 8, 0))
    idx = torch.tensor(seqs[0].run.pages)
    scrub = timed(lambda: pool.kv.index_fill_(0, idx, 0))
    return {"decode_step_b32_ms": step * 1e3, "tag_check_ms": tags * 1e3, "tag_share": tags / step,
            "prefill_128_ms": prefill * 1e3, "checksum_128_ms": digest * 1e3, "checksum_share": 2 * digest / prefill,
            "scrub_16_pages_ms": scrub * 1e3, "scrub_share_per_finish": scrub / step}


def main() -> None:
    r = off_main_thread(measure)
    out = Path("bench/out/protections.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2))
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
