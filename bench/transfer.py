"""KV transfer bandwidth per transport beside the transport's raw bandwidth, measured in the same run.

shm: ShmWriter page writes vs a plain memcpy of the same bytes. mooncake: MooncakeWriter page writes
(consecutive pages, as the allocator hands them out) vs one bare ``transfer_sync_write`` of the same bytes,
two TransferEngines over loopback TCP. Writes bench/out/transfer.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from kvseal.transfer.mooncake import MooncakeWriter, _engine
from kvseal.transfer.shm import ShmWriter

LAYOUT = [30, 2, 3, 512, 16, 64]  # SmolLM2-135M, 512 pages of 16 tokens, bf16
PAGES = [4, 16, 64, 256]


def best(fn, reps: int = 5) -> float:
    fn()
    return min(_timed(fn) for _ in range(reps))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def page_bytes() -> int:
    return math.prod(LAYOUT[:3]) * math.prod(LAYOUT[4:]) * 2


def shm_rows() -> list[dict]:
    src = torch.randn(LAYOUT).to(torch.bfloat16)
    path = f"/dev/shm/kvseal-bench-{os.getpid()}"
    torch.from_file(path, shared=True, size=math.prod(LAYOUT), dtype=torch.bfloat16)  # the file the writer maps
    w, rows = ShmWriter(), []
    try:
        for n in PAGES:
            pages = list(range(n))
            dst_pages = list(range(100, 100 + n)) if n <= 256 else pages
            kv = best(lambda pages=pages, dst_pages=dst_pages: w.write(src, pages, path, LAYOUT, dst_pages))
            nbytes = n * page_bytes()
            a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            raw = best(lambda a=a, b=b: b.copy_(a))
            rows.append(row("shm", n, nbytes, kv, raw))
    finally:
        os.unlink(path)
    return rows


def mooncake_rows() -> list[dict]:
    src = torch.randn(LAYOUT).to(torch.bfloat16)
    dst = torch.zeros(LAYOUT, dtype=torch.bfloat16)
    recv = _engine("127.0.0.1")
    assert recv.register_memory(dst.data_ptr(), dst.nbytes) == 0
    session = f"127.0.0.1:{recv.get_rpc_port()}"
    w = MooncakeWriter("127.0.0.1")
    w._register(src)
    rows, target = [], f"{session}|{dst.data_ptr()}"
    for n in PAGES:
        pages = list(range(n))
        dst_pages = list(range(100, 100 + n)) if n <= 256 else pages
        kv = best(lambda pages=pages, dst_pages=dst_pages: w.write(src, pages, target, LAYOUT, dst_pages), reps=3)
        nbytes = n * page_bytes()
        raw = best(lambda n=nbytes: w.engine.transfer_sync_write(session, src.data_ptr(), dst.data_ptr(), n), reps=3)
        rows.append(row("mooncake", n, nbytes, kv, raw))
    return rows


def row(transport: str, n: int, nbytes: int, kv_s: float, raw_s: float) -> dict:
    return {"transport": transport, "pages": n, "mib": nbytes / 2**20, "kv_gb_s": nbytes / kv_s / 1e9,
            "kv_pages_s": n / kv_s, "raw_gb_s": nbytes / raw_s / 1e9, "ratio": raw_s / kv_s}


def main() -> None:
    torch.set_num_threads(2)
    rows = shm_rows() + mooncake_rows()
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/out/transfer.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    for r in rows:
        print(f"{r['transport']:>8} {r['pages']:>4} pages {r['mib']:7.1f} MiB  kv {r['kv_gb_s']:6.2f} GB/s "
              f"({r['kv_pages_s']:8.0f} pages/s)  raw {r['raw_gb_s']:6.2f} GB/s  ratio {r['ratio']:.2f}")


if __name__ == "__main__":
    main()
