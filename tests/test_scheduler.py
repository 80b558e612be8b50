"""The scheduler: chunked prefill shares steps with decodes, pages come on demand, preemption recomputes.

Greedy tokens are the check throughout: a prompt prefilled in chunks, a request preempted and recomputed,
and one run undisturbed must all produce the same tokens (fp32, where the model's margins are clear).
"""

import time

import pytest
from engine_util import chat_ids, generate, make_engine

from kvseal.config import Protections
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Phase, Sequence

PROMPTS = ["Write a haiku about the sea.", "List three colors.", "Explain what a CPU does in one sentence.",
           "Tell me a fun fact about octopuses."]
EOS = (2,)


def run(lm, prompts, max_tokens, **kw):
    engine = make_engine(lm, **kw)
    steps = []
    inner = engine.runner.step
    engine.runner.step = lambda batch: steps.append([(s.rid, n) for s, n in batch]) or inner(batch)
    try:
        outs = generate(engine, prompts, max_tokens, eos=EOS)
        engine.call(engine.pool.check_integrity).result()
        return outs, steps, engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def reference(fp32_model):
    prompts = [chat_ids(fp32_model, p) for p in PROMPTS]
    outs, _, _ = run(fp32_model, prompts, 24)
    return prompts, outs


def test_chunked_prefill_gives_the_same_tokens(fp32_model, reference):
    prompts, ref = reference
    outs, steps, _ = run(fp32_model, prompts, 24, step_token_budget=8)
    assert outs == ref
    assert max(sum(n for _, n in s) for s in steps) <= 8
    assert any(n > 1 for s in steps for _, n in s) and len(steps) > 24  # prompts really went in pieces


def test_a_long_prompt_never_stalls_running_streams(fp32_model):
    """Once two streams decode, every step feeds each of them a token while a 600-token prompt prefills in
    chunks beside them."""
    engine = make_engine(fp32_model, step_token_budget=64)
    steps = []
    inner = engine.runner.step
    engine.runner.step = lambda batch: steps.append([(s.rid, n) for s, n in batch]) or inner(batch)
    events = {1: [], 2: [], 3: []}
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    try:
        for rid in (1, 2):
            engine.submit(Sequence(rid, chat_ids(fp32_model, PROMPTS[rid]), params, events[rid].append))
        while len(events[1]) < 2 or len(events[2]) < 2:
            time.sleep(0.01)
        long = chat_ids(fp32_model, "Summarize: " + "the quick brown fox jumps over the lazy dog " * 60)
        assert len(long) > 500
        engine.submit(Sequence(3, long, SamplingParams(max_tokens=2, temperature=0), events[3].append)).result()
        while not events[3] or events[3][-1].finish_reason is None:
            time.sleep(0.01)
    finally:
        engine.stop()
    chunked = [s for s in steps if any(rid == 3 and n > 1 for rid, n in s)]
    assert len(chunked) >= 8
    for s in chunked:
        assert sum(n for _, n in s) <= 64
        fed = dict(s)
        assert all(fed.get(r) == 1 for r in (1, 2) if not events[r][-1].finish_reason), s


def test_pool_pressure_preempts_and_recomputes_the_same_tokens(fp32_model, reference):
    """Four requests that grow to 4 pages each on a 7-page pool: two start, both outgrow it, preemptions
    happen, nothing is lost, every request's tokens equal the undisturbed run's, every page comes back."""
    prompts, ref = reference
    outs, _, engine = run(fp32_model, prompts, 24, pages=7)
    assert engine.preemptions > 0
    assert outs == ref
    assert engine.pool.num_free == engine.pool.cfg.num_pages


@pytest.mark.parametrize("tags", [True, False])
def test_a_preempted_requests_old_table_fails_the_tag_check(fp32_model, tags):
    """Preemption frees the pages (generations move on) and another request takes them: a table kept from
    before (a scheduler bug) fails the check; without the check, the forward reads the other's pages."""
    engine = make_engine(fp32_model, pages=8, protections=Protections(page_tags=tags))
    a = Sequence(1, chat_ids(fp32_model, PROMPTS[1]), SamplingParams(max_tokens=8, temperature=0), lambda ev: None)

    def scenario():
        engine._admit(a)
        engine.step()  # prefill: a holds its prompt's pages and has a first token
        stale, cached = a.run, a.num_cached
        engine._preempt(a)
        requeued = a.phase is Phase.WAITING and engine.waiting[0] is a and a.run is None
        engine.waiting.popleft()  # this test steps ``a`` by hand from here
        thief = engine.pool.allocate(2, engine.pool.num_free)
        assert set(stale.pages) <= set(thief.pages)
        a.run, a.num_cached = stale, cached  # the bug: the old table survives
        return requeued, engine.runner.step([(a, 1)])

    try:
        requeued, res = engine.call(scenario).result()
    finally:
        engine.stop()
    assert requeued and engine.preemptions == 1
    if tags:
        assert res.failed == [a] and res.logits is None
    else:
        assert res.failed == [] and res.seqs == [a]


def test_a_caller_that_gives_up_before_the_engine_runs_its_call_leaves_the_engine_serving(fp32_model):
    """A client that leaves while its request waits for the engine thread (``await wrap_future(...)`` cancelled,
    which cancels the call's future) must not take the engine thread down: the call still runs (it may release
    pages), its result goes nowhere, and the next request is served."""
    engine = make_engine(fp32_model)
    try:
        busy = engine.call(lambda: time.sleep(0.5))  # the engine thread is mid-step
        gone = engine.submit(Sequence(987_654, chat_ids(fp32_model, "Hi"), SamplingParams(max_tokens=4),
                                      lambda ev: None))
        assert gone.cancel()
        busy.result(10)
        [out] = generate(engine, [chat_ids(fp32_model, "List three colors.")], 4, timeout=60)
        assert len(out) == 4
        assert engine.call(lambda: engine.pool.num_free).result(10) == engine.pool.cfg.num_pages
    finally:
        engine.stop()
