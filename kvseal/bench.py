"""``kvseal bench``: N concurrent streams against any OpenAI-compatible server, plus an HF baseline.

Each stream sends one streaming /v1/completions request with a fixed-length token prompt and
``ignore_eos`` so every request produces exactly ``--output`` tokens. Reports TTFT and inter-token latency
(p50/p99), aggregate output tokens/s, the server's peak RSS (sampled by pid), and, for a server that exposes
kvseal's engine counters, where each step's time went (weight matmuls, attention, the rest of the forward,
sampling, scheduling, core-lock wait, event hand-off, HTTP/streaming); writes JSON and a PNG.
``--hf-baseline`` runs transformers ``generate`` on the same model and batch sizes in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Self

import httpx
import numpy as np

if TYPE_CHECKING:
    import torch


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="the key to send (a server started with --api-key)")
    p.add_argument("--streams", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--output", type=int, default=128, help="output tokens per request")
    p.add_argument("--requests-per-stream", type=int, default=1)
    p.add_argument("--server-pid", type=int, default=None, help="pid whose RSS (with children) to sample")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else each token is drawn")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="0: off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="0: off")
    p.add_argument("--hf-baseline", action="store_true")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--out", default="bench/out/serving")


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str, n_out: int,
              extra: dict | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "stream": True,
            "ignore_eos": True, **(extra or {})}
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if "error" in json.loads(line[6:]):
                    raise RuntimeError(line)
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "itl": list(np.diff(stamps)), "n": n_out, "end": stamps[-1]}


async def level(url: str, model: str, streams: int, n_prompt: int, n_out: int, per_stream: int,
                as_text: Callable[[list[int]], str] | None = None, extra: dict | None = None,
                key: str | None = None) -> dict:
    """``as_text``: send prompts as text (for servers that take no token ids); ``extra``: more body fields."""
    rng = random.Random(streams)
    limits = httpx.Limits(max_connections=streams + 4)
    text = as_text or (lambda ids: ids)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
        async def worker() -> list[dict]:
            return [await one(client, url, model, text([rng.randrange(100, 40000) for _ in range(n_prompt)]), n_out,
                              extra) for _ in range(per_stream)]

        await one(client, url, model, text([5] * 8), 2, extra)  # warm-up
        t0 = time.perf_counter()
        res = [r for rs in await asyncio.gather(*[worker() for _ in range(streams)]) for r in rs]
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in res]
    itl = [x for r in res for x in r["itl"]] or [0.0]  # one-token answers have no gaps
    return {"streams": streams, "requests": len(res), "output_tok_s": sum(r["n"] for r in res) / wall,
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
            "itl_p50": float(np.percentile(itl, 50)), "itl_p99": float(np.percentile(itl, 99)), "wall_s": wall}


class RssSampler:
    def __init__(self, pid: int | None) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while self.pid and not self._stop.is_set():
            try:
                p = psutil.Process(self.pid)
                rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
                self.peak = max(self.peak, rss)
            except psutil.Error:
                return
            time.sleep(0.2)

    def __enter__(self) -> Self:
        self._t.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()


def hf_model(dtype: torch.dtype, path: str | None = None) -> object:
    """A plain transformers LlamaForCausalLM holding the same dequantized weights kvseal serves.

    transformers' own GGUF loader (5.x) keeps the weights packed and dequantizes in every matmul, which makes
    it several times slower than an ordinary bf16 model; the baseline should be HF at its best.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvseal.model.loader import _read_gguf, default_model_path

    cfg, raw = _read_gguf(Path(path) if path else default_model_path(), progress=False)
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_eps,
                         max_position_embeddings=cfg.max_context, tie_word_embeddings=cfg.tie_embeddings,
                         bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids))
    m = LlamaForCausalLM(hf_cfg)
    m.load_state_dict(raw, strict=False)
    m.tie_weights()
    return m.to(dtype).eval()


def hf_baseline(streams: list[int], n_prompt: int, n_out: int, dtype: str) -> list[dict]:
    """transformers ``generate`` on the same model, batch = streams, exactly n_out new tokens."""
    import torch

    from kvseal.engine.build import off_main_thread

    def run() -> list[dict]:
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        hf = hf_model(dt)
        out = []
        for b in streams:
            x = torch.randint(100, 40000, (b, n_prompt))
            kw = {"attention_mask": torch.ones_like(x), "do_sample": False, "pad_token_id": 0}
            hf.generate(x[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
            t0 = time.perf_counter()
            hf.generate(x, max_new_tokens=n_out, min_new_tokens=n_out, **kw)
            wall = time.perf_counter() - t0
            out.append({"streams": b, "output_tok_s": b * n_out / wall, "wall_s": wall})
        return out

    return off_main_thread(run)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    lv = result["levels"]
    ax[0].plot([r["streams"] for r in lv], [r["output_tok_s"] for r in lv], "o-", label="kvseal")
    if result.get("hf"):
        ax[0].plot([r["streams"] for r in result["hf"]], [r["output_tok_s"] for r in result["hf"]], "s--",
                   label="HF generate")
    ax[0].set(xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    ax[0].legend()
    ax[1].plot([r["streams"] for r in lv], [r["itl_p50"] * 1e3 for r in lv], "o-", label="ITL p50")
    ax[1].plot([r["streams"] for r in lv], [r["itl_p99"] * 1e3 for r in lv], "o--", label="ITL p99")
    ax[1].set(xlabel="concurrent streams", ylabel="ms", title="inter-token latency")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path)


def engine_counters(url: str) -> dict[str, float]:
    """The server's ``kvseal_engine_seconds_total{phase}`` and ``kvseal_engine_steps_total`` (empty for a server
    that does not expose them: a router, another engine)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith('kvseal_engine_seconds_total{phase="'):
            out[line.split('"')[1]] = float(line.split()[-1])
        elif line.startswith("kvseal_engine_steps_total "):
            out["steps"] = float(line.split()[-1])
    return out


def step_breakdown(before: dict[str, float], after: dict[str, float], wall: float) -> dict | None:
    """Milliseconds per engine step by phase over one level; ``http_streaming`` is the wall time per step the
    engine did not account for (event loop, SSE, client), on a server where engine and HTTP share the cores."""
    steps = after.get("steps", 0) - before.get("steps", 0)
    if not steps:
        return None
    ms = {k: (after[k] - before.get(k, 0.0)) / steps * 1e3 for k in after if k != "steps"}
    ms["http_streaming"] = max(0.0, wall / steps * 1e3 - sum(ms.values()))
    return {"steps": int(steps), "ms_per_step": ms}


def run(a: argparse.Namespace) -> dict:
    streams = [int(s) for s in a.streams.split(",")]
    model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]  # open, as vLLM's
    levels = []
    sampling = {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k}
    for k, off in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
        if getattr(a, k) != off:  # sent only when asked for
            sampling[k] = getattr(a, k)
    with RssSampler(a.server_pid) as rss:
        for s in streams:
            before = engine_counters(a.url)
            lv = asyncio.run(level(a.url, model, s, a.prompt, a.output, a.requests_per_stream, key=a.api_key,
                                   extra=sampling))
            lv["step_breakdown"] = step_breakdown(before, engine_counters(a.url), lv["wall_s"])
            levels.append(lv)
    result = {"url": a.url, "model": model, "prompt": a.prompt, "output": a.output, "sampling": sampling,
              "levels": levels,
              "server_peak_rss_mib": rss.peak / 2**20 if rss.peak else None}
    if a.hf_baseline:
        result["hf"] = hf_baseline(streams, a.prompt, a.output, a.dtype)
        result["ratio_vs_hf"] = {str(x["streams"]): k["output_tok_s"] / x["output_tok_s"]
                                 for k, x in zip(levels, result["hf"])}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    for lv in levels:
        b = lv["step_breakdown"]
        if b:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(b["ms_per_step"].items(), key=lambda kv: -kv[1]))
            print(f"{lv['streams']} streams, ms per step ({b['steps']} steps): {parts}")
    return result
