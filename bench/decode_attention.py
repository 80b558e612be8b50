"""The paged decode-attention kernel alone, on SmolLM2's heads (9 query heads, 3 KV heads, dim 64, 16-slot
pages, 30 layers of a pool held in memory), one build against another, interleaved. Writes JSON.

    python bench/decode_attention.py                                   # this machine's level, fp32 pool
    python bench/decode_attention.py --library old.so --library new.so # A/B: the ratio is new over old
    python bench/decode_attention.py --dtype bf16 --cases 1x900,32x900

Each case is rows x tokens (every row the same length); a repetition times all 30 layers once, and each
library runs ``--reps`` of them before the next takes its turn, ``--rounds`` times. Reported: each library's
median ms over the rounds' medians, and the median and range of the per-round ratios against the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvseal.model.cpu import choice, cpu_model
from kvseal.model.kernels import DecodeKernel, library_path

LAYERS, HEADS, KV_HEADS, DIM, PAGE = 30, 9, 3, 64, 16


def one_round(kernel: DecodeKernel, kv: torch.Tensor, q: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor,
              reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for layer in range(LAYERS):
            kernel(q, kv, layer, pages, lens)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--library", action="append", help="a built kernel library (default: this CPU's level)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--cases", default="1x200,1x512,1x900,32x200,32x900")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/out/decode_attention.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    libs = a.library or [library_path()]
    kernels = [DecodeKernel(path) for path in libs]
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
    gen = torch.Generator().manual_seed(0)
    n_pages = max(rows * -(-tokens // PAGE) for rows, tokens in cases)
    kv = torch.randn(n_pages, LAYERS, 2, KV_HEADS, PAGE, DIM, generator=gen).to(dtype)
    results = []
    for rows, tokens in cases:
        width = -(-tokens // PAGE)
        pages = torch.randperm(n_pages, generator=gen)[: rows * width].view(rows, width).contiguous()
        lens = torch.full((rows,), tokens, dtype=torch.int64)
        q = torch.randn(rows, HEADS, DIM, generator=gen).to(dtype)
        rounds = [[one_round(k, kv, q, pages, lens, a.reps) for k in kernels] for _ in range(a.rounds)]
        row = {"rows": rows, "tokens": tokens,
               "ms": {lib: statistics.median(r[i] for r in rounds) for i, lib in enumerate(libs)}}
        for i, lib in enumerate(libs[1:], 1):
            ratios = sorted(r[i] / r[0] for r in rounds)
            row.setdefault("ratio_to_first", {})[lib] = {"median": statistics.median(ratios),
                                                         "min": ratios[0], "max": ratios[-1]}
        results.append(row)
        ms = "  ".join(f"{v:.2f}" for v in row["ms"].values())
        ratio = "".join(f"  ratio {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
                        for v in row.get("ratio_to_first", {}).values())
        print(f"{rows:3d} rows x {tokens:5d} tokens, {LAYERS} layers: {ms} ms{ratio}", flush=True)
    out = {"cpu": cpu_model(), "level": choice().level, "dtype": a.dtype,
           "threads": a.threads, "libraries": libs, "cases": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
