"""Sampling: logits processors, then greedy or seeded random draws, with logprobs on request.

A batch where every request is plain greedy takes one ``argmax``. The rows that ask for more are copied out
together and processed in vLLM's order (``logit_bias`` and the penalties on all such rows at once, each element
computed as for its row alone; a grammar or a ``min_tokens`` ban row by row):

1. ``logit_bias`` added to its tokens (OpenAI: -100..100, applied to the raw logits);
2. ``min_tokens``: EOS and ``stop_token_ids`` banned until that many tokens were generated, unless a grammar
   has ended (it allows nothing else): the grammar's end ends the request;
3. ``repetition_penalty`` r over prompt and output tokens: a positive logit is divided by r, a negative one
   multiplied (CTRL, as vLLM and Hugging Face do);
4. ``frequency_penalty`` f and ``presence_penalty`` p over output tokens: ``logit -= f * count + p * (count > 0)``
   (OpenAI's formula);
5. a grammar (``response_format``) masks every token it cannot accept;
6. ``temperature``, then ``top_k``, ``min_p`` and ``top_p`` truncate, and the row draws with one uniform number
   from its own ``torch.Generator`` (the inverse of its cumulative distribution), so a seeded request reproduces
   whatever it was batched with. Truncation and the draw run on all drawn rows at once, over each row's most
   likely tokens where what it keeps lies among them (``candidates``), else over the whole vocabulary.

Logprobs are the log-softmax of the row after steps 1–5 and temperature (the distribution the token is drawn
from, before truncation; at temperature 0, or below 1e-5 as in vLLM, of the processed logits): the chosen
token's and the top ``k``.
"""

from __future__ import annotations

from array import array
from itertools import chain
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

    The rows that are not plain greedy are copied out once and drawn together (truncation and the draw are batch
    operations, each row still on its own generator): one at a time, a draw cost ~1.3 ms and a top-p sort ~3 ms
    a row, three times a 32-row decode step. A row whose processing fails gives its exception instead, for the
    engine to fail that request alone: one request's parameters must never fail the step of every request
    batched with it."""
    res: list[tuple[int, Logprob | None] | Exception | None] = [None] * len(rows)
    rest = [i for i, r in enumerate(rows) if not r.params.plain]
    if len(rest) < len(rows):
        for i, tok in enumerate(logits.argmax(dim=-1).tolist()):
            if rows[i].params.plain:
                res[i] = (tok, None)
    if not rest:
        return res
    # one float copy of the other rows, processed in place (a GPU's rows: on the host, for now)
    x = _rows(logits, rest).float().cpu()
    if x.data_ptr() == logits.data_ptr():
        x = x.clone()
    live, processed = [], []
    together = [j for j, i in enumerate(rest) if penalized_only(rows[i])]
    if not penalize(x, together, [rows[rest[j]] for j in together]):
        together = []  # a token id outside the vocabulary: each row on its own, where it fails alone
    done = set(together)
    for j, i in enumerate(rest):
        r = rows[i]
        try:
            if r.params.processed:
                row = x[j]
                if j not in done and (got := process(row, r)) is not row:
                    row.copy_(got)
                processed.append(j)
            live.append(j)
        except Exception as e:  # noqa: BLE001 - this row's failure, not the batch's
            res[i] = e
    if processed:  # a row left no finite logit: a draw would fail, an argmax would give token 0: no answer
        peaks = torch.isfinite(_rows(x, processed).amax(dim=-1)).tolist()  # a finite maximum: finite (cheap)
        for j, fine in zip(processed, peaks):
            if not (fine or torch.isfinite(x[j]).any()):  # else -inf throughout, or a NaN or +inf: looked at
                res[rest[j]] = EngineError("the request's constraints leave no token to sample")
                live.remove(j)
    temps = [t if (t := rows[i].params.temperature) >= GREEDY_BELOW else 1.0 for i in rest]
    if any(t != 1.0 for t in temps):
        x.div_(torch.tensor(temps)[:, None])
    toks: list[int | Exception] = [0] * len(rest)
    greedy = [j for j in live if rows[rest[j]].params.greedy]
    if greedy:  # dividing by a temperature keeps the order
        for j, tok in zip(greedy, _rows(x, greedy).argmax(dim=-1).tolist()):
            toks[j] = tok
    drawn = [j for j in live if not rows[rest[j]].params.greedy]
    if drawn:
        keep = any(rows[rest[j]].params.logprobs is not None for j in drawn)  # their logprobs: before truncation
        xs = x.clone() if keep and len(drawn) == len(rest) else _rows(x, drawn)
        for j, tok in zip(drawn, draw(xs, [rows[rest[j]] for j in drawn])):
            toks[j] = tok
    scored = []
    for j in live:
        i, r, tok = rest[j], rows[rest[j]], toks[j]
        try:
            if isinstance(tok, Exception):
                raise tok
            if r.matcher is not None:
                r.matcher.consume_token(tok)
            res[i] = (tok, None)
            if r.params.logprobs is not None:
                scored.append(j)
        except Exception as e:  # noqa: BLE001
            res[i] = e
    if scored:
        for j, lp in zip(scored, logprobs(_rows(x, scored), [toks[j] for j in scored],
                                          [rows[rest[j]].params.logprobs for j in scored])):
            res[rest[j]] = (toks[j], lp)
    return res


def _rows(x: torch.Tensor, js: list[int]) -> torch.Tensor:
    """``x[js]`` (a copy), or ``x`` itself when ``js`` is every row in order. (Indexing [32, V] by a list
    costs ~0.9 ms here, ``index_select`` ~0.3.)"""
    return x if js == list(range(len(x))) else x.index_select(0, torch.tensor(js, dtype=torch.int64))


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


def penalized_only(r: Row) -> bool:
    """Does only ``logit_bias`` or a penalty change this row now (steps 1, 3 and 4: no grammar, no ban)?"""
    p = r.params
    return (r.matcher is None and r.num_output >= p.min_tokens
            and bool(p.logit_bias or p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty))


def penalize(x: torch.Tensor, js: list[int], rows: list[Row]) -> bool:
    """Steps 1, 3 and 4 for rows ``js`` of ``x`` [B, V] at once, in place: each element as ``process`` computes
    it (the same operations in the same dtype), touching only the tokens a bias or penalty names. One row at a
    time these cost ~0.5 ms a row (a 49,152-token ``bincount``, a ``unique``, a dozen small ops), a sixth of a
    32-row decode step on two cores. False, with ``x`` untouched, if a token id lies outside the vocabulary."""
    if not js:
        return True
    if not x.is_contiguous():
        return False
    vocab = x.shape[1]
    flat = x.view(-1)

    def spots(sel: list[tuple[int, Row]], tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected rows' tokens, one tensor, and the row of each (an int64 array fills from Python ints
        ~30x faster than ``torch.tensor`` reads a list)."""
        lists = [tokens(r) for _, r in sel]
        ids = array("q", chain.from_iterable(lists))
        if not ids:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
        at = torch.tensor([j for j, _ in sel]).repeat_interleave(torch.tensor([len(ts) for ts in lists]))
        return torch.frombuffer(ids, dtype=torch.int64), at

    pairs = list(zip(js, rows))
    bias = [(j, r) for j, r in pairs if r.params.logit_bias]
    rep = [(j, r) for j, r in pairs if r.params.repetition_penalty != 1]
    freq = [(j, r) for j, r in pairs if r.params.presence_penalty or r.params.frequency_penalty]
    b_ids, b_at = spots(bias, lambda r: [t for t, _ in r.params.logit_bias])
    r_ids, r_at = spots(rep, lambda r: r.tokens)
    f_ids, f_at = spots(freq, lambda r: r.tokens[len(r.prompt):])
    for ids in (b_ids, r_ids, f_ids):
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            return False
    # 1. logit_bias: each named token's logit plus its bias (the ids of one row are distinct: a dict's keys)
    if bias:
        values = torch.tensor([b for _, r in bias for _, b in r.params.logit_bias], dtype=x.dtype)
        flat.index_add_(0, b_at * vocab + b_ids, values)
    # 3. repetition_penalty over prompt and output: once per distinct token of a row
    if rep:
        penalty = torch.zeros(len(x), dtype=x.dtype)
        penalty[torch.tensor([j for j, _ in rep])] = torch.tensor([r.params.repetition_penalty for _, r in rep],
                                                                   dtype=x.dtype)
        where = torch.unique(r_at * vocab + r_ids)
        v, by = flat[where], penalty[where // vocab]
        flat[where] = torch.where(v > 0, v / by, v * by)
    # 4. frequency and presence over output tokens: logit -= f * count + p, where count > 0 (elsewhere process
    # subtracts f * 0 + p * 0, which changes nothing)
    if freq:
        f = torch.zeros(len(x), dtype=x.dtype)
        p = torch.zeros(len(x), dtype=x.dtype)
        sel = torch.tensor([j for j, _ in freq])
        f[sel] = torch.tensor([r.params.frequency_penalty for _, r in freq], dtype=x.dtype)
        p[sel] = torch.tensor([r.params.presence_penalty for _, r in freq], dtype=x.dtype)
        where, counts = torch.unique(f_at * vocab + f_ids, return_counts=True)
        at = where // vocab
        counts = counts.to(x.dtype)
        flat[where] -= f[at] * counts + p[at] * (counts > 0).to(x.dtype)
    return True


# The floor of a reported logprob, as OpenAI and vLLM report it: a token a grammar, min_tokens or a -inf bias
# rules out has logprob -inf, which JSON cannot carry (Python writes "-Infinity", msgspec writes null).
LOGPROB_FLOOR = -9999.0


def logprob(row: torch.Tensor, tok: int, k: int) -> Logprob:
    return logprobs(row[None], [tok], [k])[0]


def logprobs(x: torch.Tensor, toks: list[int], ks: list[int]) -> list[Logprob]:
    """Row i's ``toks[i]`` under the log-softmax of ``x[i]``, with its ``ks[i]`` most likely tokens: all rows
    at once (one at a time, ~0.25 ms a row at 49,152 tokens)."""
    lp = torch.log_softmax(x, dim=-1).clamp_(min=LOGPROB_FLOOR)
    got = lp.gather(1, torch.tensor(toks, dtype=torch.int64)[:, None]).squeeze(1).tolist()
    top_v, top_i = ([], []) if not max(ks) else (t.tolist() for t in lp.topk(max(ks), dim=-1))
    return [Logprob(t, g, list(zip(top_i[n][:k], top_v[n][:k])) if k else [])
            for n, (t, g, k) in enumerate(zip(toks, got, ks))]


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


# Rows that truncate (top_k, top_p) are drawn from each row's 256 most likely tokens (or its top_k, if more)
# whenever what they keep lies among them, which ``candidates`` checks row by row, else from its 4,096; any
# other row is drawn over the whole vocabulary by ``truncated``, the plain form of the same rules and the
# reference the tests hold the short path to. At the temperatures clients send, a language model's top 256
# hold its top-p nucleus (SmolLM2 at temperature 0.7: every row of 1,280 for top_p 0.9; at temperature 1 for
# top_p 0.95, 89%, and 98% within its top 1,024). A top-k of a row costs ~85 us (any k), a sort ~1.4 ms.
CANDIDATES = (256, 4096)


def draw(x: torch.Tensor, rows: list[Row]) -> list[int | Exception]:
    """One token per row of ``x`` [n, V] (processed logits over temperature), drawn from what ``top_k``,
    ``min_p`` and ``top_p`` leave of its softmax, with one uniform number from the row's own generator: the
    same draw whatever the row is batched with. ``x`` may be changed."""
    n, vocab = x.shape
    u = torch.cat([torch.rand(1, generator=r.generator) for r in rows])
    out: list[int | Exception] = [0] * n
    short = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
    whole = [i for i, r in enumerate(rows) if not (0 < r.params.top_k < vocab or r.params.top_p < 1.0)]
    for c in CANDIDATES:
        if not short:
            break
        order, w, ok = candidates(_rows(x, short), [rows[i] for i in short], c)
        held = [j for j, good in enumerate(ok.tolist()) if good]
        for j, idx in zip(held, pick(w[held], u[[short[j] for j in held]])):
            out[short[j]] = idx if isinstance(idx, Exception) else int(order[j, idx])
        short = [short[j] for j in range(len(short)) if j not in set(held)]
    whole += short
    if whole:
        whole.sort()
        w = truncated(_rows(x, whole), [rows[i] for i in whole])
        for i, idx in zip(whole, pick(w, u[whole])):
            out[i] = idx
    return out


def truncated(x: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The probabilities [n, V] each row draws from, over the whole vocabulary, 0 for what ``top_k``, ``min_p``
    and ``top_p`` leave out (in vLLM's order; a kept row sums to 1 before min_p and top_p cut it)."""
    n, vocab = x.shape
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
    if any(ks):
        sel = [i for i, k in enumerate(ks) if k]
        xs = x[sel]
        kth = xs.topk(max(ks)).values.gather(1, torch.tensor([[ks[i] - 1] for i in sel]))
        x[sel] = xs.masked_fill_(xs < kth, float("-inf"))  # ties with the k-th stay
    probs = torch.softmax(x, dim=-1)
    min_p = torch.tensor([[r.params.min_p] for r in rows])
    if min_p.any():
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    nucleus = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
    if nucleus:
        p = probs[nucleus]
        top, order = p.sort(dim=-1, descending=True)
        limit = torch.tensor([[rows[i].params.top_p] for i in nucleus]) * top.sum(dim=-1, keepdim=True)
        keep = top.cumsum(dim=-1) - top < limit  # the smallest prefix holding top_p (the first token always)
        probs[nucleus] = torch.zeros_like(p).scatter_(1, order, top * keep)
    return probs


def candidates(x: torch.Tensor, rows: list[Row], c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``truncated`` on each row's most likely tokens: ``(order, weights, ok)``, ``weights[i, j]`` the
    probability of token ``order[i, j]``, for the rows where ``ok`` says that nothing kept lies further down
    (the k-th token's ties, what min_p keeps and the top-p nucleus all end among the candidates)."""
    m, vocab = x.shape
    ks = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows])
    c = min(vocab, max(c, int(ks.max())))
    vals, order = x.topk(c, dim=-1)  # sorted, most likely first
    has_k = ks > 0
    kth = vals.gather(1, (ks.clamp(min=1) - 1)[:, None])
    e = torch.exp(vals - vals[:, :1]) * (~has_k[:, None] | (vals >= kth))
    ok = ~has_k | (vals[:, -1] < kth[:, 0]) | (c == vocab)
    p = e / e.sum(dim=-1, keepdim=True)
    free = (~has_k).nonzero().flatten().tolist()
    if free:  # no top_k: the softmax runs over the whole vocabulary (its own kernel: ~10x exp(x - max).sum())
        p[free] = torch.softmax(_rows(x, free), dim=-1).gather(1, order[free])
    min_p = torch.tensor([r.params.min_p for r in rows])
    cut = min_p[:, None] * p[:, :1]
    ok &= has_k | (min_p == 0) | (p[:, -1] < cut[:, 0]) | (c == vocab)
    p = p * (p >= cut)
    top_p = torch.tensor([r.params.top_p for r in rows])
    total = torch.where(has_k | (min_p > 0), p.sum(dim=-1), 1.0)
    limit = top_p * total
    cum = p.cumsum(dim=-1)
    ok &= (top_p >= 1.0) | (cum[:, -1] >= limit)
    keep = (cum - p < limit[:, None]) | (top_p >= 1.0)[:, None]
    return order, p * keep, ok


def pick(weights: torch.Tensor, u: torch.Tensor) -> list[int | Exception]:
    """Per row of ``weights`` [n, m] (≥ 0), the index whose share of the row's cumulative sum holds ``u`` [n]
    (uniform on [0, 1)): index i with probability weights[i] / sum, never a zero-weight index."""
    c = weights.cumsum(dim=-1)
    total = c[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # strictly below the end
    idx = torch.searchsorted(c, target[:, None], right=True).squeeze(1).tolist()
    ok = (torch.isfinite(total) & (total > 0)).tolist()
    return [i if good else EngineError("the request's constraints leave no token to sample")
            for i, good in zip(idx, ok)]
