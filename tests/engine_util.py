"""Run greedy generations on an in-process engine and collect their tokens."""

from __future__ import annotations

import itertools
import threading

from kvseal.config import EngineConfig, PoolConfig
from kvseal.engine.engine import Engine
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Sequence
from kvseal.kv.pool import PagePool

_rids = itertools.count(1)


def make_engine(lm, pages: int = 1024, dtype: str = "fp32", **kw) -> Engine:
    m = lm.model.cfg
    cfg = EngineConfig(pool=PoolConfig(num_pages=pages), dtype=dtype, **kw)
    pool = PagePool(cfg.pool, m.num_layers, m.num_kv_heads, m.head_dim, lm.model.dtype)
    return Engine(cfg, lm.model, pool).start()


def chat_ids(lm, text: str) -> list[int]:
    return list(lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int, eos=(), timeout: float = 300,
             params: SamplingParams | None = None) -> list[list[int]]:
    """Submit all prompts at once (so they batch) and wait for every final event."""
    outs: list[list[int]] = [[] for _ in prompts]
    finals: list = [None] * len(prompts)
    done = threading.Event()
    left = [len(prompts)]
    lock = threading.Lock()

    def sink_for(i):
        def sink(ev):
            outs[i].extend(ev.token_ids)
            if ev.finish_reason:
                finals[i] = ev
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return sink

    p = params or SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, ids in enumerate(prompts):
        engine.submit(Sequence(next(_rids), ids, p, sink_for(i), eos_ids=frozenset(eos)))
    assert done.wait(timeout), "generation hung"
    for f in finals:
        assert f.error is None, f.error
    return outs
