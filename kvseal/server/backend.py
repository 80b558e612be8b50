"""What the OpenAI layer talks to: a backend that turns a tokenized request into a stream of events.

``EngineBackend`` runs requests on an in-process engine (colocated mode, and the decode/prefill workers'
own engines); the router has a backend of the same shape that drives remote workers. A backend stream
ends with exactly one final event; leaving the stream early (client gone) aborts the request, which frees
its pages on the engine thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvseal.config import Protections
from kvseal.engine.request import Event, SamplingParams

if TYPE_CHECKING:  # the router imports this module and runs no engine: it never loads PyTorch
    from kvseal.engine.engine import Engine


@dataclass(frozen=True)
class GenRequest:
    rid: int
    tenant: str
    prompt: list[int]
    params: SamplingParams
    group: int | None = None  # n > 1: every choice of a prompt names its first choice's rid
    batch: int | None = None  # more than one choice or prompt: names the API request all of them came in
    cache_salt: str = ""  # vLLM's: this request's prefix-cache keys apart from its tenant's other requests'


class Backend(Protocol):
    model_name: str
    context_window: int  # the served context (preflight may have capped it)
    pool_tokens: int  # the smallest KV pool on the request's path
    prot: Protections

    def generate(self, req: GenRequest) -> AsyncIterator[Event]: ...

    def check_capacity(self) -> None:
        """Raise (429/503) if a new request would be shed anyway; called before the body is read."""

    async def health(self, full: bool = False) -> dict:
        """Load and pools; ``full``: each pool's conservation check too, taken now (not from the last probe)."""

    async def pages(self) -> list[dict]:
        """Every pool's pages (``kvseal.server.dashboard``): name, role, page_size, state and tenant tags."""


async def drain(q: asyncio.Queue, on_exit: object) -> AsyncIterator[Event]:
    """Yield events until the final one; if the consumer leaves first, call ``on_exit``."""
    done = False
    try:
        while True:
            ev = await q.get()
            done = ev.finish_reason is not None
            yield ev
            if done:
                return
    finally:
        if not done:
            on_exit()


class StepBatcher:
    """Collects a whole engine step's events and hands them to the event loop in one wake-up.

    One ``call_soon_threadsafe`` per token per request costs the HTTP thread a wake-up each, and every
    wake-up steals a core from the engine's OpenMP team; one per step does not.
    """

    def __init__(self, engine: Engine) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.buf: list[tuple[asyncio.Queue, Event]] = []
        engine.after_step.append(self.flush)

    def sink_for(self, q: asyncio.Queue) -> object:
        self.loop = asyncio.get_running_loop()
        return lambda ev: self.buf.append((q, ev))

    def flush(self) -> None:  # engine thread
        if self.buf and self.loop is not None:
            batch, self.buf = self.buf, []
            self.loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, ev in batch:
        q.put_nowait(ev)


class EngineBackend:
    def __init__(self, engine: Engine, model_name: str, eos_ids: tuple[int, ...]) -> None:
        self.engine = engine
        self.batcher = StepBatcher(engine)
        self.model_name = model_name
        self.eos_ids = frozenset(eos_ids)
        self.context_window = engine.cfg.context_window
        self.pool_tokens = engine.pool.cfg.capacity_tokens
        self.prot = engine.cfg.protections
        self.arriving: list[tuple[object, Future]] = []

    async def generate(self, req: GenRequest) -> AsyncIterator[Event]:
        q: asyncio.Queue = asyncio.Queue()
        from kvseal.engine.sequence import Sequence

        seq = Sequence(req.rid, req.prompt, req.params, self.batcher.sink_for(q), eos_ids=self.eos_ids,
                       group=req.group, tenant=req.tenant, cache_salt=req.cache_salt)
        try:
            await asyncio.wrap_future(self.submit(seq))
        except asyncio.CancelledError:  # the client left while its request waited for the engine thread
            self.engine.abort(req.rid)  # if it was admitted meanwhile, it stops (and frees) at once
            raise
        async for ev in drain(q, lambda: self.engine.abort(req.rid)):
            yield ev

    def submit(self, seq: object) -> Future:
        """Sequences submitted in one turn of the event loop reach the engine in one call. A request's n
        choices start in one turn, so all of them are parked before the engine can compute the first one's
        prompt, and they share it; submitted one call each, a step could start between two of them, and a
        choice arriving after the prompt was computed would compute it again."""
        fut: Future = Future()
        if not self.arriving:
            asyncio.get_running_loop().call_soon(self._send)
        self.arriving.append((seq, fut))
        return fut

    def _send(self) -> None:
        batch, self.arriving = self.arriving, []

        def admit_all() -> None:  # engine thread
            for seq, fut in batch:
                if not fut.set_running_or_notify_cancel():  # its client left first: nothing to admit
                    continue
                try:
                    fut.set_result(self.engine.admit(seq))
                except Exception as e:  # noqa: BLE001 - handed to that sequence's caller
                    fut.set_exception(e)

        self.engine.call(admit_all)

    def check_capacity(self) -> None:
        pass  # the engine queues: backpressure, never shedding

    async def health(self, full: bool = False) -> dict:
        return {"status": "ok", "pools": [await pool_health(self.engine)]}

    async def pages(self) -> list[dict]:
        """Every page of the pool, for the dashboard."""
        from kvseal.server.dashboard import pool_snapshot

        return [{"name": "colocated", **await pool_snapshot(self.engine)}]


async def pool_health(engine: Engine, quick: bool = False) -> dict:
    """Load and a conservation check, taken on the engine thread so it sees a consistent pool.

    ``quick`` (the router's liveness probe) reads the counters without waiting behind an engine step: a
    probe that queues behind a long prefill would time out and get a healthy worker fenced.
    """
    if quick:
        return {**engine.load, "role": engine.role}

    def probe() -> dict:
        try:
            engine.pool.check_integrity()
            ok = True
        except AssertionError:
            ok = False
        return {**engine.load, **engine.pool.counts(), "integrity_ok": ok, "role": engine.role}

    return await asyncio.wait_for(asyncio.wrap_future(engine.call(probe)), timeout=10)
