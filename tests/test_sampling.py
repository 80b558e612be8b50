"""Logits processors against direct computations on the logits (OpenAI's and vLLM's formulas), truncation,
and logprobs."""

from dataclasses import dataclass, field

import pytest
import torch

from kvseal.engine.sampling import SamplingParams, logprob, process, sample

V = 64


@dataclass
class Row:
    params: SamplingParams
    prompt: list[int]
    tokens: list[int]
    generator: torch.Generator | None = None
    eos_ids: frozenset[int] = frozenset({2})
    matcher: object | None = None
    logprob: object = field(default=None)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)


def row(prompt=(5, 6, 7), out=(7, 9, 9, 9), **kw) -> Row:
    return Row(SamplingParams(max_tokens=8, temperature=0, **kw), list(prompt), list(prompt) + list(out))


def logits() -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(3)) * 3


def test_frequency_and_presence_penalties_follow_openai():
    x, r = logits(), row(frequency_penalty=0.7, presence_penalty=1.1)
    want = x.clone()
    for tok, count in {7: 1, 9: 3}.items():  # output tokens only: the prompt's 5, 6, 7 do not count
        want[tok] -= 0.7 * count + 1.1
    assert torch.allclose(process(x.clone(), r), want)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x, r = logits(), row(repetition_penalty=1.3)
    want = x.clone()
    for tok in (5, 6, 7, 9):  # prompt and output
        want[tok] = x[tok] / 1.3 if x[tok] > 0 else x[tok] * 1.3
    assert torch.allclose(process(x.clone(), r), want)


def test_logit_bias_is_added_and_minus_100_bans():
    x = logits()
    x[11] = 50.0
    r = row(logit_bias=((11, -100.0), (12, 4.5)))
    got = process(x.clone(), r)
    assert got[11] == x[11] - 100 and got[12] == x[12] + 4.5
    assert sample(x[None], [r])[0][0] != 11


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    x = logits()
    x[2] = x[13] = 99.0  # EOS and a stop token would win
    early = row(out=(9,), min_tokens=3, stop_token_ids=(13,))
    assert sample(x[None], [early])[0][0] not in (2, 13)
    late = row(out=(9, 9, 9), min_tokens=3, stop_token_ids=(13,))
    assert sample(x[None], [late])[0][0] in (2, 13)


def test_min_p_top_k_top_p_only_draw_allowed_tokens():
    x = logits()
    probs = torch.softmax(x, -1)
    top = probs.argsort(descending=True)
    g = torch.Generator().manual_seed(0)
    for kw, allowed in [({"top_k": 3}, set(top[:3].tolist())),
                        ({"min_p": 0.5}, set((probs >= 0.5 * probs.max()).nonzero().flatten().tolist())),
                        ({"top_p": 0.5}, set(top[: int((probs[top].cumsum(0) < 0.5).sum()) + 1].tolist()))]:
        r = Row(SamplingParams(max_tokens=8, temperature=1.0, **kw), [1], [1], generator=g)
        drawn = {sample(x[None], [r])[0][0] for _ in range(200)}
        assert drawn <= allowed and drawn, (kw, drawn, allowed)


def test_logprobs_are_log_softmax_with_sorted_top_k():
    x = logits()
    lp = logprob(x, 4, 5)
    ref = torch.log_softmax(x, -1)
    assert lp.token == 4 and lp.logprob == pytest.approx(float(ref[4]))
    assert [t for t, _ in lp.top] == ref.argsort(descending=True)[:5].tolist()
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_logprobs_follow_the_processed_distribution():
    x, r = logits(), row(frequency_penalty=1.0, logprobs=2)
    tok, lp = sample(x[None], [r])[0]
    want = torch.log_softmax(process(x.clone(), r), -1)
    assert tok == int(want.argmax()) and lp.logprob == pytest.approx(float(want[tok]))


def test_plain_greedy_rows_skip_processing():
    x = torch.stack([logits(), -logits()])
    rows = [row(), row()]
    assert [t for t, _ in sample(x, rows)] == x.argmax(-1).tolist()
    assert all(lp is None for _, lp in sample(x, rows))


def test_the_grammar_mask_allows_exactly_the_bits_llguidance_sets(bf16_model):
    """``mask_row`` (eager ops, no torch.compile) leaves finite exactly the tokens whose bit llguidance set, by an
    independent unpacking (numpy, little-endian bits), at the start of a JSON object and after a few tokens."""
    import llguidance.torch as llt
    import numpy as np

    from kvseal.engine.grammar import Grammars, compile_response_format, mask_row
    vocab = bf16_model.model.cfg.vocab_size
    grammar = compile_response_format({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}})
    replay = bf16_model.tokenizer.encode('{"name":"A', add_special_tokens=False)
    for prefix in ([], replay):
        m = Grammars(lambda: bf16_model.tokenizer, vocab).matcher(grammar, prefix)
        bits = llt.allocate_token_bitmask(1, vocab)
        llt.fill_next_token_bitmask(m, bits, 0)
        want = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
        row = torch.zeros(vocab)
        mask_row(m, row)
        got = torch.isfinite(row).numpy()
        assert 0 < want.sum() < vocab and (got == want).all(), (want.sum(), got.sum())


@pytest.mark.parametrize("allowed,want", [({2}, 2), ({2, 5}, 5)])
def test_min_tokens_gives_way_to_a_grammar_that_has_ended(monkeypatch, allowed, want):
    """A grammar that allows only EOS has ended: min_tokens's ban of EOS then left no token at all (a draw
    failed, greedy took token 0). The grammar's end now ends the request; while the grammar allows anything
    else, EOS stays banned."""
    from kvseal.engine import grammar
    monkeypatch.setattr(grammar, "allowed_tokens",
                        lambda m, n: torch.isin(torch.arange(n), torch.tensor(sorted(allowed))))
    for temperature in (0, 1.0):
        matcher = type("Matcher", (), {"consume_token": lambda self, t: None})()
        r = Row(SamplingParams(max_tokens=9, temperature=temperature, min_tokens=8, grammar="a grammar"), [5, 6],
                [5, 6, 7], torch.Generator().manual_seed(1), matcher=matcher)
        assert sample(logits()[None], [r])[0][0] == want


def test_a_row_that_cannot_sample_fails_its_request_alone(fp32_model, monkeypatch):
    """One row's sampling error failed the engine's step, and so every request batched with it (seen:
    response_format with min_tokens at temperature 1 was a 500 for all of them). Now that row's request fails
    (500) and the others finish."""
    import threading

    from engine_util import chat_ids, make_engine

    from kvseal.engine import sampling
    from kvseal.engine.sequence import Sequence
    real = sampling.process

    def process(x, r):
        if r.params.presence_penalty == 1.5:
            raise ValueError("a bug")
        return real(x, r)

    monkeypatch.setattr(sampling, "process", process)
    monkeypatch.setattr(sampling, "penalized_only", lambda r: False)  # every row through process
    engine = make_engine(fp32_model)
    finals, done = {}, threading.Event()

    def sink(rid):
        def put(ev):
            if ev.finish_reason:
                finals[rid] = ev
                if len(finals) == 3:
                    done.set()
        return put

    try:
        prompt = chat_ids(fp32_model, "Name a color.")
        for rid, pp in ((1, 0.0), (2, 1.5), (3, 0.5)):
            engine.submit(Sequence(rid, prompt, SamplingParams(max_tokens=6, temperature=0, presence_penalty=pp),
                                   sink(rid)))
        assert done.wait(120), "a request hung"
    finally:
        engine.stop()
    assert finals[2].finish_reason == "error" and finals[2].error.status == 500, finals[2]
    assert finals[1].error is None and finals[3].error is None, (finals[1], finals[3])
    assert engine.pool.num_available == engine.pool.cfg.num_pages  # every page back, the failed one's too


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 5e-324])
def test_a_temperature_too_small_to_divide_by_samples_greedily(temperature):
    """Logits over 1e-40 are infinities: the draw failed (a 500; before that, the step of every request batched
    with it). Below 1e-5 a request is greedy, as in vLLM, with the logprobs of its processed logits."""
    x = logits()
    r = Row(SamplingParams(max_tokens=8, temperature=temperature, seed=1, logprobs=2), [1], [1])
    (tok, lp), = sample(x[None], [r])
    assert tok == int(x.argmax()) and lp.logprob == pytest.approx(float(torch.log_softmax(x, -1).max()))


def peaked(n: int, vocab: int = 8192, seed: int = 0) -> torch.Tensor:
    """Logits shaped like a language model's: a tail of noise under a few likely tokens (SmolLM2's own rows
    hold their top-p 0.9 nucleus within their 256 most likely tokens at temperature 0.7)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 1.5
    for i in range(n):
        x[i, torch.randperm(vocab, generator=g)[:24]] += torch.linspace(11, 3, 24)
    return x


def sampled(n: int, generator_seed: int = 0, **kw) -> list[Row]:
    return [Row(SamplingParams(max_tokens=8, **kw), [1], [1], torch.Generator().manual_seed(generator_seed + i))
            for i in range(n)]


TRUNCATIONS = [dict(top_k=k, top_p=p, min_p=m) for k in (0, 1, 5, 20, 300) for p in (1.0, 0.5, 0.9, 0.99)
               for m in (0.0, 0.05) if k or p < 1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_the_candidates_keep_what_the_whole_vocabulary_keeps(temperature):
    """Rows drawn from their most likely tokens draw from exactly what the whole-vocabulary rules keep (top_k
    with its ties, min_p, top_p), wherever ``candidates`` says they can; where it says so of a row whose kept
    tokens reach further down, this fails (the flat rows' nuclei run past the first 256)."""
    from kvseal.engine.sampling import CANDIDATES, candidates, truncated
    x = torch.cat([peaked(4), torch.randn(4, 8192, generator=torch.Generator().manual_seed(9))]) / temperature
    x[0, :3] = x[0].topk(5).values[-1]  # ties with the 5th token: top_k 5 keeps 7 (which of equal tokens
    tied = x[0] == x[0, 0]  # top_p keeps, where they straddle its limit, is the sort's choice: compared apart)
    short = past = 0
    for kw in TRUNCATIONS:
        rows = [Row(SamplingParams(max_tokens=8, temperature=temperature, **kw), [1], [1]) for _ in x]
        want = truncated(x.clone(), rows)
        for c in CANDIDATES:
            order, w, ok = candidates(x.clone(), rows, c)
            for i in ok.nonzero().flatten().tolist():
                got = torch.zeros(x.shape[1]).scatter_(0, order[i], w[i])
                apart = tied if i == 0 else torch.zeros_like(tied)
                assert torch.allclose(got[~apart], want[i][~apart], atol=1e-6), (kw, c, i)
                assert torch.allclose(got.sort().values, want[i].sort().values, atol=1e-6), (kw, c, i)
            short += int(ok[:4].sum())
            past += int((~ok[4:]).sum())
    assert short > len(TRUNCATIONS) * 4  # the peaked rows mostly take the short path
    assert past > 0  # and some flat rows' kept tokens reach past the candidates (the check above is exercised)


@pytest.mark.parametrize("vocab", [64, 8192])
@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9),
                                dict(temperature=0.7, top_k=20, top_p=0.95), dict(temperature=1.2, min_p=0.02)])
def test_draws_follow_the_truncated_distribution(vocab, kw):
    """4,000 draws of one row's distribution (each on its own generator): the tokens drawn are among the kept
    ones, each as often as its probability says (within 5 standard deviations; the unlikely ones as a group)."""
    from kvseal.engine.sampling import draw, truncated
    n = 4000
    x = peaked(1, vocab, seed=vocab) / kw["temperature"]
    rows = sampled(n, **kw)
    want = truncated(x.clone(), rows[:1])[0].double()
    want /= want.sum()  # what min_p and top_p keep, renormalized
    got = torch.bincount(torch.tensor(draw(x.expand(n, -1).clone(), rows)), minlength=vocab).double() / n
    assert set(got.nonzero().flatten().tolist()) <= set(want.nonzero().flatten().tolist())
    big = want * n >= 10  # each token expected 10 times or more on its own, the rest together
    got, want = torch.cat([got[big], got[~big].sum()[None]]), torch.cat([want[big], want[~big].sum()[None]])
    sd = (want * (1 - want) / n).sqrt()
    assert ((got - want).abs() <= 5 * sd + 1e-9).all(), ((got - want).abs() / sd).max()


def test_a_seeded_row_draws_the_same_alone_or_batched_with_others():
    """Each row draws with one number from its own generator, and every batch operation works row by row: a
    seeded request's tokens do not depend on what it was batched with (nor on which path the others took)."""
    from kvseal.engine.sampling import make_generator
    x = torch.cat([peaked(3), torch.randn(1, 8192)])
    mine = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=42)

    def seeded() -> Row:
        return Row(mine, [1], [1], make_generator(mine))

    alone, batched = seeded(), seeded()
    others = [Row(SamplingParams(max_tokens=8, **kw), [1], [1], torch.Generator().manual_seed(i))
              for i, kw in enumerate([dict(temperature=1.5), dict(temperature=0.7, top_k=3), dict(temperature=0)])]
    for step in range(30):
        a = sample(x[step % 3][None], [alone])[0][0]
        b = sample(torch.stack([x[3], x[step % 3], x[1], x[2]]), [others[0], batched, *others[1:]])[1][0]
        assert a == b, step


def test_a_language_models_rows_are_drawn_from_their_candidates(monkeypatch):
    """The short path is the one taken: drawing over the whole vocabulary (a sort of it, for top_p) cost ~1.3-3
    ms a row, three times a 32-row decode step at temperature 0.7, top_p 0.9."""
    from kvseal.engine import sampling

    def whole(x, rows):
        raise AssertionError("drawn over the whole vocabulary")

    monkeypatch.setattr(sampling, "truncated", whole)
    x = peaked(32)
    for kw in (dict(temperature=0.7, top_p=0.9), dict(temperature=0.6, top_p=0.95, top_k=20)):
        got = sample(x, sampled(32, **kw))
        assert all(isinstance(t, int) for t, _ in got), got


@pytest.mark.parametrize("temperature", [0, 1.0])
@pytest.mark.parametrize("fill", [float("-inf"), float("nan")])
def test_a_row_its_processors_leave_no_finite_logit_fails_alone(monkeypatch, temperature, fill):
    """Processors that rule out every token (or break the row) fail that row's request: greedy would take
    token 0, a draw has nothing to draw from. The row batched with it is served."""
    from kvseal.engine import sampling
    from kvseal.errors import EngineError
    real = sampling.process

    def process(x, r):
        if r.params.presence_penalty == 1.5:
            return x.fill_(fill)
        return real(x, r)

    monkeypatch.setattr(sampling, "process", process)
    monkeypatch.setattr(sampling, "penalized_only", lambda r: False)  # every row through process
    x = torch.stack([logits(), logits()])
    bad = Row(SamplingParams(max_tokens=8, temperature=temperature, presence_penalty=1.5), [1], [1, 3],
              torch.Generator().manual_seed(1))
    good = Row(SamplingParams(max_tokens=8, temperature=temperature, presence_penalty=0.5), [1], [1, 3],
               torch.Generator().manual_seed(2))
    got = sample(x, [bad, good])
    assert isinstance(got[0], EngineError) and got[0].status == 500, got
    assert isinstance(got[1][0], int)


def test_bias_and_penalties_applied_to_rows_together_equal_each_row_alone():
    """sample() applies logit_bias, repetition, frequency and presence penalties to its rows at once
    (penalize); each row's logits must be what process() gives it alone, whatever it shares the step with, and
    rows it does not name must not move."""
    from kvseal.engine.sampling import penalize, penalized_only

    g = torch.Generator().manual_seed(11)
    vocab = 500
    kinds = [dict(logit_bias=((3, 2.5), (40, -100.0), (499, 0.25))), dict(repetition_penalty=1.3),
             dict(repetition_penalty=0.8), dict(frequency_penalty=0.7), dict(presence_penalty=-1.1),
             dict(frequency_penalty=-0.4, presence_penalty=1.9, repetition_penalty=1.15,
                  logit_bias=((7, 1.0), (8, -3.0))),
             dict(min_tokens=5, presence_penalty=0.5)]  # met after 5 outputs (row 6); before (13, 20): one by one
    rows = []
    for i in range(24):
        prompt = torch.randint(0, 60, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        out = torch.randint(0, 60, (i % 9,), generator=g).tolist()  # small ids: many repeats, some rows empty
        kw = kinds[i % len(kinds)] if i % 5 else {}
        rows.append(Row(SamplingParams(max_tokens=50, temperature=0.7, **kw), prompt, prompt + out))
    x = torch.randn(len(rows), vocab, generator=g) * 4
    js = [j for j, r in enumerate(rows) if penalized_only(r)]
    assert 15 <= len(js) < len(rows) and 6 in js and 13 not in js  # not: no parameters, or min_tokens not met
    together = x.clone()
    assert penalize(together, js, [rows[j] for j in js])
    changed = 0
    for j, r in enumerate(rows):
        want = process(x[j].clone(), r) if j in js else x[j]
        assert torch.equal(together[j], want), f"row {j} ({r.params})"
        changed += not torch.equal(want, x[j])
    assert changed >= 12  # the parameters did change most rows (a penalty over no output changes nothing)


def test_a_token_outside_the_vocabulary_fails_its_row_alone():
    """A token id past the logits' width would land in the next row's logits if the rows were penalized
    together: penalize refuses and leaves the rows untouched, and each row is processed alone, where that one
    fails and its neighbour is served as it would be by itself."""
    from kvseal.engine.sampling import penalize

    bad = row(out=(9, V + 3), repetition_penalty=1.2)
    good = row(frequency_penalty=0.5, presence_penalty=0.2)
    x = torch.stack([logits(), logits() * 0.5])
    before = x.clone()
    assert not penalize(x, [0, 1], [bad, good]) and torch.equal(x, before)
    got = sample(x, [bad, good])
    assert isinstance(got[0], Exception) and got[1][0] == int(process(before[1].clone(), good).argmax())
