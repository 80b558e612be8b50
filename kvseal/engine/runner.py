"""Turns a list of sequences into one paged forward pass, after checking their page tables against the tags.

For each sequence the step feeds ``tokens[num_cached:]``; positions start at ``num_cached``; the context it
reads is every slot of positions ``0 .. num_cached + fed - 1`` through its page table. The tag check runs on
the whole batch's tables before the forward reads the pool: a sequence whose table does not match its tags
is dropped from the batch (returned in ``failed``) and never reaches attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvseal.engine.sequence import Sequence
from kvseal.kv.pool import PagePool
from kvseal.model.llama import ForwardBatch, LlamaModel


@dataclass
class StepResult:
    seqs: list[Sequence]  # sequences that ran, in logits order
    logits: torch.Tensor | None
    failed: list[Sequence]  # failed the tag check: never read the pool


class Runner:
    def __init__(self, model: LlamaModel, pool: PagePool, check_tags: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.check_tags = check_tags
        self.ps = pool.cfg.page_size

    def tag_check(self, seqs: list[Sequence]) -> list[bool]:
        n_pages = max(len(s.run.pages) for s in seqs)
        table = torch.zeros((len(seqs), n_pages), dtype=torch.int64)
        gens = torch.zeros_like(table)
        valid = torch.zeros((len(seqs), n_pages), dtype=torch.bool)
        for i, s in enumerate(seqs):
            n = len(s.run.pages)
            table[i, :n] = torch.tensor(s.run.pages)
            gens[i, :n] = torch.tensor(s.run.generations)
            valid[i, :n] = True
        owners = torch.tensor([s.rid for s in seqs], dtype=torch.int64)
        return self.pool.check_tables(table, gens, owners, valid).tolist()

    def step(self, seqs: list[Sequence]) -> StepResult:
        failed: list[Sequence] = []
        if self.check_tags:
            ok = self.tag_check(seqs)
            failed = [s for s, good in zip(seqs, ok) if not good]
            seqs = [s for s, good in zip(seqs, ok) if good]
        if not seqs:
            return StepResult([], None, failed)
        return StepResult(seqs, self.model.forward(self.pool.kv, self.build(seqs)), failed)

    def build(self, seqs: list[Sequence]) -> ForwardBatch:
        ps, max_pos = self.ps, self.model.cfg.max_context - 1
        fed = [s.tokens[s.num_cached:] for s in seqs]
        t = max(len(f) for f in fed)
        starts = torch.tensor([s.num_cached for s in seqs])
        lens = torch.tensor([len(f) for f in fed])
        ctx = starts + lens
        n_ctx = int(ctx.max())
        ids = torch.zeros((len(seqs), t), dtype=torch.int64)
        for i, f in enumerate(fed):
            ids[i, : len(f)] = torch.tensor(f)
        ar_t = torch.arange(t)
        positions = starts[:, None] + ar_t[None, :]
        n_pages = -(-n_ctx // ps)
        table = torch.zeros((len(seqs), n_pages), dtype=torch.int64)
        for i, s in enumerate(seqs):
            used = min(len(s.run.pages), n_pages)
            table[i, :used] = torch.tensor(s.run.pages[:used])
        real = ar_t[None, :] < lens[:, None]  # [B, T]
        write_index = real.reshape(-1).nonzero().squeeze(1)
        page_of = table.gather(1, (positions // ps).clamp(max=n_pages - 1))
        write_slots = (page_of * ps + positions % ps).reshape(-1)[write_index]
        ar_l = torch.arange(n_pages * ps)
        mask = (ar_l[None, None, :] <= positions[:, :, None]) & (ar_l[None, None, :] < ctx[:, None, None])
        return ForwardBatch(
            input_ids=ids, positions=positions.clamp(max=max_pos), write_index=write_index,
            write_slots=write_slots, read_pages=table, mask=mask.unsqueeze(1),
            logits_index=torch.arange(len(seqs)) * t + lens - 1)
