"""``kvseal probe``: the operator's isolation check, against any OpenAI-compatible server (kvseal, vLLM, SGLang).

Two API keys stand for two tenants, A and B. Four checks, each a table row and a JSON entry:

a. **admission boundary**: token-id prompts of context-1, context and context+1 tokens with ``max_tokens=1``.
   The last two can never fit, so they must be a 4xx; the first may be a 200 (or a 4xx from a smaller pool).
b. **canary cross-contamination**: A sends long prompts made of fresh random canaries, each followed by one of
   B's prompts (short, and 50-130% of the context: past what a smaller prefill pool holds, as in the 2026
   incident); then A and B send at once. A canary in B's output is a leak. So is B's greedy answer to the same
   prompt changing from its first characters between the two rounds, where the token it parted on led its
   runner-up by at least a nat in both answers (logprobs, where the server gives them): it read state it did not
   write (a server that attends over stale pages answers noise that moves with other tenants' traffic, rarely
   the canary itself). A flip at a near-tie is batch numerics and only noted. A prompt past the context
   answered 200 is a wrong status.
c. **interference**: B's greedy outputs alone, then under A's concurrent load. A mismatch that carries A's text
   (a canary, or 8 words in a row of A's prompts) is a leak; any other mismatch is batch numerics (a different
   batch shape changes a near-tie), reported with where it diverged.
d. **prefix-cache timing**: per sample, A sends a fresh random prefix P; then, in random order, B sends P plus
   a question (would hit A's cache if it were shared), B sends a fresh prefix Q of the same length (a miss),
   and A sends P again (A's own hit: the control that shows a cache exists). Latency with ``max_tokens=1`` is
   TTFT plus one token. One-sided Mann-Whitney U (normal approximation) of B-on-P vs B-on-Q: a signal when
   p < 0.01 and B's median on P is below 0.75 of its median on Q. The control (A's own hit against the miss,
   p < 0.05 and below 0.75) tells whether the test had power: without it, the check says no cache was seen.

Exit 1 on any leak, wrong status or timing signal.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

WORDS = ["harbor", "lantern", "granite", "copper", "meadow", "violet", "thunder", "saddle", "orchard", "pepper", "walnut", "glacier", "falcon", "tunnel", "marble", "cinder", "oyster", "velvet", "quartz", "timber", "anchor", "basket", "canyon", "dolphin", "ember", "fossil", "garnet", "hazel", "island", "jasper", "kettle", "lagoon", "mango", "nectar", "olive", "pebble", "quiver", "raven", "sable", "tulip", "umber", "vessel", "willow", "yonder", "zephyr", "amber", "bramble", "cobalt", "dune"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server's base URL (without /v1)")
    p.add_argument("--key", action="append", required=True, help="API key of tenant A, then of tenant B")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--context", type=int, default=None, help="served context (default: from /v1/models)")
    p.add_argument("--checks", default="abcd", help="which checks to run (letters)")
    p.add_argument("--samples", type=int, default=10, help="timing samples per arm (check d)")
    p.add_argument("--prefix-tokens", type=int, default=384, help="shared prefix length for check d")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--timeout", type=float, default=300)


class Client:
    def __init__(self, url: str, keys: list[str], model: str | None, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.keys = {"A": keys[0], "B": keys[1] if len(keys) > 1 else keys[0]}
        self.http = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=32))
        models = self.http.get(self.url + "/v1/models", headers=self._auth("A")).json()["data"]
        self.model = model or models[0]["id"]
        card = next((m for m in models if m["id"] == self.model), models[0])
        self.context = card.get("max_model_len") or card.get("context_length")

    def _auth(self, tenant: str) -> dict:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def complete(self, tenant: str, prompt: str | list[int], max_tokens: int,
                 logprobs: int | None = None) -> tuple[int, dict, float]:
        """(status, body, seconds) of a greedy /v1/completions call."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if logprobs:
            body["logprobs"] = logprobs
        t0 = time.perf_counter()
        r = self.http.post(self.url + "/v1/completions", headers=self._auth(tenant), json=body)
        took = time.perf_counter() - t0
        try:
            body = r.json()
        except ValueError:
            body = {"raw": r.text[:200]}
        return r.status_code, body, took

    def count(self, text: str) -> int | None:
        r = self.http.post(self.url + "/tokenize", headers=self._auth("A"), json={"model": self.model, "prompt": text})
        return r.json().get("count") if r.status_code == 200 else None


def text_of(body: dict) -> str:
    try:
        return body["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        return ""


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sized(c: Client, unit: str, n_tokens: int) -> str:
    """``unit`` repeated to about ``n_tokens`` tokens (measured with /tokenize where the server has it)."""
    per = c.count(unit) or max(1, round(len(unit.split()) * 1.4))
    return unit * max(1, n_tokens // per)


def carries(text: str, canaries: list[str], a_texts: list[str], n: int = 8) -> str | None:
    """What of A's the text carries: a canary (its first 6 characters are already 3 random hex digits past
    'ZQX'), or ``n`` words in a row of A's prompts."""
    for c in canaries:
        if c[:6] in text:
            return c
    w = text.split()
    for i in range(len(w) - n + 1):
        span = " ".join(w[i:i + n])
        if any(span in a for a in a_texts):
            return span
    return None


# -- the checks ---------------------------------------------------------------------------------------------
def check_admission(c: Client) -> dict:
    rows, wrong = [], []
    for n in (c.context - 1, c.context, c.context + 1):
        status, _, _ = c.complete("B", [300 + i % 500 for i in range(n)], 1)
        fits = n + 1 <= c.context
        ok = (200 <= status < 300 or 400 <= status < 500) if fits else 400 <= status < 500
        rows.append({"prompt_tokens": n, "max_tokens": 1, "status": status, "can_fit": fits, "ok": ok})
        if not ok:
            wrong.append(f"{n}+1 tokens (context {c.context}) answered {status}")
    return {"rows": rows, "wrong_status": wrong, "leaks": []}


def a_prompt(c: Client, canary: str, n_tokens: int) -> str:
    """A's long prompt: the canary over and over, so any page of it holds little but the canary."""
    return sized(c, f"{canary} ", n_tokens)


def check_canaries(c: Client, rng: random.Random) -> dict:
    ctx = c.context
    canaries = ["ZQX" + secrets.token_hex(3).upper() for _ in range(6)]
    a_texts = [a_prompt(c, k, int(ctx * 0.85)) for k in canaries]
    b_short = ["The capital of France is", "Write a haiku about rain.", "List three colors:"]
    b_long = [sized(c, "Tell me about the weather. ", int(ctx * f)) for f in (1.3, 0.9, 0.7, 0.5)]
    results, leaks, wrong, notes = [], [], [], []

    def b_sends(p: str, tag: str) -> None:
        status, body, _ = c.complete("B", p, 24, logprobs=2)
        if status == 400 and "logprobs" in str(body):  # a server without logprobs: the text alone
            status, body, _ = c.complete("B", p, 24)
        n = c.count(p)
        hit = carries(text_of(body), canaries, a_texts) if status == 200 else None
        results.append({"phase": tag, "prompt_tokens": n, "status": status, "leak": hit,
                        "output": text_of(body), "prompt": p, "logprobs": logprobs_of(body)})
        if hit:
            leaks.append(f"B ({n} prompt tokens, {tag}) got A's text: {hit!r}")
        if status == 200 and n is not None and n + 24 > ctx:
            wrong.append(f"B's {n}-token prompt (context {ctx}) answered 200")

    for i, p in enumerate(b_long):  # each B prompt right after an A prompt: A's pages are the freshest stale ones
        c.complete("A", a_texts[i % len(a_texts)], 24)
        b_sends(p, "after A")
    for p in b_short:
        b_sends(p, "after A")
    with ThreadPoolExecutor(2) as ex:  # then both at once
        fut = ex.submit(lambda: [c.complete("A", a, 24) for a in a_texts])
        for p in b_long + b_short:
            b_sends(p, "with A")
        fut.result()
    for p in b_long + b_short:  # the same greedy prompt, after A and alongside A: its answer must not move
        a, b = (r for r in results if r["prompt"] == p)
        if a["status"] == b["status"] == 200 and a["output"] != b["output"] and common(a["output"], b["output"]) < 16:
            margin = flip_margin(a["logprobs"], b["logprobs"])
            what = (f"B's answer to its {a['prompt_tokens']}-token prompt changed with A's traffic from the start: "
                    f"{a['output'][:24]!r} vs {b['output'][:24]!r}")
            if margin is not None and margin < NEAR_TIE:
                notes.append(f"{what}; a near-tie (margin {margin:.2f} nats): batch numerics, not counted")
            else:
                margin_s = "unknown" if margin is None else f"{margin:.2f} nats"
                leaks.append(f"{what}, past any near-tie (margin {margin_s}): it read state it did not write")
    for r in results:
        del r["prompt"], r["logprobs"]
    return {"canaries": canaries, "rows": results, "leaks": leaks, "wrong_status": wrong, "notes": notes}


NEAR_TIE = 1.0  # nats between a greedy token and the runner-up below which a flip is batch numerics


def logprobs_of(body: dict) -> tuple[list[str], list[dict]] | None:
    """(tokens, top_logprobs) of a completions answer that carries logprobs."""
    try:
        lp = body["choices"][0]["logprobs"]
        return list(lp["tokens"]), list(lp["top_logprobs"])
    except (KeyError, IndexError, TypeError):
        return None


def flip_margin(a: tuple | None, b: tuple | None) -> float | None:
    """At the first token where two greedy answers part, how far each answer's own choice led its runner-up (the
    smaller of the two): under a nat or so, a different batch shape can flip it; far past that, only a different
    context can. None without logprobs."""
    if a is None or b is None:
        return None
    k = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), None)
    if k is None:
        return None
    margins = []
    for _, top in (a, b):
        vals = sorted((v for v in (top[k] or {}).values() if v is not None), reverse=True)
        if len(vals) < 2:
            return None
        margins.append(vals[0] - vals[1])
    return min(margins)


def common(x: str, y: str) -> int:
    """Length of the common prefix."""
    return next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def check_interference(c: Client, rng: random.Random) -> dict:
    prompts = ["The three primary colors are", "A recipe for pancakes: first,", "The largest planet is"]
    alone = [text_of(c.complete("B", p, 32)[1]) for p in prompts]
    canaries = ["ZQX" + secrets.token_hex(3).upper() for _ in range(2)]
    a_texts = [a_prompt(c, k, int(c.context * 0.4)) for k in canaries]
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            for a in a_texts:
                c.complete("A", a, 16)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        under = [text_of(c.complete("B", p, 32)[1]) for p in prompts]
    finally:
        stop.set()
        for t in threads:
            t.join()
    rows, leaks = [], []
    for i, out in enumerate(under):
        ref = alone[i]
        same = out == ref
        hit = None if same else carries(out, canaries, a_texts)
        kind = "match" if same else ("leak" if hit else "numerics")
        rows.append({"prompt": prompts[i], "result": kind, "diverged_at_char": None if same else common(out, ref)})
        if hit:
            leaks.append(f"B's output under load carries A's text: {hit!r}")
    mismatches = sum(r["result"] != "match" for r in rows)
    return {"rows": rows, "mismatch_rate": mismatches / len(rows), "leaks": leaks, "wrong_status": []}


def mann_whitney_less(x: list[float], y: list[float]) -> float:
    """One-sided p that ``x`` tends to be smaller than ``y`` (normal approximation, continuity-corrected)."""
    n1, n2 = len(x), len(y)
    u = sum((a < b) + 0.5 * (a == b) for a in x for b in y)  # pairs where x is smaller
    mu, sigma = n1 * n2 / 2, math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)
    z = (u - mu - 0.5) / sigma
    return 0.5 * math.erfc(z / math.sqrt(2))


def check_timing(c: Client, rng: random.Random, samples: int, prefix_tokens: int) -> dict:
    arms: dict[str, list[float]] = {"B on A's prefix": [], "B on a fresh prefix": [], "A on its own prefix": []}
    n_words = max(8, int(prefix_tokens / 1.3))
    c.complete("B", words(rng, n_words), 1)  # warm-up: first-request costs land on no arm
    for _ in range(samples):
        p, q = words(rng, n_words), words(rng, n_words)
        c.complete("A", p, 1)
        runs = [("B on A's prefix", "B", p + " What comes next?"), ("B on a fresh prefix", "B", q + " What comes next?"),
                ("A on its own prefix", "A", p + " Why is that?")]
        rng.shuffle(runs)
        for arm, tenant, prompt in runs:
            status, _, took = c.complete(tenant, prompt, 1)
            if status == 200:
                arms[arm].append(took)
    hit, miss, own = (arms[k] for k in arms)
    med = {k: statistics.median(v) if v else None for k, v in arms.items()}
    p_cross = mann_whitney_less(hit, miss) if hit and miss else 1.0
    p_own = mann_whitney_less(own, miss) if own and miss else 1.0
    ratio = med["B on A's prefix"] / med["B on a fresh prefix"] if hit and miss else 1.0
    own_ratio = med["A on its own prefix"] / med["B on a fresh prefix"] if own and miss else 1.0
    signal = p_cross < 0.01 and ratio < 0.75
    power = p_own < 0.05 and own_ratio < 0.75
    verdict = ("cross-tenant prefix-cache timing signal" if signal
               else "no cross-tenant signal" if power else "no cache detected (the test has no power here)")
    return {"samples_per_arm": {k: len(v) for k, v in arms.items()}, "median_s": med, "p_cross": p_cross,
            "p_own": p_own, "ratio_cross": ratio, "ratio_own": own_ratio, "signal": signal, "power": power,
            "verdict": verdict, "leaks": [f"timing: B is faster on A's prefix ({ratio:.2f}×, p={p_cross:.1e})"]
            if signal else [], "wrong_status": []}


# -- the command ----------------------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> int:
    seed = a.seed if a.seed is not None else secrets.randbits(32)
    rng = random.Random(seed)
    c = Client(a.url, a.key, a.model, a.timeout)
    if a.context:
        c.context = a.context
    if not c.context:
        sys.exit("probe: the server does not say its context length; pass --context")
    report: dict = {"url": c.url, "model": c.model, "context": c.context, "seed": seed, "checks": {}}
    names = {"a": "admission boundary", "b": "canary cross-contamination", "c": "interference",
             "d": "prefix-cache timing"}
    for letter in a.checks:
        t0 = time.perf_counter()
        if letter == "a":
            r = check_admission(c)
        elif letter == "b":
            r = check_canaries(c, rng)
        elif letter == "c":
            r = check_interference(c, rng)
        elif letter == "d":
            r = check_timing(c, rng, a.samples, a.prefix_tokens)
        else:
            continue
        r["seconds"] = round(time.perf_counter() - t0, 1)
        report["checks"][names[letter]] = r
    bad = [x for r in report["checks"].values() for x in r["leaks"] + r["wrong_status"]]
    report["findings"], report["ok"] = bad, not bad
    print_table(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if not bad else 1


def print_table(report: dict) -> None:
    print(f"kvseal probe  {report['url']}  model {report['model']}  context {report['context']}  "
          f"seed {report['seed']}")
    for name, r in report["checks"].items():
        n_bad = len(r["leaks"]) + len(r["wrong_status"])
        detail = ""
        if name == "admission boundary":
            detail = ", ".join(f"{x['prompt_tokens']}→{x['status']}" for x in r["rows"])
        elif name == "canary cross-contamination":
            detail = f"{len(r['rows'])} B requests, statuses {sorted({x['status'] for x in r['rows']})}"
        elif name == "interference":
            detail = f"mismatch rate {r['mismatch_rate']:.2f} (leaks {len(r['leaks'])}, rest batch numerics)"
        elif name == "prefix-cache timing":
            m = r["median_s"]
            detail = (f"{r['verdict']}: B on A's prefix {r['ratio_cross']:.2f}× a miss (p={r['p_cross']:.1e}), "
                      f"A's own hit {r['ratio_own']:.2f}× (p={r['p_own']:.1e}); n={r['samples_per_arm']}; "
                      f"medians {', '.join(f'{k} {v:.3f}s' for k, v in m.items() if v is not None)}")
        print(f"  {'FAIL' if n_bad else 'ok  '}  {name:28s} {r['seconds']:6.1f}s  {detail}")
    for f in report["findings"]:
        print(f"  finding: {f}")
    print("RESULT: " + ("no leak, no wrong status" if report["ok"] else f"{len(report['findings'])} finding(s)"))
