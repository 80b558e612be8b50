"""What /metrics costs: `kvseal serve` (disaggregated, hardened) at 32 streams, 128 → 128 tokens, with nobody
scraping, with every process scraped once a second (as Prometheus would), and under a scrape storm (100
scrapes/s at the front door). Interleaved, ``--reps`` rounds; writes bench/out/scrape.json.

    .venv/bin/python bench/scrape.py [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import Proc

from kvseal.bench import level

ROOT = Path(__file__).resolve().parent.parent


class Scraper:
    def __init__(self, urls: list[str], per_s: list[float]) -> None:
        self.stop = threading.Event()
        self.count = 0
        self.threads = [threading.Thread(target=self._run, args=(u, r), daemon=True) for u, r in zip(urls, per_s)]

    def _run(self, url: str, rate: float) -> None:
        with httpx.Client(timeout=10) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                c.get(url + "/metrics")
                self.count += 1
                self.stop.wait(max(0.0, 1 / rate - (time.perf_counter() - t0)))

    def __enter__(self) -> Scraper:  # noqa: PYI034
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/out/scrape.json")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    p = Proc([str(ROOT / ".venv/bin/kvseal"), "serve", "--port", "8620"], {}, 8620, out.with_suffix(".log"))
    urls = [p.url, "http://127.0.0.1:8621", "http://127.0.0.1:8622"]
    modes = {"none": [0, 0, 0], "every_1s": [1, 1, 1], "storm": [100, 0, 0]}
    runs: dict[str, list[float]] = {m: [] for m in modes}
    model = httpx.get(p.url + "/v1/models").json()["data"][0]["id"]
    try:
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
    result = {"machine": facts(), "runs": runs, "means": means,
              "every_1s_over_none": means["every_1s"] / means["none"], "storm_over_none": means["storm"] / means["none"]}
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
