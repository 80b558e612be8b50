"""The soak: thousands of requests from 8 tenants against a disaggregated cluster (router, prefill and decode
processes) under seeded faults, checking isolation and accounting on every answer.

Each tenant's private system prompt carries its own random canary (and is reused, so prefill's prefix cache
hits within the tenant); a public prompt is shared by every tenant (the same text: the cache must still miss
across tenants). Per request, seeded: a normal greedy completion, a stream the client drops after a few chunks,
a client that gives up after 0.3 s, or a prompt that can never fit. Normal requests retry 429/503 answers after
their Retry-After for up to 40 s, as the openai client does, so a worker restart costs retries, not the run. Prefill injects transfer faults (corrupted,
skipped, dropped, duplicated, reordered and late writes and commits), and a background thread kills prefill or
decode with SIGKILL and restarts it at seeded points of the run.

Checked on every answer:
- **leaks**: no output carries another tenant's canary; a tenant's first request with the public prompt reads
  no cached tokens (the tenant's later public requests wait for that first one: a request sent a moment after it
  can reach prefill first and fill the tenant's own cache, a race the CI soak once lost);
- **wrong statuses**: an over-long prompt is never a 200 (400, or 429/503 while no worker is up); every other
  request is a 200, a capacity or fault answer (429/503), or an integrity failure (500); a 200 reports the
  prompt's true token count (a placeholder would not);
- **hung requests**: none exceeds the client's 90 s limit;
- **pools**: once traffic stops, both pools drain back to free (cached pages count as free) and pass their
  integrity check.

It prints its seed; ``--seed`` replays the same plan and the same fault draws (thread interleavings are not
replayed: the deterministic simulator is the tool for that). Writes bench/out/soak-<seed>.json.

    python bench/soak.py                        # 10,000 requests, 8 clients, kills every ~1,500
    python bench/soak.py --requests 300 --seed 7
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import MODEL, Trio

FAULTS = ("corrupt_page_write=0.02,skip_page_write=0.02,drop_commit=0.01,duplicate_commit=0.02,delay_commit=0.02,"
          "reorder_commit=0.02,corrupt_commit=0.02,delay_page_write=0.02")
TENANTS = 8
CONTEXT = 2048
WORDS = ["harbor", "lantern", "granite", "copper", "meadow", "violet", "thunder", "saddle", "orchard", "pepper", "walnut", "glacier", "falcon", "tunnel", "marble", "cinder", "oyster", "velvet", "quartz", "timber", "anchor", "basket", "canyon", "dolphin", "ember", "fossil"]
PUBLIC = ("Public notice for all visitors: the museum opens at nine, closes at five, and the lighthouse tower is "
          "closed on windy days. Tickets are sold at the harbor gate. ") * 6
HUNG_S = 90.0
RETRY_S = 40.0  # a normal request retries capacity and fault answers this long (a worker restart takes ~15 s)


def plan(seed: int, requests: int) -> tuple[list[dict], dict[int, str]]:
    rng = random.Random(seed)
    canaries = {t: f"ZQX{rng.getrandbits(24):06X}" for t in range(TENANTS)}
    private = {t: f"Tenant {t} confidential memo, code {canaries[t]}. " * 3 +
               " ".join(rng.choices(WORDS, k=120)) + ". " for t in range(TENANTS)}
    jobs = []
    for i in range(requests):
        t = rng.randrange(TENANTS)
        kind = rng.choices(["normal", "stream_drop", "give_up", "overlong"], weights=[80, 8, 6, 6])[0]
        base = rng.choice(["private", "public", "fresh"])
        prefix = {"private": private[t], "public": PUBLIC, "fresh": ""}[base]
        text = prefix + " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))
        if kind == "overlong":
            text = "word " * (CONTEXT + 200)
        jobs.append({"i": i, "tenant": t, "kind": kind, "base": base, "prompt": text,
                     "max_tokens": rng.randint(1, 12), "drop_after": rng.randint(1, 4)})
    return jobs, canaries


def soak(seed: int, requests: int, clients: int = 8, kills: int | None = None, dtype: str = "auto",
         log: bool = True, unsafe: tuple[str, ...] = ()) -> dict:
    """``unsafe``: protections switched off (``--unsafe-no-…`` flags), to show the checks go red."""
    jobs, canaries = plan(seed, requests)
    kills = max(1, requests // 1500) if kills is None else kills
    rng = random.Random(seed + 1)
    kill_at = sorted(rng.sample(range(requests // 10, max(requests // 10 + 1, requests * 9 // 10)), kills))
    kill_who = [rng.choice(["prefill", "decode"]) for _ in kill_at]
    keys = [f"key-{t}=tenant-{t}" for t in range(TENANTS)]
    env = {"KVSEAL_FAULTS": FAULTS, "KVSEAL_FAULT_SEED": str(seed), "KVSEAL_FAULT_DELAY": "0.5",
           "KVSEAL_UNSAFE": "1" if unsafe else "0"}
    worker = ["--dtype", dtype, "--context", str(CONTEXT), "--kv-pool-tokens", "16384", *unsafe]
    router = ["--timeout", "20", *unsafe] + [x for k in keys for x in ("--api-key", k)]
    findings: list[str] = []
    codes: collections.Counter = collections.Counter()
    stats = collections.Counter()
    # A tenant's first public-prompt request (in plan order) is its pioneer: the tenant's later public requests
    # wait until it has finished, so nothing of the tenant's own can have filled the cache before it. (Marking
    # "first" when a client thread starts is racy: the next request's prefill can overtake it.)
    pioneer: dict[int, int] = {}
    for job in jobs:
        if job["base"] == "public" and job["kind"] != "overlong":
            pioneer.setdefault(job["tenant"], job["i"])
    pioneer_done = {tenant: threading.Event() for tenant in pioneer}
    lock = threading.Lock()
    done = [0]
    t_start = time.time()
    with Trio(worker, router, env=env) as t, httpx.Client(timeout=HUNG_S, limits=httpx.Limits(max_connections=64)) as http:
        counts: dict[str, int] = {}

        def n_tokens(text: str) -> int:
            if text not in counts:
                r = http.post(t.url + "/tokenize", headers={"Authorization": "Bearer key-0"},
                              json={"model": MODEL, "prompt": text})
                counts[text] = r.json()["count"]
            return counts[text]

        def one(job: dict) -> None:
            is_pioneer = pioneer.get(job["tenant"]) == job["i"]
            if job["base"] == "public" and job["kind"] != "overlong" and not is_pioneer:
                pioneer_done[job["tenant"]].wait(HUNG_S + RETRY_S)  # the pioneer runs already: queued earlier
            try:
                one_request(job, is_pioneer and job["kind"] == "normal")
            finally:
                if is_pioneer:
                    pioneer_done[job["tenant"]].set()

        def one_request(job: dict, first_public: bool) -> None:
            key = f"key-{job['tenant']}"
            body = {"model": MODEL, "prompt": job["prompt"], "max_tokens": job["max_tokens"], "temperature": 0}
            headers = {"Authorization": f"Bearer {key}"}
            t0 = time.time()
            status, out = -1, {}
            try:
                if job["kind"] == "stream_drop":
                    with http.stream("POST", t.url + "/v1/completions", headers=headers,
                                     json={**body, "stream": True, "max_tokens": 12}) as r:
                        status = r.status_code
                        for n, _ in enumerate(r.iter_lines()):
                            if n >= job["drop_after"]:
                                break
                elif job["kind"] == "give_up":
                    try:
                        r = http.post(t.url + "/v1/completions", headers=headers, json={**body, "max_tokens": 12},
                                      timeout=0.3)
                        status = r.status_code
                    except httpx.TimeoutException:
                        status = 0  # the client left
                else:  # as the openai client does: a 429/503 is retried after its Retry-After, for a while
                    while True:
                        r = http.post(t.url + "/v1/completions", headers=headers, json=body)
                        status, out = r.status_code, r.json()
                        if status not in (429, 503) or time.time() - t0 > RETRY_S:
                            break
                        stats["retries"] += 1
                        first_public = False  # its own first attempt may have filled the cache
                        time.sleep(float(r.headers.get("retry-after", "1")))
            except httpx.TimeoutException:
                status = -1
            except httpx.HTTPError as e:
                status = -2
                out = {"error": repr(e)}
            took = time.time() - t0
            bad = check(job, status, out, took, canaries, first_public, n_tokens)
            with lock:
                codes[f"{job['kind']}:{status}"] += 1
                findings.extend(bad)
                if status == 200 and job["kind"] == "normal":
                    cached = out.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
                    stats[f"{job['base']}_requests"] += 1
                    stats[f"{job['base']}_hits"] += cached > 0
                done[0] += 1

        def killer() -> None:
            for at, who in zip(kill_at, kill_who):
                while done[0] < at:
                    time.sleep(0.1)
                if log:
                    print(f"soak: kill -9 {who} after {done[0]} requests", flush=True)
                (t.pre if who == "prefill" else t.dec).restart()
                stats[f"killed_{who}"] += 1

        k = threading.Thread(target=killer, daemon=True)
        k.start()
        with ThreadPoolExecutor(clients) as ex:
            list(ex.map(one, jobs))
        k.join()
        wall = time.time() - t_start
        pools, drained = {}, False
        deadline = time.time() + 60
        while time.time() < deadline:
            pools = {name: s.health() for name, s in (("prefill", t.pre), ("decode", t.dec))}
            drained = all(p["free_pages"] == p["total_pages"] and p.get("integrity_ok", False) for p in pools.values())
            if drained:
                break
            time.sleep(0.5)
        if not drained:
            brief = {n: {k: v for k, v in p.items() if k != "machine"} for n, p in pools.items()}
            findings.insert(0, f"pools did not drain: {brief}")  # first: the test shows the first findings
    keep = ("free_pages", "total_pages", "cached_pages", "integrity_ok", "running", "waiting")
    return {"seed": seed, "requests": requests, "clients": clients, "wall_s": round(wall, 1),
            "kills": list(zip(kill_at, kill_who)), "codes": dict(sorted(codes.items())), "stats": dict(stats),
            "pools_after": {n: {k: p.get(k) for k in keep} for n, p in pools.items()},
            "findings": findings, "ok": not findings}


def check(job: dict, status: int, out: dict, took: float, canaries: dict[int, str], first_public: bool,
          n_tokens) -> list[str]:
    who = f"request {job['i']} (tenant {job['tenant']}, {job['kind']}, {job['base']})"
    if status == -1 or took > HUNG_S:
        return [f"{who}: hung ({took:.0f} s)"]
    if status == -2:
        return [f"{who}: connection failed: {out.get('error')}"]
    if job["kind"] in ("stream_drop", "give_up"):
        return [] if status in (0, 200, 429, 503, 500) else [f"{who}: status {status}"]
    if job["kind"] == "overlong":
        return [] if status in (400, 429, 503) else [f"{who}: over-long prompt answered {status}"]
    if status not in (200, 429, 503, 500):
        return [f"{who}: status {status} {str(out)[:120]}"]
    if status != 200:
        return []
    bad = []
    text = out["choices"][0]["text"]
    for t, c in canaries.items():
        if t != job["tenant"] and c in text:
            bad.append(f"{who}: output carries tenant {t}'s canary {c}")
    usage = out["usage"]
    if usage["prompt_tokens"] != n_tokens(job["prompt"]):
        bad.append(f"{who}: usage says {usage['prompt_tokens']} prompt tokens, the prompt has {n_tokens(job['prompt'])}")
    if first_public and usage.get("prompt_tokens_details", {}).get("cached_tokens", 0):
        bad.append(f"{who}: its first public-prompt request read {usage['prompt_tokens_details']} from the cache")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kills", type=int, default=None, help="worker kills (default: one per 1,500 requests)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="the workers' --dtype (auto: bf16 where the CPU has bf16 dot products, else fp32)")
    ap.add_argument("--unsafe", action="append", default=[], metavar="FLAG",
                    help="switch a protection off (e.g. --unsafe=--unsafe-no-cache-salt) to see the checks go red")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else secrets.randbits(31)
    print(f"soak: seed {seed} (replay with --seed {seed})", flush=True)
    res = soak(seed, a.requests, a.clients, a.kills, a.dtype, unsafe=tuple(a.unsafe))
    print(json.dumps({k: v for k, v in res.items() if k != "findings"}, indent=2))
    for f in res["findings"][:50]:
        print("finding:", f)
    out = Path("bench/out") / f"soak-{seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"soak: {'OK' if res['ok'] else 'FAILED'} (seed {seed})")
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
