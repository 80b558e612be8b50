"""What the weight modes cost in quality: perplexity on ``tests/data/passage.txt`` and greedy agreement with
the first mode of each dtype on a set of chat prompts, each mode forced on every row (``small_rows``
unbounded), so the figure is the quantized weights' own, not a mix. bf16: bf16, int8, int4 against bf16;
fp32: exact fp32 weights against bf16 weights read in fp32 (what ``--dtype auto`` runs on a CPU without bf16
dot products). Writes bench/out/quality.json.

    .venv/bin/python bench/quality.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kvseal.config import PoolConfig
from kvseal.engine.build import off_main_thread
from kvseal.engine.runner import Runner
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Sequence
from kvseal.kv.pool import PagePool
from kvseal.model.loader import load

PROMPTS = ["Write a haiku about the sea.", "List three colors.", "Explain what a CPU does in one sentence.",
           "What is the capital of Germany?", "Give me a short recipe for pancakes.",
           "Tell me a fun fact about octopuses.", "Why is the sky blue?", "Name two planets and their moons.",
           "Describe a cat in one sentence.", "What does a compiler do?"]
PASSAGE = Path(__file__).resolve().parent.parent / "tests" / "data" / "passage.txt"


def logits_all(lm, runner: Runner, pool: PagePool, ids: list[int]) -> torch.Tensor:
    """Next-token logits at every position of ``ids`` (one prefill), [len(ids), vocab]."""
    s = Sequence(1, ids, SamplingParams(max_tokens=1, temperature=0), lambda ev: None)
    s.run = pool.allocate(1, pool.cfg.pages_for(len(ids)))
    b = runner.build([(s, len(ids))])
    b.logits_index = torch.arange(len(ids))
    out = lm.model.forward(pool.kv, b)
    pool.free(s.run)
    return out


def greedy(lm, runner: Runner, pool: PagePool, ids: list[int], n: int) -> list[int]:
    s = Sequence(2, ids, SamplingParams(max_tokens=n, temperature=0), lambda ev: None)
    s.run = pool.allocate(2, pool.cfg.pages_for(len(ids) + n))
    out = []
    for _ in range(n):
        fed = len(s.tokens) - s.num_cached
        tok = int(lm.model.forward(pool.kv, runner.build([(s, fed)]))[0].argmax())
        s.num_cached += fed
        s.tokens.append(tok)
        out.append(tok)
    pool.free(s.run)
    return out


def measure(n_tokens: int) -> dict:
    return {"bf16": measure_dtype(torch.bfloat16, ("bf16", "int8", "int4"), n_tokens),
            "fp32": measure_dtype(torch.float32, ("fp32", "bf16"), n_tokens)}


def measure_dtype(dtype: torch.dtype, modes: tuple[str, ...], n_tokens: int) -> dict:
    lm = load(None, dtype, progress=False)
    m = lm.model.cfg
    pool = PagePool(PoolConfig(num_pages=256), m.num_layers, m.num_kv_heads, m.head_dim, dtype)
    runner = Runner(lm.model, pool)
    text = lm.tokenizer.encode(PASSAGE.read_text(), add_special_tokens=False)
    prompts = [list(lm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)) for p in PROMPTS]
    res, ref = {}, None
    for mode in modes:
        lm.model.use_weights(mode, small_rows=1 << 30)
        nll = F.cross_entropy(logits_all(lm, runner, pool, text)[:-1], torch.tensor(text[1:]))
        outs = [greedy(lm, runner, pool, p, n_tokens) for p in prompts]
        ref = ref or outs
        same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r))
        prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o)) for o, r in zip(outs, ref)]
        res[mode] = {"perplexity": math.exp(float(nll)), "greedy_token_agreement": same / (len(prompts) * n_tokens),
                     "greedy_identical_prefix_mean": sum(prefix) / len(prefix),
                     "prompts_fully_identical": sum(p == n_tokens for p in prefix)}
    return {"passage_tokens": len(text), "prompts": len(prompts), "greedy_tokens": n_tokens, "modes": res}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    r = off_main_thread(lambda: measure(ap.parse_args().tokens))
    out = Path("bench/out/quality.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2))
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
