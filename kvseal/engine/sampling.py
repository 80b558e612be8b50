"""Sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

A batch where every request is greedy takes one ``argmax``; otherwise each sampled row draws from its own
``torch.Generator`` so a request with a seed reproduces regardless of what it was batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1, top_k >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] fp32 → one token id per row."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, gens[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen).item())
