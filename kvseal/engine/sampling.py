"""Sampling: logits processors, then greedy or seeded random draws, with logprobs on request.

A batch where every request is plain greedy takes one ``argmax``. A row that asks for more is processed on
its own, in vLLM's order:

1. ``logit_bias`` added to its tokens (OpenAI: -100..100, applied to the raw logits);
2. ``min_tokens``: EOS and ``stop_token_ids`` banned until that many tokens were generated, unless a grammar
   has ended (it allows nothing else): the grammar's end ends the request;
3. ``repetition_penalty`` r over prompt and output tokens: a positive logit is divided by r, a negative one
   multiplied (CTRL, as vLLM and Hugging Face do);
4. ``frequency_penalty`` f and ``presence_penalty`` p over output tokens: ``logit -= f * count + p * (count > 0)``
   (OpenAI's formula);
5. a grammar (``response_format``) masks every token it cannot accept;
6. ``temperature``, then ``top_k``, ``top_p`` and ``min_p`` truncate, and the row draws from its own
   ``torch.Generator``, so a seeded request reproduces whatever it was batched with.

Logprobs are the log-softmax of the row after steps 1–5 and temperature (the distribution the token is drawn
from, before truncation; at temperature 0, or below 1e-5 as in vLLM, of the processed logits): the chosen
token's and the top ``k``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvseal.engine.request import GREEDY_BELOW, SamplingParams
from kvseal.errors import EngineError
from kvseal.transfer.messages import Logprob  # a wire type: it rides in Ack and token events


class Row(Protocol):
    """What sampling reads of a sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt: list[int]
    tokens: list[int]
    eos_ids: frozenset[int]
    matcher: object | None  # an llguidance LLMatcher, fed every sampled token

    @property
    def num_output(self) -> int: ...


def make_generator(params: SamplingParams, offset: int = 0) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed((params.seed + offset) % 2**64)  # as torch reads a negative seed
    return g


def sample(logits: torch.Tensor, rows: list[Row]) -> list[tuple[int, Logprob | None] | Exception]:
    """logits [B, V] → one ``(token id, logprob or None)`` per row; a grammar row's matcher takes its token.

    A row whose processing fails gives its exception instead, for the engine to fail that request alone: one
    request's parameters must never fail the step of every request batched with it."""
    out = logits.argmax(dim=-1).tolist()
    res: list[tuple[int, Logprob | None] | Exception] = []
    for i, r in enumerate(rows):
        if r.params.plain:
            res.append((out[i], None))
            continue
        try:
            res.append(_sample_row(logits[i].float().cpu(), r))  # a GPU's row: processed on the host, for now
        except Exception as e:  # noqa: BLE001 - this row's failure, not the batch's
            res.append(e)
    return res


def _sample_row(row: torch.Tensor, r: Row) -> tuple[int, Logprob | None]:
    p = r.params
    if p.processed:
        row = process(row.clone(), r)
        if not torch.isfinite(row).any():  # a draw would fail, an argmax would give token 0: neither is an answer
            raise EngineError("the request's constraints leave no token to sample")
    if p.temperature >= GREEDY_BELOW:
        row = row / p.temperature
    tok = int(row.argmax()) if p.greedy else _draw(row, p, r.generator)
    if r.matcher is not None:
        r.matcher.consume_token(tok)
    return tok, (logprob(row, tok, p.logprobs) if p.logprobs is not None else None)


def process(row: torch.Tensor, r: Row) -> torch.Tensor:
    """Steps 1–5 of the module docstring, in place on a copy of one row of logits [V]."""
    p = r.params
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        row[torch.tensor(ids)] += torch.tensor(bias)
    allowed = None
    if r.matcher is not None:
        from kvseal.engine.grammar import allowed_tokens

        allowed = allowed_tokens(r.matcher, row.numel())
    if r.num_output < p.min_tokens:
        ban = torch.tensor(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_ids))),
                           dtype=torch.int64)
        if ban.numel() and (allowed is None or allowed.index_fill(0, ban, False).any()):
            row[ban] = float("-inf")
    if p.repetition_penalty != 1:
        seen = torch.tensor(r.tokens).unique()
        v = row[seen]
        row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        counts = torch.bincount(torch.tensor(r.tokens[len(r.prompt):], dtype=torch.int64),
                                minlength=row.numel())[: row.numel()].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if allowed is not None:
        row.masked_fill_(~allowed, float("-inf"))
    return row


# The floor of a reported logprob, as OpenAI and vLLM report it: a token a grammar, min_tokens or a -inf bias
# rules out has logprob -inf, which JSON cannot carry (Python writes "-Infinity", msgspec writes null).
LOGPROB_FLOOR = -9999.0


def logprob(row: torch.Tensor, tok: int, k: int) -> Logprob:
    lp = torch.log_softmax(row, dim=-1).clamp_(min=LOGPROB_FLOOR)
    top: list[tuple[int, float]] = []
    if k:
        v, i = lp.topk(k)
        top = list(zip(i.tolist(), v.tolist()))
    return Logprob(tok, float(lp[tok]), top)


def prompt_logprobs(rows: torch.Tensor, targets: list[int], k: int) -> list[Logprob]:
    """The logprob of each ``targets[i]`` under ``rows[i]`` (the model's own distribution: no sampling parameter
    applies to a prompt, as in vLLM), with the ``k`` most likely tokens."""
    lp = torch.log_softmax(rows.float(), dim=-1).clamp_(min=LOGPROB_FLOOR)
    got = lp.gather(1, torch.tensor(targets, dtype=torch.int64).unsqueeze(1))
    ranks = ((lp > got).sum(dim=1) + 1).tolist()  # 1 + how many tokens were more likely
    got = got.squeeze(1).tolist()
    if not k:
        return [Logprob(t, g, rank=r) for t, g, r in zip(targets, got, ranks)]
    v, i = lp.topk(k, dim=-1)
    return [Logprob(t, g, list(zip(ii, vv)), r)
            for t, g, r, ii, vv in zip(targets, got, ranks, i.tolist(), v.tolist())]


def _draw(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    if p.top_k:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p * sorted_p.sum()  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen).item())
