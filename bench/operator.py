"""The operator's overload run: separate prefill, decode and router processes on this host, two API keys,
12 concurrent clients sending 300 completions (prompts of 10–500 tokens, 1–40 output tokens), with or without
light protocol faults. Reports every status and how long it took, and the pools a few seconds after the
traffic stops. Writes bench/out/operator-<label>.json.

    python bench/operator.py --seed 13                 # faults on (the issue's mix), fp32
    python bench/operator.py --seed 13 --no-faults
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import MODEL, Trio

FAULTS = ("corrupt_page_write=0.03,skip_page_write=0.03,drop_commit=0.01,duplicate_commit=0.03,delay_commit=0.03,"
          "reorder_commit=0.03,corrupt_commit=0.03,delay_page_write=0.03")
KEYS = ["key-a=tenant-a", "key-b=tenant-b"]
WORDS = ["alpha", "beta", "gamma", "delta", "lighthouse", "harbor", "signal", "window", "river", "stone"]


def run(seed: int, faults: bool, dtype: str, requests: int, clients: int) -> dict:
    env = {"KVSEAL_FAULT_SEED": str(seed), "KVSEAL_FAULT_DELAY": "0.5"} | ({"KVSEAL_FAULTS": FAULTS} if faults else {})
    rng = random.Random(seed)
    jobs = [(rng.choice(KEYS).split("=")[0], " ".join(rng.choices(WORDS, k=rng.randint(10, 500))),
             rng.randint(1, 40)) for _ in range(requests)]
    worker = ["--dtype", dtype, "--kv-pool-tokens", "16384"]
    router = ["--timeout", "20"] + [x for k in KEYS for x in ("--api-key", k)]
    with Trio(worker, router, env=env) as t, httpx.Client(timeout=60) as http:
        def one(job: tuple[str, str, int]) -> tuple[int, float, str]:
            key, prompt, n = job
            t0 = time.time()
            try:
                r = http.post(t.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0})
                msg = "" if r.status_code == 200 else r.json()["error"]["message"][:80]
                return r.status_code, time.time() - t0, msg
            except httpx.HTTPError as e:
                return -1, time.time() - t0, type(e).__name__

        t0 = time.time()
        with ThreadPoolExecutor(clients) as ex:
            out = list(ex.map(one, jobs))
        wall = time.time() - t0
        time.sleep(3)
        pools = {name: {k: s.health().get(k) for k in ("free_pages", "total_pages", "running", "waiting")}
                 for name, s in (("prefill", t.pre), ("decode", t.dec))}
    codes = collections.Counter(c for c, _, _ in out)
    errors = collections.Counter(re.sub(r"\d{6,}", "N", f"{c} {m}") for c, _, m in out if c != 200)
    return {"seed": seed, "faults": faults, "dtype": dtype, "requests": requests, "clients": clients,
            "wall_s": round(wall, 1), "codes": dict(codes), "errors": dict(errors.most_common(8)),
            "max_latency_s": round(max(d for _, d, _ in out), 2),
            "pools_3s_after": pools,
            "drained": all(p["free_pages"] == p["total_pages"] for p in pools.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--clients", type=int, default=12)
    a = ap.parse_args()
    res = run(a.seed, not a.no_faults, a.dtype, a.requests, a.clients)
    print(json.dumps(res, indent=2))
    out = Path("bench/out") / f"operator-{a.seed}-{'clean' if a.no_faults else 'faults'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    sys.exit(0 if res["drained"] else 1)


if __name__ == "__main__":
    main()
