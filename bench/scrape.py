"""What /metrics costs: `kvseal serve` (disaggregated, hardened) at 32 streams, 128 → 128 tokens, with nobody
scraping, with every process scraped once a second (as Prometheus would), and under a scrape storm (100
scrapes/s at the front door). Interleaved, ``--reps`` rounds; writes bench/out/scrape.json. The scrapers
are processes of their own, as Prometheus is: a thread here would take the load generator's GIL instead.

    .venv/bin/python bench/scrape.py [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import Proc

from kvseal.bench import level

ROOT = Path(__file__).resolve().parent.parent


def scrape(url: str, rate: float, stop: object, count: object) -> None:
    """GET /metrics ``rate`` times a second over one keep-alive connection, with a few lines of socket code:
    an HTTP library would spend more CPU per scrape than the server does (on a 2-core machine, that CPU is
    the engine's), and the server's cost is what this measures."""
    host, port = url.split("//")[1].split(":")
    request = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port))) as sock, sock.makefile("rb") as f:
        while not stop.is_set():
            t0 = time.perf_counter()
            sock.sendall(request)
            assert f.readline().split()[1] == b"200"
            length = 0
            while (line := f.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            f.read(length)
            with count.get_lock():
                count.value += 1
            stop.wait(max(0.0, 1 / rate - (time.perf_counter() - t0)))


class Scraper:
    def __init__(self, urls: list[str], per_s: list[float]) -> None:
        ctx = mp.get_context("fork")  # no threads here yet; spawn would import torch in each scraper
        self.stop, self._count = ctx.Event(), ctx.Value("l", 0)
        self.procs = [ctx.Process(target=scrape, args=(u, r, self.stop, self._count), daemon=True)
                      for u, r in zip(urls, per_s)]

    @property
    def count(self) -> int:
        return self._count.value

    def __enter__(self) -> Scraper:  # noqa: PYI034
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="none,every_1s,storm", help="a subset of none, every_1s, storm")
    ap.add_argument("--out", default="bench/out/scrape.json")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    p = Proc([str(ROOT / ".venv/bin/kvseal"), "serve", "--port", "8620"], {}, 8620, out.with_suffix(".log"))
    urls = [p.url, "http://127.0.0.1:8621", "http://127.0.0.1:8622"]
    modes = {m: r for m, r in {"none": [0, 0, 0], "every_1s": [1, 1, 1], "storm": [100, 0, 0]}.items()
             if m in a.modes.split(",")}
    runs: dict[str, list[float]] = {m: [] for m in modes}
    model = httpx.get(p.url + "/v1/models").json()["data"][0]["id"]
    try:
        asyncio.run(level(p.url, model, 32, 128, 128, 1))  # warm-up, not counted (the first run is ~20% slower)
        for rep in range(a.reps):
            for m in (modes if rep % 2 == 0 else reversed(list(modes))):
                rates = modes[m]
                with Scraper([u for u, r in zip(urls, rates) if r], [r for r in rates if r]) as s:
                    r = asyncio.run(level(p.url, model, 32, 128, 128, 1))
                runs[m].append(r["output_tok_s"])
                print(m, round(r["output_tok_s"], 1), f"{s.count} scrapes", flush=True)
    finally:
        p.stop()
    from kvseal.machine import facts

    means = {m: statistics.mean(v) for m, v in runs.items()}
    medians = {m: statistics.median(v) for m, v in runs.items()}
    result = {"machine": facts(), "runs": runs, "means": means, "medians": medians}
    for m in ("every_1s", "storm"):
        if m in runs and "none" in runs:
            paired = [x / y for x, y in zip(runs[m], runs["none"])]  # the same round: each mode ran beside the other
            result |= {f"{m}_over_none": means[m] / means["none"], f"median_{m}_over_none": medians[m] / medians["none"],
                       f"paired_median_{m}_over_none": statistics.median(paired)}
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
