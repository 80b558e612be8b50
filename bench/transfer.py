"""KV transfer bandwidth per transport beside the transport's raw bandwidth, measured in the same run.

Raw is a bare copy of the same number of bytes between the same two buffers with no page logic: for
``shm`` one ``copy_`` into the mapped decode pool (a plain memcpy between private buffers is reported
beside it), for ``mooncake`` one bare ``transfer_sync_write`` between two TransferEngines over loopback TCP.
The KV rows write a lease's pages through the transport as kvseal does:

- ``consecutive``: the pages as the allocator hands them out to a fresh pool (one run on each side);
- ``fragmented``: every other source page into every other destination page, the worst case after churn
  (one chunk per page).

Writes bench/out/transfer.json.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvseal.transfer.mooncake import MooncakeWriter, _engine
from kvseal.transfer.shm import ShmWriter

LAYOUT = [600, 30, 2, 3, 16, 64]  # SmolLM2-135M: 600 pages of 16 tokens, page-major, bf16
PAGES = [4, 16, 64, 256]


def best(fn, reps: int = 7) -> float:
    """Median of ``reps`` timed runs after a warm-up: robust to this machine's ±10% noise either way."""
    fn()
    return statistics.median(_timed(fn) for _ in range(reps))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def page_bytes() -> int:
    return math.prod(LAYOUT[1:]) * 2


def page_sets(n: int) -> dict[str, tuple[list[int], list[int]]]:
    return {"consecutive": (list(range(n)), list(range(300, 300 + n))),
            "fragmented": (list(range(0, 2 * n, 2)), list(range(599, 599 - 2 * n, -2)))}


def shm_rows() -> list[dict]:
    src = torch.randn(LAYOUT).to(torch.bfloat16)
    path = f"/dev/shm/kvseal-bench-{os.getpid()}"
    torch.from_file(path, shared=True, size=math.prod(LAYOUT), dtype=torch.bfloat16)  # the file the writer maps
    w, rows = ShmWriter(), []
    try:
        dst = w.target(path, LAYOUT, torch.bfloat16)
        for n in PAGES:
            nbytes = n * page_bytes()
            raw = best(lambda n=n: dst[300 : 300 + n].copy_(src[:n]))
            a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            memcpy = best(lambda a=a, b=b: b.copy_(a))
            for kind, (s, d) in page_sets(n).items():
                kv = best(lambda s=s, d=d: w.write(src, s, path, LAYOUT, d))
                rows.append(row("shm", kind, n, nbytes, kv, raw) | {"memcpy_gb_s": nbytes / memcpy / 1e9})
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
        nbytes = n * page_bytes()
        far = dst.data_ptr() + 300 * page_bytes()
        raw = best(lambda n=nbytes, far=far: w.engine.transfer_sync_write(session, src.data_ptr(), far, n), reps=5)
        for kind, (s, d) in page_sets(n).items():
            kv = best(lambda s=s, d=d: w.write(src, s, target, LAYOUT, d), reps=5)
            rows.append(row("mooncake", kind, n, nbytes, kv, raw))
    return rows


def row(transport: str, kind: str, n: int, nbytes: int, kv_s: float, raw_s: float) -> dict:
    return {"transport": transport, "pages_layout": kind, "pages": n, "mib": nbytes / 2**20,
            "kv_gb_s": nbytes / kv_s / 1e9, "kv_pages_s": n / kv_s, "raw_gb_s": nbytes / raw_s / 1e9,
            "ratio": raw_s / kv_s}


def main() -> None:
    torch.set_num_threads(2)
    rows = shm_rows() + mooncake_rows()
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/out/transfer.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    for r in rows:
        extra = f"  memcpy {r['memcpy_gb_s']:6.2f} GB/s" if "memcpy_gb_s" in r else ""
        print(f"{r['transport']:>8} {r['pages_layout']:>11} {r['pages']:>4} pages {r['mib']:6.1f} MiB  "
              f"kv {r['kv_gb_s']:6.2f} GB/s ({r['kv_pages_s']:7.0f} pages/s)  raw {r['raw_gb_s']:6.2f} GB/s  "
              f"ratio {r['ratio']:.2f}{extra}")


if __name__ == "__main__":
    main()
