"""Turns a step's ``(sequence, tokens to feed)`` pairs into one packed forward pass, after checking their page
tables against the tags.

A sequence feeds ``tokens[num_cached : num_cached + n]`` (a prefill chunk, or one token when decoding) at
positions ``num_cached ..``; it reads every slot of positions ``0 .. num_cached + n - 1`` through its page
table. The tag check runs on the whole batch's tables before the forward reads the pool: a sequence whose
table does not match its tags is dropped from the batch (returned in ``failed``) and never reaches attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvseal.engine.sequence import Sequence
from kvseal.kv.pool import PagePool
from kvseal.model.attention import DecodeRows, Span
from kvseal.model.llama import ForwardBatch, LlamaModel

NO_GROUP = -2  # never a page owner (-1 is FREE's)


@dataclass
class StepResult:
    seqs: list[Sequence]  # sequences that ran, in logits order
    fed: list[int]  # how many tokens each of them fed
    logits: torch.Tensor | None
    failed: list[Sequence]  # failed the tag check: never read the pool


class Runner:
    def __init__(self, model: LlamaModel, pool: PagePool, check_tags: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.check_tags = check_tags
        self.ps = pool.cfg.page_size

    def tag_check(self, seqs: list[Sequence]) -> list[bool]:
        lens = [len(s.run.pages) for s in seqs]
        n_pages = max(lens)
        table = torch.tensor([[*s.run.pages, *[0] * (n_pages - n)] for s, n in zip(seqs, lens)], dtype=torch.int64)
        gens = torch.tensor([[*s.run.generations, *[0] * (n_pages - n)] for s, n in zip(seqs, lens)],
                            dtype=torch.int64)
        valid = torch.arange(n_pages)[None, :] < torch.tensor(lens)[:, None]
        owners = torch.tensor([s.rid for s in seqs], dtype=torch.int64)
        groups = torch.tensor([NO_GROUP if s.group is None else s.group for s in seqs], dtype=torch.int64)
        spaces = torch.tensor([NO_GROUP if s.space is None else s.space for s in seqs], dtype=torch.int64)
        tenants = torch.tensor([s.tenant_tag for s in seqs], dtype=torch.int32)
        return self.pool.check_tables(table, gens, owners, valid, groups, spaces, tenants).tolist()

    def step(self, batch: list[tuple[Sequence, int]]) -> StepResult:
        """Run ``(sequence, tokens to feed)`` pairs as one forward; single-token rows go first."""
        batch = sorted(batch, key=lambda e: e[1] != 1)
        failed: list[Sequence] = []
        if self.check_tags:
            ok = self.tag_check([s for s, _ in batch])
            failed = [s for (s, _), good in zip(batch, ok) if not good]
            batch = [e for e, good in zip(batch, ok) if good]
        if not batch:
            return StepResult([], [], None, failed)
        logits = self.model.forward(self.pool.kv, self.build(batch))
        return StepResult([s for s, _ in batch], [n for _, n in batch], logits, failed)

    def build(self, batch: list[tuple[Sequence, int]]) -> ForwardBatch:
        """Pack the fed tokens (single-token rows first, as ``step`` orders them) with their positions, the
        slots their K/V go to, and each request's page table up to the pages its context covers."""
        ps = self.ps
        ids: list[int] = []
        pos: list[int] = []
        tables: list[tuple[int, ...]] = []
        for s, n in batch:
            ids += s.tokens[s.num_cached: s.num_cached + n]
            pos += range(s.num_cached, s.num_cached + n)
            tables.append(s.run.pages[: -(-(s.num_cached + n) // ps)])
        positions = torch.tensor(pos, dtype=torch.int64)
        widths = [len(t) for t in tables]
        flat = torch.tensor([p for t in tables for p in t], dtype=torch.int64)
        offsets = torch.tensor([0] + widths[:-1]).cumsum(0)
        row_seq = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor([n for _, n in batch]))
        write_slots = flat[offsets[row_seq] + positions // ps] * ps + positions % ps
        n_dec = sum(1 for _, n in batch if n == 1)
        decode = None
        if n_dec:
            width = max(widths[:n_dec])
            pages = torch.tensor([[*t, *[0] * (width - len(t))] for t in tables[:n_dec]], dtype=torch.int64)
            decode = DecodeRows(pages, positions[:n_dec] + 1)
        spans, start = [], n_dec
        for (s, n), t in zip(batch[n_dec:], tables[n_dec:]):
            spans.append(Span(start, n, s.num_cached, torch.tensor(t, dtype=torch.int64)))
            start += n
        ends = torch.tensor([n for _, n in batch]).cumsum(0) - 1
        return ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.int64),
                            positions=positions.clamp(max=self.model.cfg.max_context - 1),
                            write_slots=write_slots, logits_index=ends, decode=decode, spans=spans)
