"""The per-tenant prefix cache on the engine, in pairs: the same tenant hits (fewer tokens computed, the same
output), another tenant misses with the same prompt; eviction under pressure; a page cached for one tenant is
never read by another (red with the page-tag check off); unsalted keys let tenants share (the unsafe switch)."""

import itertools
import threading
import time

import pytest
from engine_util import make_engine

from kvseal.config import Protections
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Sequence
from kvseal.errors import KVIntegrityError

SYSTEM = ("You are a meticulous assistant for a lighthouse museum. Answer in two sentences, cite the exhibit "
          "number when you can, and never invent dates. The museum has exhibits on lenses, keepers' logs, "
          "shipwrecks of the northern coast, foghorns, and the history of the lamp oils used since 1820. ") * 3
_rids = itertools.count(50_000)


def prompt_ids(lm, question: str) -> list[int]:
    return list(lm.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        add_generation_prompt=True, tokenize=True, return_dict=False))


def run(engine, prompt, tenant, max_tokens=12, seq_fn=None, cache_salt=""):
    """One greedy request; its tokens, the tokens the engine computed meanwhile, and its final event."""
    out, final, done = [], [], threading.Event()

    def sink(ev):
        out.extend(ev.token_ids)
        if ev.cached_tokens:
            final.append(("cached", ev.cached_tokens))
        if ev.finish_reason:
            final.append(ev)
            done.set()

    seq = Sequence(next(_rids), list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), sink,
                   tenant=tenant, cache_salt=cache_salt)
    before = engine.computed_tokens
    if seq_fn:
        engine.call(lambda: seq_fn(seq)).result()
    else:
        engine.submit(seq)
    assert done.wait(120), "request hung"
    cached = dict(e for e in final if isinstance(e, tuple)).get("cached", 0)
    return {"tokens": out, "computed": engine.computed_tokens - before, "final": final[-1], "cached": cached}


def idle(engine):
    def check():
        engine.pool.check_integrity()
        return engine.pool.num_available, engine.pool.cfg.num_pages
    return engine.call(check).result()


@pytest.fixture(scope="module")
def engine(fp32_model):
    e = make_engine(fp32_model, prefix_cache=True)
    yield e
    e.stop()


def test_same_tenant_hits_other_tenant_misses(fp32_model, engine):
    prompt = prompt_ids(fp32_model, "Which exhibit shows the lenses?")
    assert len(prompt) > 200
    cold = run(engine, prompt, "acme")
    warm = run(engine, prompt, "acme")
    other = run(engine, prompt, "globex")
    full_pages = (len(prompt) - 1) // 16 * 16
    assert cold["cached"] == 0 and warm["cached"] == full_pages
    assert warm["tokens"] == cold["tokens"] == other["tokens"]  # the cache changes no output
    assert warm["computed"] == cold["computed"] - full_pages
    assert other["cached"] == 0 and other["computed"] == cold["computed"]  # same prompt, other tenant: a miss
    # a different question after the same system prompt reuses the shared prefix
    follow = run(engine, prompt_ids(fp32_model, "Where are the keepers' logs?"), "acme")
    assert follow["cached"] >= len(prompt_ids(fp32_model, "")) // 16 * 16 - 16
    free, total = idle(engine)
    assert free == total  # cached pages nobody holds count as available


def test_a_requests_cache_salt_keeps_its_keys_apart_within_its_tenant(fp32_model, engine):
    """vLLM's cache_salt: one tenant's requests with different salts (or none) never share a cached prefix; the
    same salt does. Salts add no namespaces: the table a client could grow stays one entry per tenant."""
    prompt = prompt_ids(fp32_model, "Which exhibit shows the foghorns?")
    spaces = len(engine.cache._spaces)
    plain = run(engine, prompt, "acme")
    salted = run(engine, prompt, "acme", cache_salt="user-1")
    again = run(engine, prompt, "acme", cache_salt="user-1")
    other = run(engine, prompt, "acme", cache_salt="user-2")
    foreign = run(engine, prompt, "globex", cache_salt="user-1")  # a salt never reaches another tenant's keys
    unsalted = run(engine, prompt, "acme")
    full_pages = (len(prompt) - 1) // 16 * 16
    assert salted["cached"] == other["cached"] == foreign["cached"] == 0, "another salt's (or tenant's) keys matched"
    assert again["cached"] == full_pages and unsalted["cached"] == full_pages
    assert plain["tokens"] == salted["tokens"] == again["tokens"] == other["tokens"]
    assert len(engine.cache._spaces) == spaces
    assert idle(engine)[0] == idle(engine)[1]


def test_unsalted_keys_let_tenants_share(fp32_model):
    e = make_engine(fp32_model, pages=256, prefix_cache=True, protections=Protections(cache_salt=False))
    try:
        prompt = prompt_ids(fp32_model, "Which exhibit shows the lenses?")
        a = run(e, prompt, "acme")
        b = run(e, prompt, "globex")
        assert b["cached"] > 0 and b["tokens"] == a["tokens"], "unsalted, the other tenant should hit"
    finally:
        e.stop()


def test_eviction_under_pressure_keeps_the_pool_conserved(fp32_model):
    e = make_engine(fp32_model, pages=40, prefix_cache=True)  # 640 tokens: about two prompts' worth
    try:
        prompts = [prompt_ids(fp32_model, f"Question {i}: what is exhibit {i} about?") for i in range(5)]
        prompts = [[p[0], 100 + i] + p[1:] for i, p in enumerate(prompts)]  # nothing shared between them
        cold = [run(e, p, "acme") for p in prompts]
        assert all(r["final"].finish_reason == "length" for r in cold)
        assert e.cache.pages <= 40
        last = run(e, prompts[-1], "acme")  # the most recent prompt survived the evictions
        first = run(e, prompts[0], "acme")  # the oldest did not
        assert last["cached"] > 0 and first["cached"] == 0
        assert last["tokens"] == cold[-1]["tokens"] and first["tokens"] == cold[0]["tokens"]
        free, total = idle(e)
        assert free == total
    finally:
        e.stop()


def foreign_cache_read(fp32_model, prot: Protections) -> dict:
    """Tenant ``acme`` caches a prompt; a request of ``globex`` is handed acme's cached pages in its table (a
    scheduler bug, injected). The tag check must stop it before the forward reads them."""
    e = make_engine(fp32_model, pages=256, prefix_cache=True, protections=prot)
    try:
        prompt = prompt_ids(fp32_model, "Which exhibit shows the lenses?")
        run(e, prompt, "acme")

        def intrude(seq):
            keys = e.cache.keys("acme", prompt)
            k = (len(prompt) - 1) // 16
            seq.space = e.cache.namespace("globex")
            seq.run = e.cache.lookup(keys[:k], e.cache.namespace("acme"))
            seq.num_cached, seq.registered, seq.cache_keys = k * 16, k, e.cache.keys("globex", prompt)
            e.seqs[seq.rid] = seq
            e.waiting.append(seq)

        r = run(e, prompt, "globex", seq_fn=intrude)
        r["after"] = run(e, prompt, "acme")  # acme's cache is not disturbed
        time.sleep(0.1)
        return r
    finally:
        e.stop()


def test_a_page_cached_for_one_tenant_fails_the_tag_check_for_another(fp32_model):
    r = foreign_cache_read(fp32_model, Protections())
    assert r["final"].finish_reason == "error" and isinstance(r["final"].error, KVIntegrityError)
    assert r["after"]["final"].finish_reason == "length" and r["after"]["cached"] > 0


def test_without_page_tags_another_tenant_reads_the_cached_pages(fp32_model):
    r = foreign_cache_read(fp32_model, Protections(page_tags=False))
    assert r["final"].finish_reason == "length", "the unchecked engine should serve from acme's pages"


def test_choices_share_cached_pages_and_equal_a_single_run(fp32_model, engine):
    """n > 1 on top of the cache: the leader hits the cached prefix, its choices share the leader's pages (the
    cached ones gain references), and each greedy choice equals a single run."""
    from test_choices import choices

    prompt = prompt_ids(fp32_model, "What is in hall 3?")
    single = run(engine, prompt, "default", max_tokens=10)["tokens"]
    outs = choices(engine, prompt, 3, SamplingParams(max_tokens=10, temperature=0))
    assert outs == [single[:len(o)] for o in outs] and all(len(o) == 10 for o in outs)
    free, total = idle(engine)
    assert free == total
