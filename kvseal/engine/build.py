"""Assemble a worker's engine: load the model, size and preflight the pool, start the engine thread.

Loading runs on a short-lived thread, not the caller's: PyTorch's OpenMP team stays bound to the first
thread that runs a parallel op, and if that is the main (HTTP) thread, the engine thread's kernels run 2-3×
slower. Keeping the main thread free of parallel torch work avoids it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch

from kvseal.config import EngineConfig, PoolConfig, WorkerSpec, step_token_budget, torch_dtype
from kvseal.engine.engine import Engine
from kvseal.engine.grammar import Grammars
from kvseal.kv.pool import PagePool
from kvseal.kv.preflight import Sizing, pool_tokens_for, preflight
from kvseal.machine import facts, one_line
from kvseal.model.cpu import resolve
from kvseal.model.loader import LoadedModel, load
from kvseal.transfer.staging import staged

# A worker loads on one thread. Two workers of a host start together (``kvseal serve``), and two OpenMP teams
# spinning on two cores stall each other: measured 2.2 s to a worker's pool alone, 7.2 s each for two at once
# with two threads each, 2.4 and 4.2 s with one (Zen 4, 2 cores). One worker alone loads as fast either way:
# reading the cache and faulting the pool in are bound by memory and the kernel, not by FLOPs.
LOAD_THREADS = 1


def off_main_thread(fn: Callable[[], object], threads: int = 0) -> object:
    """Run ``fn`` (model loading, weight packing: anything with large PyTorch ops) on a short-lived thread.

    Every thread that runs an OpenMP region keeps a team of worker threads. Once the main thread has one
    beside the engine thread's, libgomp counts more OpenMP threads than cores and throttles its spin-wait
    (to ~1,000 spins whatever GOMP_SPINCOUNT says), so the engine's workers sleep between the many short
    regions of a step and every region pays a futex wake-up: measured 2x slower batch-1 steps. A finished
    thread's team goes away with it."""
    box: dict = {}

    def run() -> None:
        before = torch.get_num_threads()
        try:
            if threads:
                torch.set_num_threads(threads)
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["e"] = e
        finally:
            torch.set_num_threads(before)

    t = threading.Thread(target=run, name="kvseal-load")
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


# By default glibc may give a freed block of over 128 KB back to the kernel, and the next allocation of it then
# faults every page in again. A step's [rows, vocabulary] temporaries are ~6 MB each at 32 rows, and served
# (OpenMP computing them, the forward freeing and allocating in between) they went back: 8.5-9.2 ms of sampling
# a step against 4-5 in process; with freed memory kept, 5.9-6.3 ms and 615-625 tok/s against 534-563 at 32
# sampled streams (Zen 4). Blocks up to 32 MB (glibc's ceiling) stay in the heap, not trimmed below 1 GiB.
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 1 << 30


def keep_freed_memory() -> bool:
    """Tell glibc's allocator to keep what an engine frees for its next step (``mallopt``); False where the C
    library is not glibc (nothing changes there)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, TRIM_THRESHOLD))


def build_engine(spec: WorkerSpec, role: str = "colocated", storage: Callable | None = None,
                 handoff: Callable | None = None, metrics: object = None,
                 loaded: LoadedModel | None = None) -> tuple[Engine, LoadedModel, Sizing]:
    dtype_name, weights = resolve(spec)
    dtype = torch_dtype(dtype_name)
    keep_freed_memory()
    on_cpu = spec.device == "cpu"  # a GPU's model moves there unpacked: no packed copy to keep on the host
    lm = loaded or off_main_thread(lambda: load(spec.model, dtype, tokenizer=spec.tokenizer,
                                                 dummy=spec.load_format == "dummy", weights=weights, release=on_cpu,
                                                 shared=spec.shared_weights if on_cpu else None), threads=LOAD_THREADS)
    m = lm.model.cfg
    if lm.model.weights_mode != weights:
        off_main_thread(lambda: lm.model.use_weights(weights), threads=LOAD_THREADS)
    if not on_cpu:
        lm.model.to_device(spec.device)
    tokens = spec.kv_pool_tokens or pool_tokens_for(m, dtype, int(spec.kv_memory_gib * 2**30), spec.page_size)
    sizing = preflight(m, dtype, tokens, spec.context, spec.allow_pool_below_context)
    pool_cfg = PoolConfig(num_pages=tokens // spec.page_size, page_size=spec.page_size,
                          scrub_on_free=spec.scrub_on_free)
    kv = storage(pool_cfg, m, dtype) if storage else None
    # the transport's memory is the pool itself, or (a GPU's pool) the landing area its pages are copied in from
    landing = kv if kv is not None and staged(spec.device) else None
    pool = off_main_thread(lambda: PagePool(pool_cfg, m.num_layers, m.num_kv_heads, m.head_dim, dtype,
                                            storage=None if landing is not None else kv, device=spec.device,
                                            landing=landing), threads=LOAD_THREADS)
    cfg = EngineConfig(pool=pool_cfg, dtype=dtype_name, max_running=spec.max_running,
                       step_token_budget=step_token_budget(spec.step_token_budget, role), context_window=sizing.served_context,
                       threads=spec.threads, prefix_cache=spec.prefix_cache, protections=spec.protections)
    engine = Engine(cfg, lm.model, pool, role=role, handoff=handoff, metrics=metrics)
    if metrics is not None:
        from kvseal.server.metrics import engine_source

        metrics._pool_counts = engine.page_counts
        metrics.add_source(engine_source(engine))
    engine.machine = facts(spec.dtype, spec.weights, spec.threads, spec.device)
    engine.machine["step_tokens"] = cfg.step_token_budget
    if role in ("prefill", "decode"):  # how its pages reach the other worker (kvseal.transfer.staging)
        engine.machine["kv_staged"] = pool.landing is not None if role == "decode" else staged(spec.device)
    print(one_line(engine.machine), flush=True)
    engine.grammars = Grammars(lambda: lm.tokenizer, m.vocab_size)
    if spec.share_cores:
        from kvseal.engine.cores import CoreLock

        engine.core_lock = CoreLock(spec.share_cores)
    engine.start()
    return engine, lm, sizing
