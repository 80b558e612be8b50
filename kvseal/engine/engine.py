"""The engine: one thread that owns the pool and the model, and steps ``schedule → run → postprocess``.

Every mutation of the pool's tags happens on this thread (other threads send closures through ``call``), so
tags never race with the check before a forward pass. Scheduling is continuous batching: waiting requests
are admitted into a prefill batch under a token budget whenever their full reservation (prompt + max_tokens)
fits the pool; otherwise every running request takes one decode step. A request that does not fit *now*
waits (backpressure); one that can *never* fit was rejected at admission and never got here.

Roles: ``colocated`` prefills then decodes; ``prefill`` hands each prefilled request to ``handoff`` (the
transfer) and frees its pages only on ``release``; ``decode`` receives requests whose KV arrived by transfer.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

import torch

from kvseal.config import EngineConfig
from kvseal.engine.errors import ContextLengthError, EngineError, KVIntegrityError
from kvseal.engine.runner import Runner
from kvseal.engine.sampling import sample
from kvseal.engine.sequence import Event, Phase, Sequence
from kvseal.kv.pool import PagePool, PageRun
from kvseal.model.llama import LlamaModel


class Engine:
    def __init__(self, cfg: EngineConfig, model: LlamaModel, pool: PagePool, role: str = "colocated",
                 handoff: Callable[[Sequence], None] | None = None, metrics: Any = None) -> None:
        self.cfg = cfg
        self.model = model
        self.pool = pool
        self.role = role
        self.handoff = handoff
        self.metrics = metrics
        self.runner = Runner(model, pool, check_tags=cfg.protections.page_tags)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self.quarantined: dict[int, PageRun] = {}  # rid → pages a writer may still target
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = False
        self.step_hook: Callable[[list[Sequence]], None] | None = None  # faults and tests only
        self.after_step: list[Callable[[], None]] = []  # e.g. flush a step's events to the HTTP loop at once
        self.core_lock: Any = nullcontext()  # kvseal.engine.cores.CoreLock when another engine shares the cores
        self._thread = threading.Thread(target=self._loop, name=f"kvseal-engine-{role}", daemon=True)

    # -- thread boundary --------------------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(lambda: None)
        self._thread.join(timeout=10)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between steps; the future carries its result or exception."""
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

        self._inbox.put(run)
        return fut

    def submit(self, seq: Sequence) -> Future:
        return self.call(lambda: self._admit(seq))

    def abort(self, rid: int) -> Future:
        return self.call(lambda: self._abort(rid))

    @property
    def load(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running), "free_pages": self.pool.num_free,
                "total_pages": self.pool.cfg.num_pages, "pool_tokens": self.pool.cfg.capacity_tokens,
                "context_window": self.cfg.context_window}

    # -- the loop ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        while not self._stop:
            self._drain(block=not self._ready())
            if self._stop:
                break
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a bug must fail requests, not hang them
                for s in list(self.running) + list(self.waiting):
                    self._finish(s, "error", EngineError(f"engine step failed: {e!r}"), quarantine=True)
            for fn in self.after_step:
                fn()

    def _drain(self, block: bool) -> None:
        try:
            fn = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        fn()
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                return

    def step(self) -> None:
        if not self._ready():
            return
        batch = self._schedule()
        if not batch:
            return
        if self.step_hook:
            self.step_hook(batch)
        with self.core_lock:  # a CoreLock when the host's cores are shared with another engine
            res = self.runner.step(batch)
        for s in res.failed:
            if self.metrics:
                self.metrics.integrity_failures.inc()
            self._finish(s, "error", KVIntegrityError(f"request {s.rid}: page table does not match page tags"),
                         quarantine=True)
        if res.logits is not None:
            tokens = sample(res.logits, [s.params for s in res.seqs], [s.generator for s in res.seqs])
            for s, tok in zip(res.seqs, tokens):
                self._advance(s, tok)

    def _ready(self) -> bool:
        """Is there a forward to run? An engine whose only waiting request cannot have its pages yet sleeps
        on its inbox (pages come back through it) instead of spinning a core, and never takes the cores."""
        if self.running:
            return True
        return bool(self.waiting) and self.pool.can_allocate(self.pool.cfg.pages_for(self.waiting[0].budget_tokens))

    # -- scheduling -------------------------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        if self.cfg.protections.admission and seq.budget_tokens > self.cfg.admit_limit:
            raise ContextLengthError(len(seq.prompt), seq.params.max_tokens, self.cfg.context_window,
                                     self.pool.cfg.capacity_tokens)
        self.seqs[seq.rid] = seq
        if seq.phase is Phase.RUNNING:  # decode role: KV already verified in the pool
            self.running.append(seq)
        else:
            self.waiting.append(seq)

    def _schedule(self) -> list[Sequence]:
        batch: list[Sequence] = []
        budget = self.cfg.prefill_token_budget
        while self.waiting and len(self.running) + len(batch) < self.cfg.max_running:
            s = self.waiting[0]
            need = self.pool.cfg.pages_for(s.budget_tokens)
            if batch and budget < len(s.prompt):
                break
            if not self.pool.can_allocate(need):
                break  # backpressure: the head waits until pages come back
            self.waiting.popleft()
            s.run = self.pool.allocate(s.rid, need)
            s.phase = Phase.RUNNING
            budget -= len(s.prompt)
            batch.append(s)
        return batch or list(self.running)

    def _advance(self, s: Sequence, token: int) -> None:
        first = s.num_cached == 0
        s.num_cached = len(s.tokens)
        s.tokens.append(token)
        if first and self.role == "prefill":
            s.phase = Phase.TRANSFER
            s.sink(Event(s.rid, (token,)))
            self.handoff(s)
            return
        if first:
            self.running.append(s)
        reason = s.finish_reason(token)
        s.sink(Event(s.rid, (token,)))
        if reason:
            self._finish(s, reason)

    # -- endings ----------------------------------------------------------------------------------------
    def _abort(self, rid: int) -> bool:
        s = self.seqs.get(rid)
        if s is None:
            return False
        self._finish(s, "abort")
        return True

    def release(self, rid: int, quarantine: bool = False) -> None:
        """Prefill role: decode acknowledged (or the transfer failed) — the pages may go."""
        s = self.seqs.get(rid)
        if s is not None:
            self._finish(s, "stop", quarantine=quarantine)

    def _finish(self, s: Sequence, reason: str, error: Exception | None = None, quarantine: bool = False) -> None:
        if s.phase is Phase.DONE:
            return
        if s in self.running:
            self.running.remove(s)
        elif s.phase is Phase.WAITING and s in self.waiting:
            self.waiting.remove(s)
        s.phase = Phase.DONE
        self.seqs.pop(s.rid, None)
        try:
            if s.run is not None and quarantine:
                self.pool.quarantine(s.run)
                self.quarantined[s.rid] = s.run
            elif s.run is not None:
                self.pool.free(s.run)
        except RuntimeError as e:  # a double free is a bug; the request must still end, with an error
            reason, error = "error", EngineError(f"request {s.rid}: {e}")
        s.sink(Event(s.rid, (), reason, error))

    def release_quarantine(self, rid: int) -> bool:
        """The writer acknowledged it stopped (or was fenced): quarantined pages may go back."""
        run = self.quarantined.pop(rid, None)
        if run is not None:
            self.pool.free(run)
        return run is not None
