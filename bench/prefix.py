"""The prefix cache's worth and its isolation, one run: kvseal colocated with the cache on and with it off, each
started alone, interleaved over ``--reps``.

- TTFT of a request whose ~1,000-token system prompt is cached (a hit) vs a fresh one (a miss), same tenant;
- 32 concurrent streams sharing that system prompt (64 output tokens each): output tokens/s, cache on vs off;
- cross-tenant: ``kvseal probe``'s timing check (d) with two tenants' keys against the cache-on server.

    .venv/bin/python bench/prefix.py [--reps 2]      → bench/out/prefix.json

Targets (issue 12): hit TTFT ≤ 1/3 of a miss; 32-stream throughput ≥ 2× cache-off; the probe sees no
cross-tenant signal. Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from peers import MODEL, ROOT, Proc

from kvseal.probe import Client, check_timing

KEYS = ("key-a=tenant-a", "key-b=tenant-b")
WORDS = ["harbor", "lantern", "granite", "copper", "meadow", "violet", "thunder", "saddle", "orchard", "pepper", "walnut", "glacier", "falcon", "tunnel", "marble", "cinder", "oyster", "velvet", "quartz", "timber", "anchor", "basket", "canyon", "dolphin", "ember", "fossil"]


def system_prompt(rng: random.Random, n_words: int = 760) -> str:  # ≈ 1,000 tokens
    return "System: " + " ".join(rng.choices(WORDS, k=n_words)) + "\n"


def post(http: httpx.Client, url: str, prompt: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    r = http.post(url + "/v1/completions", headers={"Authorization": "Bearer key-a"},
                  json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


async def streams(url: str, system: str, n: int, out_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 4)) as http:
        async def one(i: int) -> int:
            r = await http.post(url + "/v1/completions", headers={"Authorization": "Bearer key-a"},
                                json={"model": MODEL, "prompt": system + f"Question {i}: what is item {i}?",
                                      "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(tokens) / (time.perf_counter() - t0)


def measure(url: str, rng: random.Random, cache: bool, samples: int) -> dict:
    shared = system_prompt(rng)
    with httpx.Client(timeout=600) as http:
        post(http, url, system_prompt(rng) + "warm-up", 1)
        post(http, url, shared + "Question: first?", 1)  # the shared prompt is now cached (if the cache is on)
        miss = [post(http, url, system_prompt(rng) + f"Question {i}?", 1) for i in range(samples)]
        hit = [post(http, url, shared + f"Question {i}?", 1) for i in range(samples)]
    tok_s = asyncio.run(streams(url, shared, 32, 64))
    out = {"ttft_miss_s": statistics.median(miss), "ttft_hit_s": statistics.median(hit), "tok_s_32": tok_s}
    if cache:
        c = Client(url, ["key-a", "key-b"], MODEL, 600)
        r = check_timing(c, rng, samples, 1000)
        out["probe_timing"] = {k: r[k] for k in ("verdict", "p_cross", "ratio_cross", "p_own", "ratio_own",
                                                  "samples_per_arm")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--out", default="bench/out/prefix.json")
    a = ap.parse_args()
    keys = [x for k in KEYS for x in ("--api-key", k)]
    servers = {name: [str(ROOT / ".venv/bin/kvseal"), "serve", "--colocated", "--port", "8610",
                      "--prefix-cache", name, *keys] for name in ("on", "off")}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for rep in range(a.reps):
        for name in (["on", "off"] if rep % 2 == 0 else ["off", "on"]):
            p = Proc(servers[name], {}, 8610, out.parent / f"prefix-{name}.log")
            try:
                runs[name].append(measure(p.url, random.Random(rep), name == "on", a.samples))
            finally:
                p.stop()
            print(name, json.dumps(runs[name][-1]), flush=True)

    def mean(name: str, k: str) -> float:
        return statistics.mean(r[k] for r in runs[name])

    summary = {"hit_over_miss_ttft": mean("on", "ttft_hit_s") / mean("on", "ttft_miss_s"),
               "tok_s_32_on_over_off": mean("on", "tok_s_32") / mean("off", "tok_s_32"),
               "ttft_hit_s": mean("on", "ttft_hit_s"), "ttft_miss_s": mean("on", "ttft_miss_s"),
               "tok_s_32_on": mean("on", "tok_s_32"), "tok_s_32_off": mean("off", "tok_s_32"),
               "probe_verdicts": [r["probe_timing"]["verdict"] for r in runs["on"]]}
    out.write_text(json.dumps({"reps": a.reps, "runs": runs, "summary": summary}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
