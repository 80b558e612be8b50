"""Assemble a worker's engine: load the model, size and preflight the pool, start the engine thread.

Loading runs on a short-lived thread, not the caller's: PyTorch's OpenMP team stays bound to the first
thread that runs a parallel op, and if that is the main (HTTP) thread, the engine thread's kernels run 2-3×
slower. Keeping the main thread free of parallel torch work avoids it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvseal.config import EngineConfig, PoolConfig, Protections
from kvseal.engine.engine import Engine
from kvseal.engine.grammar import Grammars
from kvseal.kv.pool import PagePool
from kvseal.kv.preflight import Sizing, pool_tokens_for, preflight
from kvseal.model.loader import LoadedModel, load


@dataclass(frozen=True)
class WorkerSpec:
    model: str | None = None
    dtype: str = "bf16"
    kv_pool_tokens: int | None = None
    kv_memory_gib: float = 1.5
    page_size: int = 16
    context: int | None = None
    allow_pool_below_context: bool = False
    max_running: int = 64
    step_token_budget: int = 512
    weights: str = "bf16"  # kvseal.model.quant.WEIGHT_MODES
    threads: int = 0
    share_cores: str | None = None  # lock file shared with another engine on this host (CoreLock)
    scrub_on_free: bool = False
    prefix_cache: bool = True
    protections: Protections = field(default_factory=Protections)


def off_main_thread(fn: Callable[[], object]) -> object:
    """Run ``fn`` (model loading, weight packing: anything with large PyTorch ops) on a short-lived thread.

    Every thread that runs an OpenMP region keeps a team of worker threads. Once the main thread has one
    beside the engine thread's, libgomp counts more OpenMP threads than cores and throttles its spin-wait
    (to ~1,000 spins whatever GOMP_SPINCOUNT says), so the engine's workers sleep between the many short
    regions of a step and every region pays a futex wake-up: measured 2x slower batch-1 steps. A finished
    thread's team goes away with it."""
    box: dict = {}

    def run() -> None:
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["e"] = e

    t = threading.Thread(target=run, name="kvseal-load")
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


def build_engine(spec: WorkerSpec, role: str = "colocated", storage: Callable | None = None,
                 handoff: Callable | None = None, metrics: object = None,
                 loaded: LoadedModel | None = None) -> tuple[Engine, LoadedModel, Sizing]:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[spec.dtype]
    lm = loaded or off_main_thread(lambda: load(spec.model, dtype))
    m = lm.model.cfg
    if lm.model.weights_mode != spec.weights:
        off_main_thread(lambda: lm.model.use_weights(spec.weights))
    tokens = spec.kv_pool_tokens or pool_tokens_for(m, dtype, int(spec.kv_memory_gib * 2**30), spec.page_size)
    sizing = preflight(m, dtype, tokens, spec.context, spec.allow_pool_below_context)
    pool_cfg = PoolConfig(num_pages=tokens // spec.page_size, page_size=spec.page_size,
                          scrub_on_free=spec.scrub_on_free)
    kv = storage(pool_cfg, m, dtype) if storage else None
    pool = PagePool(pool_cfg, m.num_layers, m.num_kv_heads, m.head_dim, dtype, storage=kv)
    cfg = EngineConfig(pool=pool_cfg, dtype=spec.dtype, max_running=spec.max_running,
                       step_token_budget=spec.step_token_budget, context_window=sizing.served_context,
                       threads=spec.threads, prefix_cache=spec.prefix_cache, protections=spec.protections)
    engine = Engine(cfg, lm.model, pool, role=role, handoff=handoff, metrics=metrics)
    engine.grammars = Grammars(lm.tokenizer, m.vocab_size)
    if spec.share_cores:
        from kvseal.engine.cores import CoreLock

        engine.core_lock = CoreLock(spec.share_cores)
    engine.start()
    return engine, lm, sizing
