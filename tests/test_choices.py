"""n > 1 on the engine: a request's choices share their prompt's pages (computed once, read-only, reference
counted) and decode into pages of their own; a page shared by one request is never read by another."""

import asyncio
import itertools
import threading
import time

import pytest
from engine_util import chat_ids, generate, make_engine

from kvseal.config import Protections
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Phase, Sequence
from kvseal.errors import KVIntegrityError
from kvseal.kv.pool import PageRun
from kvseal.server.backend import EngineBackend, GenRequest

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
_rids = itertools.count(10_000)


def choices(engine, prompt, n, params):
    """Submit ``n`` choices of one request (the first one leads) between two engine steps; wait for all;
    their tokens in order."""
    outs, finals, done = [[] for _ in range(n)], [None] * n, threading.Event()
    rids = [next(_rids) for _ in range(n)]

    def sink_for(i):
        def sink(ev):
            outs[i].extend(ev.token_ids)
            if ev.finish_reason:
                finals[i] = ev
                if all(finals):
                    done.set()
        return sink

    seqs = [Sequence(rid, list(prompt), params if params.seed is None else
                     SamplingParams(**{**params.__dict__, "seed": params.seed + i}), sink_for(i),
                     eos_ids=frozenset({2}), group=rids[0]) for i, rid in enumerate(rids)]
    engine.call(lambda: [engine.admit(s) for s in seqs]).result()  # in one call, as the server's backend does
    assert done.wait(300), "choices hung"
    assert all(f.error is None for f in finals), finals
    return outs


async def served(backend: EngineBackend, rid: int, prompt: list[int], group: int | None = None) -> list[int]:
    """One request through the server's backend (4 greedy tokens), as the OpenAI layer drives it."""
    events = backend.generate(GenRequest(rid, "t", prompt, SamplingParams(max_tokens=4, temperature=0), group))
    return [t async for ev in events for t in ev.token_ids]


@pytest.fixture(scope="module")
def engine(fp32_model):
    e = make_engine(fp32_model)
    yield e
    e.stop()


def test_greedy_choices_share_the_prompt_and_equal_a_single_run(fp32_model, engine):
    prompt = chat_ids(fp32_model, PROMPT)
    single = generate(engine, [prompt], 24, eos=(2,))[0]
    before = engine.shared_tokens
    outs = choices(engine, prompt, 4, SamplingParams(max_tokens=24, temperature=0))
    assert outs == [single] * 4
    assert engine.shared_tokens - before == 3 * len(prompt)  # the prompt was computed once, not four times
    engine.call(engine.pool.check_integrity).result()
    assert engine.pool.num_free == engine.pool.cfg.num_pages


def test_the_servers_choices_reach_the_engine_together_and_share_the_prompt(fp32_model, monkeypatch):
    """The server starts a request's choices in one turn of its event loop; however the engine thread is
    scheduled, a step never starts between two of them (it would leave the later ones to compute the prompt
    again). Here the engine gets time to step after every call it is handed."""
    engine = make_engine(fp32_model)
    handed = engine.call

    def call(fn):
        fut = handed(fn)
        time.sleep(0.3)  # long enough for the engine to compute the first choice's prompt
        return fut

    monkeypatch.setattr(engine, "call", call)
    backend = EngineBackend(engine, "m", (2,))
    prompt = chat_ids(fp32_model, PROMPT)

    async def serve():
        group = next(_rids)
        return await asyncio.gather(*(served(backend, rid, prompt, group) for rid in (group, next(_rids), next(_rids))))

    try:
        outs = asyncio.run(serve())
        assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 4
        assert engine.shared_tokens == 2 * len(prompt)
    finally:
        engine.stop()


def test_a_client_leaving_before_the_engine_admits_its_request_never_stalls_the_others(fp32_model):
    """Three requests reach the engine in one call while it is busy; the first one's client leaves meanwhile.
    It is never admitted, and the two others are served as if it had never come."""
    engine = make_engine(fp32_model)
    admitted, admit = [], engine.admit
    engine.admit = lambda seq: (admitted.append(seq.rid), admit(seq))[1]
    backend = EngineBackend(engine, "m", (2,))
    prompt = chat_ids(fp32_model, PROMPT)
    rids = [next(_rids) for _ in range(3)]

    async def serve():
        busy = engine.call(lambda: time.sleep(1.0))  # the engine thread is mid-step
        tasks = [asyncio.ensure_future(served(backend, rid, prompt)) for rid in rids]
        await asyncio.sleep(0.2)  # all three handed over, none admitted yet
        tasks[0].cancel()
        await asyncio.wrap_future(busy)
        return await asyncio.wait_for(asyncio.gather(*tasks[1:]), 120)

    try:
        a, b = asyncio.run(serve())
        assert a == b and len(a) == 4 and admitted == rids[1:]
        assert engine.call(lambda: (engine.pool.num_free, len(engine.seqs))).result(10) == \
            (engine.pool.cfg.num_pages, 0)
    finally:
        engine.stop()


def test_sampled_choices_differ_and_reproduce_by_seed(fp32_model, engine):
    prompt = chat_ids(fp32_model, PROMPT)
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=11)
    a, b = choices(engine, prompt, 3, p), choices(engine, prompt, 3, p)
    assert a == b and len({tuple(x) for x in a}) == 3
    assert engine.pool.num_free == engine.pool.cfg.num_pages


def foreign_reader_run(lm, prot: Protections) -> dict:
    """While a request's two choices decode over their shared prompt pages, a bug hands another request (not
    of the group) a table naming those pages."""
    engine = make_engine(lm, protections=prot)
    prompt = chat_ids(lm, PROMPT)
    try:
        rids = [next(_rids), next(_rids)]
        got = {rid: [] for rid in rids}
        seqs = [Sequence(rid, prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                         got[rid].append, group=rids[0]) for rid in rids]
        engine.call(lambda: [engine.admit(s) for s in seqs]).result()
        deadline = time.time() + 120
        while len(got[rids[1]]) < 3 and time.time() < deadline:
            time.sleep(0.01)
        events: list = []

        def intrude() -> None:
            leader = engine.seqs[rids[0]]
            full = len(prompt) // engine.pool.cfg.page_size
            own = engine.pool.allocate(777, 1)
            s = Sequence(777, prompt, SamplingParams(max_tokens=4, temperature=0), events.append,
                         tokens=prompt + [leader.tokens[len(prompt)]], num_cached=len(prompt), phase=Phase.RUNNING,
                         run=PageRun(leader.run.pages[:full] + own.pages, leader.run.generations[:full] + own.generations))
            engine.seqs[777] = s
            engine.running.append(s)

        engine.call(intrude).result()
        while not (events and events[-1].finish_reason) and time.time() < deadline:
            time.sleep(0.02)
        while not all(got[r] and got[r][-1].finish_reason for r in rids) and time.time() < deadline:
            time.sleep(0.02)
        return {"intruder": events[-1], "group": [got[r][-1] for r in rids],
                "free": engine.call(lambda: engine.pool.num_free).result(), "total": engine.pool.cfg.num_pages}
    finally:
        engine.stop()


def test_a_shared_page_fails_the_tag_check_for_another_request(fp32_model):
    r = foreign_reader_run(fp32_model, Protections())
    assert r["intruder"].finish_reason == "error" and isinstance(r["intruder"].error, KVIntegrityError)
    assert [e.finish_reason for e in r["group"]] == ["length", "length"]  # the group is not disturbed
    assert r["free"] == r["total"] - 1  # only the intruder's own page stays quarantined


def test_without_page_tags_another_request_reads_the_shared_pages(fp32_model):
    r = foreign_reader_run(fp32_model, Protections(page_tags=False))
    assert r["intruder"].finish_reason == "length", "the unchecked engine should serve from the group's pages"
