"""The real model: kvseal's greedy tokens equal Hugging Face transformers', and batching changes nothing."""

import contextlib
import copy
import functools
import time

import pytest
import torch
from engine_util import chat_ids, generate, make_engine

from kvseal.engine.build import off_main_thread

PROMPTS = [
    "Write a haiku about the sea.",
    "List three colors.",
    "Explain what a CPU does in one sentence.",
    "What is the capital of Germany?",
    "Give me a short recipe for pancakes.",
    "Tell me a fun fact about octopuses.",
]
N = 32
EOS = (2,)  # <|im_end|>; both sides stop there, inclusive


@contextlib.contextmanager
def gguf_memoized():
    """transformers' GGUF loader builds gguf's tensor name map once per tensor (397 times) and parses the file
    twice (config, then weights); both are pure functions of their arguments, so memoizing them while it loads
    gives the same model in half the time (23 -> 10 s on an AVX2 Zen 3)."""
    import gguf

    saved = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map = functools.lru_cache(None)(saved[0])
    gguf.GGUFReader = functools.lru_cache(None)(saved[1])
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = saved


def hf_model(lm, dtype):
    """Hugging Face's own model from the same GGUF file (transformers dequantizes it with gguf's own code and
    converts the GGUF's tokenizer too)."""
    from transformers import AutoModelForCausalLM

    def load():
        with gguf_memoized():
            return AutoModelForCausalLM.from_pretrained(str(lm.path.parent), gguf_file=lm.path.name, dtype=dtype)

    return off_main_thread(load)


@pytest.fixture(scope="module")
def hf_fp32(fp32_model):
    return hf_model(fp32_model, torch.float32)


def hf_bf16(hf_fp32):
    """What ``hf_model(lm, torch.bfloat16)`` loads, 0.2 s instead of 11: its parameters rounded to bf16, its
    buffers (RoPE's inverse frequencies) left in fp32 as transformers leaves them (checked once: the same
    parameters, buffers, logits and greedy tokens)."""
    hf = copy.deepcopy(hf_fp32)
    for p in hf.parameters():
        p.data = p.data.to(torch.bfloat16)
    hf.config.dtype = torch.bfloat16
    return hf


def hf_greedy(hf, prompts, margins=False):
    def run():
        outs = []
        for ids in prompts:
            x = torch.tensor([ids])  # explicit mask: the prompt contains the pad id (<|im_end|>)
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
            toks = out.sequences[0, len(ids):].tolist()
            gaps = [float(sc[0].float().topk(2).values.diff().abs()) for sc in out.scores]
            outs.append((toks, gaps) if margins else toks)
        return outs

    return off_main_thread(run)


@pytest.fixture(scope="module")
def fp32_prompts(fp32_model):
    return [chat_ids(fp32_model, p) for p in PROMPTS]


def test_greedy_matches_transformers_fp32(fp32_model, fp32_prompts, hf_fp32):
    ref = hf_greedy(hf_fp32, fp32_prompts)
    engine = make_engine(fp32_model)
    try:
        ours = generate(engine, fp32_prompts, N, eos=EOS)
        engine.call(engine.pool.check_integrity).result()
    finally:
        engine.stop()
    for p, a, b in zip(PROMPTS, ours, ref):
        assert a == b, f"{p!r}: kvseal {a} != transformers {b}"


def test_greedy_matches_transformers_bf16(bf16_model, hf_fp32):
    """Same dtype as HF. bf16 rounding differs between any two implementations, so tokens are compared up
    to the first step where HF's own top-2 logit gap is a near tie (< 0.25); most prompts must have none."""
    prompts = [chat_ids(bf16_model, p) for p in PROMPTS]
    ref = hf_greedy(hf_bf16(hf_fp32), prompts, margins=True)
    engine = make_engine(bf16_model, dtype="bf16")
    try:
        ours = generate(engine, prompts, N, eos=EOS)
    finally:
        engine.stop()
    compared = 0
    for p, a, (b, gaps) in zip(PROMPTS, ours, ref):
        upto = next((i for i, g in enumerate(gaps) if g < 0.25), len(b))
        compared += upto
        assert a[:upto] == b[:upto], f"{p!r} differs before any near tie"
    assert compared >= 30, f"only {compared} tokens had clear margins"


def test_mixed_batch_equals_each_alone(fp32_model, fp32_prompts):
    engine = make_engine(fp32_model)
    try:
        alone = [generate(engine, [p], N)[0] for p in fp32_prompts[:4]]
        together = generate(engine, fp32_prompts[:4], N)  # different lengths, one decode batch
        engine.call(engine.pool.check_integrity).result()
        assert engine.pool.num_free == engine.pool.cfg.num_pages
    finally:
        engine.stop()
    assert together == alone


def test_backpressure_waits_instead_of_failing(fp32_model, fp32_prompts):
    """A pool that holds one request at a time still serves four: they queue, then run."""
    per_req = -(-(max(map(len, fp32_prompts[:4])) + 8) // 16)
    engine = make_engine(fp32_model, pages=per_req)
    try:
        outs = generate(engine, fp32_prompts[:4], 8)
        assert all(len(o) == 8 for o in outs)
        assert engine.pool.num_free == per_req
    finally:
        engine.stop()


def test_load_cache_gives_the_same_model(tmp_path, monkeypatch):
    """The first load parses the GGUF and writes the cache; the second reads it: same config, bit-identical
    weights, same tokens from the tokenizer and its chat template."""
    from kvseal.model.loader import load

    monkeypatch.setenv("KVSEAL_CACHE", str(tmp_path))
    def parse():
        with gguf_memoized():  # the weights and the tokenizer from one parse of the file
            return load(None, torch.bfloat16, progress=False)

    parsed = off_main_thread(parse)
    assert [p.name for p in tmp_path.iterdir() if (p / "complete").exists()], "no complete cache written"
    cached = off_main_thread(lambda: load(None, torch.bfloat16, progress=False))
    assert cached.model.cfg == parsed.model.cfg
    a, b = parsed.model.w, cached.model.w
    assert torch.equal(a.embed, b.embed) and torch.equal(a.norm, b.norm)
    for x, y in zip(a.layers, b.layers):
        assert all(torch.equal(getattr(x, f), getattr(y, f)) for f in ("attn_norm", "wqkv", "wo", "w_gate_up", "w_down"))
    text = "Bonjour! ünïcödé 日本 🙂 What is 2+2?"
    assert chat_ids(parsed, text) == chat_ids(cached, text)


def test_the_cached_tokenizer_is_the_one_autotokenizer_builds():
    """A server start reads the load cache's tokenizer as the class it was saved from, without AutoTokenizer's
    import of every model's tokenizer: the same class, tokens, special tokens, chat template and decoding."""
    from transformers import AutoTokenizer

    from kvseal.model.files import load_tokenizer, tokenizer_source
    from kvseal.model.loader import default_model_path, load

    off_main_thread(lambda: load(None, torch.bfloat16, progress=False))  # the load cache is written by now
    cache = tokenizer_source(default_model_path())
    assert cache != default_model_path(), "no load cache to read"
    ours, auto = load_tokenizer(default_model_path()), AutoTokenizer.from_pretrained(str(cache))
    assert type(ours) is type(auto) and len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
    assert ours.special_tokens_map == auto.special_tokens_map and ours.all_special_ids == auto.all_special_ids
    texts = ["Bonjour! ünïcödé 日本 🙂 What is 2+2?", "<|im_start|>user\n  spaces\tand tabs<|im_end|>", ""]
    for text in texts:
        ids = auto.encode(text)
        assert ours.encode(text) == ids and ours.decode(ids) == auto.decode(ids)
        assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[0]}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_a_tokenizer_is_counted_as_transformers_counts_it_without_building_it(tmp_path):
    """A worker checks the tokenizer fits the vocabulary from tokenizer.json alone (transformers' import is ~1 s
    of every start); the count is the one transformers gives, added tokens included, and the tokenizer itself is
    built on first use."""
    from kvseal.model.loader import default_model_path, load, load_tokenizer, tokenizer_size

    lm = off_main_thread(lambda: load(None, torch.bfloat16, progress=False))  # the load cache is written by now
    assert lm._tok is None, "the tokenizer was built at load"
    tok = load_tokenizer(default_model_path())
    assert tokenizer_size(default_model_path()) == len(tok) == len(lm.tokenizer)
    tok.add_tokens(["<kvseal_added>"], special_tokens=True)
    tok.save_pretrained(str(tmp_path))
    assert tokenizer_size(tmp_path) == len(tok) == len(load_tokenizer(tmp_path)) == 49153


def test_an_engine_waiting_for_pages_sleeps_instead_of_spinning(fp32_model):
    """Its only request cannot have pages until others come back (a prefill worker awaiting decode's acks):
    the engine thread must sleep on its inbox, not spin a core that the other engine on this host needs."""
    import time

    import psutil

    from kvseal.engine.sampling import SamplingParams
    from kvseal.engine.sequence import Sequence

    engine = make_engine(fp32_model, pages=4)
    try:
        held = engine.call(lambda: engine.pool.allocate(999, 4)).result()
        events = []
        engine.submit(Sequence(7001, [5] * 10, SamplingParams(max_tokens=3, temperature=0), events.append)).result()
        tid = engine._thread.native_id

        def cpu() -> float:
            return next(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == tid)

        before = cpu()
        time.sleep(1.0)
        used = cpu() - before
        assert used < 0.2, f"the engine thread burned {used:.2f} s of CPU in 1 s with nothing it could run"
        engine.call(lambda: engine.pool.free(held)).result()  # pages come back: the request runs at once
        deadline = time.time() + 30
        while not (events and events[-1].finish_reason) and time.time() < deadline:
            time.sleep(0.05)
        assert events[-1].finish_reason == "length"
    finally:
        engine.stop()


def test_logprobs_match_transformers_fp32(fp32_model, fp32_prompts, hf_fp32):
    """The logprobs a greedy request returns are Hugging Face's fp32 log-softmax, top-k in the same order."""
    from kvseal.engine.sampling import SamplingParams
    from kvseal.engine.sequence import Sequence

    ids = fp32_prompts[0]
    engine = make_engine(fp32_model)
    events = []
    try:
        engine.submit(Sequence(424242, ids, SamplingParams(max_tokens=8, temperature=0, logprobs=5), events.append))
        deadline = time.time() + 120
        while not (events and events[-1].finish_reason) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        engine.stop()
    ours = [lp for ev in events for lp in ev.logprobs]

    def ref():
        x = torch.tensor([ids + [lp.token for lp in ours[:-1]]])
        with torch.no_grad():
            return torch.log_softmax(hf_fp32(x, attention_mask=torch.ones_like(x)).logits[0, len(ids) - 1:], -1)

    theirs = off_main_thread(ref)
    assert len(ours) == 8
    for lp, row in zip(ours, theirs):
        assert lp.token == int(row.argmax())
        assert lp.logprob == pytest.approx(float(row[lp.token]), abs=2e-3)
        top = row.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=2e-3)


def prompt_logprobs_from_engine(lm, ids, k=3, preempt_after=0, **kw):
    """The prompt logprobs a request's first event carries, and every event; ``preempt_after``: drive that many
    steps by hand, then preempt the request mid-prompt (its prompt is recomputed from the start)."""
    from kvseal.engine.sampling import SamplingParams
    from kvseal.engine.sequence import Phase, Sequence

    engine = make_engine(lm, **kw)
    events = []
    seq = Sequence(4343, ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k), events.append)

    def by_hand():
        engine._admit(seq)
        for _ in range(preempt_after):
            engine.step()
        cached, scored = seq.num_cached, len(seq.prompt_lps)
        engine._preempt(seq)
        return cached, scored

    try:
        partial = engine.call(by_hand).result() if preempt_after else None
        if not preempt_after:
            engine.submit(seq).result()
        deadline = time.time() + 120
        while not (events and events[-1].finish_reason) and time.time() < deadline:
            time.sleep(0.05)
        assert seq.phase is Phase.DONE and events[-1].error is None
    finally:
        engine.stop()
    return events, partial


@pytest.mark.parametrize("case", ["one chunk", "chunks of 8", "chunks of 1", "preempted mid-prompt"])
def test_prompt_logprobs_match_transformers_fp32(fp32_model, fp32_prompts, hf_fp32, case):
    """echo with logprobs: each prompt token's logprob (and top 3) is transformers' fp32 log-softmax of the row
    before it, whether the prompt runs in one chunk, in chunks of 8 or of 1 (rows that run as decode rows), or
    is preempted halfway and recomputed;
    they come once, on the first token's event, and nowhere else."""
    ids = fp32_prompts[2]
    kw = {"one chunk": {}, "chunks of 8": {"step_token_budget": 8}, "chunks of 1": {"step_token_budget": 1},
          "preempted mid-prompt": {"step_token_budget": 8, "preempt_after": 2}}[case]
    events, partial = prompt_logprobs_from_engine(fp32_model, ids, **kw)
    if partial:
        assert partial == (16, 16)  # two chunks in when preempted: prompt tokens 1..16 were scored

    def ref():
        x = torch.tensor([ids])
        with torch.no_grad():
            return torch.log_softmax(hf_fp32(x, attention_mask=torch.ones_like(x)).logits[0, :-1], -1)

    theirs = off_main_thread(ref)
    ours = events[0].prompt_logprobs
    assert events[0].token_ids and all(not ev.prompt_logprobs for ev in events[1:])
    assert [lp.token for lp in ours] == ids[1:]
    assert [lp.logprob for lp in ours] == pytest.approx(theirs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(),
                                                        abs=2e-3)
    for lp, row in zip(ours, theirs):
        top = row.topk(3)
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert lp.top[0][0] == int(top.indices[0]) or lp.top[0][1] == pytest.approx(lp.top[1][1], abs=2e-3)
