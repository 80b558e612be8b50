"""The engine: one thread that owns the pool and the model, and steps ``schedule → run → postprocess``.

Every mutation of the pool's tags happens on this thread (other threads send closures through ``call``), so
tags never race with the check before a forward pass. Scheduling is continuous batching with chunked prefill:
each step feeds every running decode one token and fills the rest of a token budget with prefill chunks, so a
long prompt never stalls the streams already running. Pages are allocated as a request grows; when the pool
runs dry the newest request is preempted (its pages freed, recomputed later). A request that does not fit
*now* waits (backpressure); one that can *never* fit was rejected at admission and never got here.

Roles: ``colocated`` prefills then decodes; ``prefill`` hands each prefilled request to ``handoff`` (the
transfer) and frees its pages only on ``release``; ``decode`` receives requests whose prompt KV arrived by
transfer, grows their pages as they decode, and recomputes locally after a preemption.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

import torch

from kvseal.config import EngineConfig
from kvseal.engine.grammar import Grammars
from kvseal.engine.runner import Runner, StepResult, wants_prompt_logprobs
from kvseal.engine.sampling import prompt_logprobs, sample
from kvseal.engine.sequence import Event, Phase, Sequence
from kvseal.errors import BadRequest, ContextLengthError, EngineError, KVIntegrityError
from kvseal.kv.pool import PagePool, PageRun, PageState
from kvseal.kv.prefix import PrefixCache
from kvseal.kv.tags import tenant_tag
from kvseal.model.llama import LlamaModel

log = logging.getLogger("kvseal.engine")


class Engine:
    def __init__(self, cfg: EngineConfig, model: LlamaModel, pool: PagePool, role: str = "colocated",
                 handoff: Callable[[Sequence], None] | None = None, metrics: Any = None) -> None:
        self.cfg = cfg
        self.model = model
        self.pool = pool
        self.role = role
        self.machine: dict = {}  # kvseal.machine.facts, set by build_engine (signed /health carries it)
        self.handoff = handoff
        self.metrics = metrics
        self.runner = Runner(model, pool, check_tags=cfg.protections.page_tags)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self.quarantined: dict[int, PageRun] = {}  # rid → pages a writer may still target
        self.preemptions = 0
        self.forks: dict[int, list[Sequence]] = {}  # leader rid → choices parked until its prompt is cached
        self.shared_tokens = 0
        self.cache = (PrefixCache(pool, salted=cfg.protections.cache_salt)
                      if cfg.prefix_cache and role != "decode" else None)  # decode's pages stay private
        self.computed_tokens = 0  # tokens fed through the model: what the prefix cache saves
        self.grammars: Grammars | None = None  # set by build_engine: structured output needs the tokenizer
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
        """Run ``fn`` on the engine thread between steps; the future carries its result or exception.

        A caller that gave up first (an awaiting task cancelled, which cancels this future) does not stop
        ``fn``: it may release pages. Its result then goes nowhere; setting it on the cancelled future would
        raise on the engine thread and end it, hanging every request."""
        fut: Future = Future()

        def run() -> None:
            wanted = fut.set_running_or_notify_cancel()  # from here on the future cannot be cancelled
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                if wanted:
                    fut.set_exception(e)
                return
            if wanted:
                fut.set_result(result)

        self._inbox.put(run)
        return fut

    def submit(self, seq: Sequence) -> Future:
        return self.call(lambda: self._admit(seq))

    def abort(self, rid: int) -> Future:
        return self.call(lambda: self._abort(rid))

    @property
    def load(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running),
                "free_pages": self.pool.num_available, "cached_pages": self.cache.pages if self.cache else 0,
                "total_pages": self.pool.cfg.num_pages, "pool_tokens": self.pool.cfg.capacity_tokens,
                "context_window": self.cfg.context_window}

    def tenant_tag(self, tenant: str) -> int:
        """The tag a tenant's pages carry. With unsalted cache keys (unsafe) tenants share cached pages, so
        every tenant carries one tag, as in an engine without tenants."""
        return tenant_tag(tenant) if self.cfg.protections.cache_salt else 0

    def page_counts(self) -> dict[str, int]:
        """Pages by state, and how many of them the prefix cache holds (read on any thread: a gauge)."""
        return {**self.pool.counts(), "cached": self.cache.pages if self.cache else 0}

    # -- the loop ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        while not self._stop:
            self._drain(block=not self._ready())
            if self._stop:
                break
            self._step_times = None
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a bug must fail requests, not hang them
                for s in list(self.running) + list(self.waiting):
                    self._finish(s, "error", EngineError(f"engine step failed: {e!r}"), quarantine=True)
            t0 = time.perf_counter()
            for fn in self.after_step:
                fn()
            if self._step_times is not None and self.metrics:
                self._record(self._step_times, time.perf_counter() - t0)

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
        t0 = time.perf_counter()
        batch = self._schedule()
        if not batch:
            return
        if self.step_hook:
            self.step_hook([s for s, _ in batch])
        t1 = time.perf_counter()
        with self.core_lock:  # a CoreLock when the host's cores are shared with another engine
            t2 = time.perf_counter()
            self.model.last_times = (0.0, 0.0)  # a step that fails its whole tag check runs no forward
            res = self.runner.step(batch)
        t3 = time.perf_counter()
        self._step_times = {"schedule": t1 - t0, "core_lock_wait": t2 - t1, "forward": t3 - t2}
        for s in res.failed:
            if self.metrics:
                self.metrics.integrity_failures.inc()
            self._finish(s, "error", KVIntegrityError(f"request {s.rid}: page table does not match page tags"),
                         quarantine=True)
        if res.logits is None:
            return
        last = list(range(len(res.seqs))) if res.rows is None else [r[-1] for r in res.rows]
        if res.rows is not None:
            self._prompt_logprobs(res)
        done = []  # sequences whose whole context is now cached: they sample their next token
        for i, (s, n) in enumerate(zip(res.seqs, res.fed)):
            s.num_cached += n
            self.computed_tokens += n
            if self.cache and s.cache_keys is not None:
                self._keep(s)
            if s.num_cached == len(s.tokens):
                done.append(i)
        seqs = [res.seqs[i] for i in done]
        t0 = time.perf_counter()
        if res.rows is None and len(done) == len(res.seqs):
            logits = res.logits  # no copy in a decode step
        else:
            logits = res.logits[[last[i] for i in done]]
        tokens = sample(logits, seqs)
        self._step_times["sample"] = time.perf_counter() - t0
        for i, s, got in zip(done, seqs, tokens):
            if isinstance(got, Exception):
                self._failed_sampling(s, got)
                continue
            tok, lp = got
            s.logprob = lp
            if s.rid in self.forks:
                self._fork(s, res.logits[last[i]])
            self._advance(s, tok)

    def _prompt_logprobs(self, res: StepResult) -> None:
        """Each prompt token's logprob from the logits of the row before it, for the chunks that asked (a row
        per position: ``Runner.build``), before ``num_cached`` moves past them. A prompt recomputed after a
        preemption skips the positions it has already."""
        for s, n, rows in zip(res.seqs, res.fed, res.rows):
            if not wants_prompt_logprobs(s):
                continue
            lo = max(0, len(s.prompt_lps) - s.num_cached)  # the row predicting the first token not yet scored
            hi = min(n, len(s.prompt) - 1 - s.num_cached)  # the last prompt token has no successor in the prompt
            if hi > lo:
                targets = s.tokens[s.num_cached + lo + 1: s.num_cached + hi + 1]
                s.prompt_lps += prompt_logprobs(res.logits[rows.start + lo: rows.start + hi], targets,
                                                s.params.prompt_logprobs)

    def _ready(self) -> bool:
        """Is there a forward to run? An engine whose only waiting request cannot have its first pages yet
        sleeps on its inbox (pages come back through it) instead of spinning a core, and never takes the cores."""
        if self.running:
            return True
        if not self.waiting:
            return False
        head = self.waiting[0]
        return self.pool.can_allocate(self._pages_to_feed(head, self._chunk(head, self.cfg.step_token_budget)))

    def _record(self, times: dict[str, float], emit: float) -> None:
        """Where a step's time went, for ``/metrics`` (``kvseal bench`` prints it per step): weight matmuls and
        attention inside the forward, the rest of the forward (norms, rope, page writes, tag check), sampling,
        scheduling, waiting for the shared cores, and handing the step's events to the HTTP loop."""
        linear, attention = self.model.last_times
        times |= {"linear": linear, "attention": attention, "emit": emit,
                  "forward_other": times.pop("forward") - linear - attention}
        for phase, secs in times.items():
            self.metrics.engine_seconds.labels(phase).inc(secs)
        self.metrics.engine_steps.inc()

    # -- scheduling -------------------------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        if self.cfg.protections.admission and seq.budget_tokens > self.cfg.admit_limit:
            raise ContextLengthError(len(seq.prompt), seq.params.max_tokens, self.cfg.context_window,
                                     self.pool.cfg.capacity_tokens)
        if seq.params.grammar is not None:
            if self.grammars is None:
                raise BadRequest("response_format is not available on this engine", param="response_format")
            seq.matcher = self.grammars.matcher(seq.params.grammar, replay=seq.tokens[len(seq.prompt):])
        self.seqs[seq.rid] = seq
        seq.tenant_tag = self.tenant_tag(seq.tenant)
        if self.cache:
            seq.space = self.cache.namespace(seq.tenant)
        if seq.group == seq.rid:
            self.forks[seq.rid] = []
        elif seq.group in self.forks:  # a later choice of a request: waits to share its leader's prompt pages
            self.forks[seq.group].append(seq)
            return
        if seq.phase is Phase.RUNNING:  # decode role: the prompt's KV already verified in the pool
            self.running.append(seq)
        else:
            self.waiting.append(seq)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """One step's ``(sequence, tokens to feed)`` under the step's token budget: every running decode
        first (one token each), then running prefills' next chunks, then new requests' first chunks.

        Pages come on demand, for the tokens fed this step. A running request that cannot have its next page
        preempts the newest running request not yet in this step (recompute: its pages are freed, it goes
        back to the head of the queue with its tokens); if none is left, it preempts itself. The oldest
        request can therefore always grow, and admission guaranteed it fits the pool alone. A new request is
        admitted only if its chunk fits with a page to spare for every running request, and never in a step
        that had to preempt (the pool is short: taking a request back at once would only thrash).
        """
        budget = self.cfg.step_token_budget
        preempted = self.preemptions
        batch: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.running if len(s.tokens) - s.num_cached == 1]
        prefilling = [s for s in self.running if len(s.tokens) - s.num_cached > 1]
        for s in decoding + prefilling:
            n = self._chunk(s, budget)
            if n == 0 or s.phase is not Phase.RUNNING:  # out of budget, or preempted for an earlier one
                continue
            if not self._grow(s, n, batch):
                continue
            batch.append((s, n))
            budget -= n
        while (self.waiting and budget > 0 and len(self.running) < self.cfg.max_running
               and self.preemptions == preempted):
            s = self.waiting[0]
            if self.cache and s.run is None and s.params.prompt_logprobs is None:  # prompt logprobs: all computed
                self._hit(s)
            n = self._chunk(s, budget)
            if not self.pool.can_allocate(self._pages_to_feed(s, n) + len(self.running)):
                break  # backpressure: the head waits until pages come back
            self.waiting.popleft()
            s.phase = Phase.RUNNING
            self.running.append(s)
            self._grow(s, n, batch)
            batch.append((s, n))
            budget -= n
        return batch

    @staticmethod
    def _chunk(s: Sequence, budget: int) -> int:
        return min(len(s.tokens) - s.num_cached, budget)

    def _pages_to_feed(self, s: Sequence, n: int) -> int:
        have = len(s.run.pages) if s.run is not None else 0
        return max(0, self.pool.cfg.pages_for(s.num_cached + n) - have)

    def _grow(self, s: Sequence, n: int, batch: list[tuple[Sequence, int]]) -> bool:
        """Give ``s`` the pages for ``n`` more tokens, preempting newer requests if the pool is dry. False if
        ``s`` itself had to go."""
        need = self._pages_to_feed(s, n)
        scheduled = {id(x) for x, _ in batch}
        while not self.pool.can_allocate(need):
            victim = next((v for v in reversed(self.running) if id(v) not in scheduled), None)
            self._preempt(victim)
            if victim is s:
                return False
        if need:
            more = self.pool.allocate(s.rid, need, tenant=s.tenant_tag)
            s.run = more if s.run is None else PageRun(s.run.pages + more.pages, s.run.generations + more.generations)
        return True

    def _preempt(self, s: Sequence) -> None:
        """Recompute-preemption: free every page (their generations move on, so the old table is stale) and
        requeue at the head with all its tokens; its next prefill recomputes them."""
        self.running.remove(s)
        if s.run is not None:
            self.pool.free(s.run)
        s.run, s.num_cached, s.phase = None, 0, Phase.WAITING
        self.waiting.appendleft(s)
        self.preemptions += 1
        if self.metrics:
            self.metrics.preemptions.inc()

    def _hit(self, s: Sequence) -> None:
        """Start ``s`` on the longest cached prefix of its prompt in its tenant's namespace. At least the last
        prompt token is computed (its logits start the output), so a cached page is never written."""
        if s.cache_keys is None:
            s.cache_keys = self.cache.keys(s.tenant, s.prompt, s.cache_salt)
        usable = min(len(s.cache_keys), (len(s.tokens) - 1) // self.pool.cfg.page_size)
        run = self.cache.lookup(s.cache_keys[:usable], s.space)
        hit = len(run.pages) * self.pool.cfg.page_size
        if run.pages:
            s.run, s.num_cached, s.registered = run, hit, len(run.pages)
        if s.num_output == 0:
            s.cached_tokens = hit

    def _keep(self, s: Sequence) -> None:
        """Offer the prompt blocks ``s`` has just filled to the cache (a block another request already cached
        stays private to ``s``)."""
        full = min(min(s.num_cached, len(s.prompt)) // self.pool.cfg.page_size, len(s.cache_keys))
        for i in range(s.registered, full):
            self.cache.insert(s.cache_keys[i], s.run.pages[i], s.run.generations[i], s.space)
        s.registered = max(s.registered, full)

    def _fork(self, leader: Sequence, logits: torch.Tensor) -> None:
        """The leader of a request's choices has its prompt cached and its logits in hand. Each parked choice
        with the same prompt gets the prompt's full pages as SHARED pages (read-only, a reference each) and a
        private copy of the last, partial one, then draws its own first token from the same logits: no prompt
        token is computed twice. A choice that cannot have its page now queues to compute its prompt itself."""
        ps, n = self.pool.cfg.page_size, len(leader.prompt)
        full, partial = divmod(n, ps)
        parked = self.forks.pop(leader.rid)
        same = [f for f in parked if f.prompt == leader.prompt]
        if not self.pool.can_allocate(len(same) * bool(partial)):
            same = []
        self.waiting.extendleft(reversed([f for f in parked if f not in same]))
        if not same:
            return
        if full:
            self.pool.share(leader.run.pages[:full], leader.rid, 1 + len(same))
        for f in same:
            f.run = PageRun(leader.run.pages[:full], leader.run.generations[:full])
            if partial:
                own = self.pool.allocate(f.rid, 1, tenant=f.tenant_tag)
                self.pool.kv[own.pages[0]] = self.pool.kv[leader.run.pages[full]]
                f.run = PageRun(f.run.pages + own.pages, f.run.generations + own.generations)
            f.num_cached, f.phase = n, Phase.RUNNING
            f.cache_keys, f.registered = leader.cache_keys, full
            f.prompt_lps = leader.prompt_lps
            self.running.append(f)
        self.shared_tokens += n * len(same)
        if self.metrics:
            self.metrics.shared_tokens.inc(n * len(same))
        for f, got in zip(same, sample(logits.expand(len(same), -1), same)):
            if isinstance(got, Exception):
                self._failed_sampling(f, got)
                continue
            tok, f.logprob = got
            self._advance(f, tok)

    def _failed_sampling(self, s: Sequence, e: Exception) -> None:
        """A row that could not draw its token: that request fails (500), its pages freed (its forward ran and
        wrote them as any other); the step's other rows go on."""
        log.error("request %s: sampling failed: %r", s.rid, e)
        self._finish(s, "error", e if isinstance(e, EngineError) else EngineError(f"sampling failed: {e!r}"))

    def _advance(self, s: Sequence, token: int) -> None:
        first = s.num_output == 0
        s.tokens.append(token)
        ev = Event(s.rid, (token,), logprobs=(s.logprob,) if s.logprob else (),
                   cached_tokens=s.cached_tokens if first else 0,
                   prompt_logprobs=tuple(s.prompt_lps) if first and s.params.prompt_logprobs is not None else ())
        if first and self.role == "prefill":
            self.running.remove(s)
            s.phase = Phase.TRANSFER
            s.sink(ev)
            self.handoff(s)
            return
        reason = s.finish_reason(token)
        s.sink(ev)
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
        elif s in self.waiting:
            self.waiting.remove(s)
        elif s in self.forks.get(s.group, ()):
            self.forks[s.group].remove(s)
        self.waiting.extend(self.forks.pop(s.rid, ()))  # a leader that ended before its prompt was cached
        s.phase = Phase.DONE
        self.seqs.pop(s.rid, None)
        try:
            if s.run is not None and quarantine:  # only pages still tagged for it: the rest are not its own
                self.quarantined[s.rid] = self.pool.quarantine(self.pool.holding(s.run, s.rid, s.group, s.space))
            elif s.run is not None:
                self.pool.free(s.run)
        except RuntimeError as e:  # a double free is a bug; the request must still end, with an error
            reason, error = "error", EngineError(f"request {s.rid}: {e}")
        s.sink(Event(s.rid, (), reason, error))

    # -- what a lease host asks of the engine (engine thread; kvseal.protocol.decode_host) -------------------
    def admit(self, seq: Sequence) -> None:
        """Admission (raises before any allocation), then the queue or, for a verified decode, the batch."""
        self._admit(seq)

    def stop_request(self, rid: int) -> bool:
        return self._abort(rid)

    def hold_quarantined(self, rid: int, run: PageRun) -> None:
        """Pages a writer may still target: out of every page table, back only on ``release_quarantine``."""
        self.quarantined[rid] = self.pool.quarantine(run)

    def free_pages(self, run: PageRun) -> None:
        self.pool.free(run)

    def start_decoding(self, seq: Sequence) -> None:
        """Decode role: the request's verified prompt pages become OWNED and it joins the batch with its first
        token, unless that token already ended it (then its pages go back at once)."""
        self.pool.set_state(seq.run, PageState.OWNED)
        reason = seq.finish_reason(seq.tokens[-1])
        if reason:
            self.pool.free(seq.run)
            seq.sink(Event(seq.rid, (), reason))
        else:
            self._admit(seq)

    def release_quarantine(self, rid: int) -> bool:
        """The writer acknowledged it stopped (or was fenced): quarantined pages may go back."""
        run = self.quarantined.pop(rid, None)
        if run is not None:
            self.pool.free(run)
        return run is not None
