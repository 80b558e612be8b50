"""Turns a step's ``(sequence, tokens to feed)`` pairs into one packed forward pass, after checking their page
tables against the tags.

A sequence feeds ``tokens[num_cached : num_cached + n]`` (a prefill chunk, or one token when decoding) at
positions ``num_cached ..``; it reads every slot of positions ``0 .. num_cached + n - 1`` through its page
table. The tag check runs on the whole batch's tables before the forward reads the pool: a sequence whose
table does not match its tags is dropped from the batch (returned in ``failed``) and never reaches attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvseal.engine.sequence import Sequence
from kvseal.kv.pool import PagePool
from kvseal.model.attention import DecodeRows, Span
from kvseal.model.llama import ForwardBatch, LlamaModel

NO_GROUP = -2  # never a page owner (-1 is FREE's)


@dataclass
class StepResult:
    seqs: list[Sequence]  # sequences that ran, in batch order
    fed: list[int]  # how many tokens each of them fed
    logits: torch.Tensor | None
    failed: list[Sequence]  # failed the tag check: never read the pool
    rows: list[range] | None = None  # each sequence's logits rows, if not one each (prompt logprobs asked for)


def wants_prompt_logprobs(s: Sequence) -> bool:
    """Does this chunk of ``s`` need the logits of every position it feeds: its prompt's logprobs were asked
    for, are not yet all computed, and were never reported (a request recomputing its prompt after a preemption,
    or decoding after a transfer, has reported them already)."""
    return s.params.prompt_logprobs is not None and s.num_output == 0 and len(s.prompt_lps) < len(s.prompt) - 1


class Runner:
    def __init__(self, model: LlamaModel, pool: PagePool, check_tags: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.check_tags = check_tags
        self.ps = pool.cfg.page_size

    def tag_check(self, seqs: list[Sequence]) -> list[bool]:
        lens = [len(s.run.pages) for s in seqs]
        table = np.zeros((len(seqs), max(lens)), dtype=np.int64)  # padding: page 0, never read (``valid``)
        gens = np.zeros_like(table)
        for i, s in enumerate(seqs):
            table[i, : lens[i]] = s.run.pages
            gens[i, : lens[i]] = s.run.generations
        valid = np.arange(table.shape[1])[None, :] < np.array(lens)[:, None]
        owners = np.array([s.rid for s in seqs], dtype=np.int64)
        groups = np.array([NO_GROUP if s.group is None else s.group for s in seqs], dtype=np.int64)
        spaces = np.array([NO_GROUP if s.space is None else s.space for s in seqs], dtype=np.int64)
        tenants = np.array([s.tenant_tag for s in seqs], dtype=np.int32)
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
        fb = self.build(batch)
        logits = self.model.forward(self.pool.kv, fb)
        return StepResult([s for s, _ in batch], [n for _, n in batch], logits, failed, fb.rows)

    def build(self, batch: list[tuple[Sequence, int]]) -> ForwardBatch:
        """Pack the fed tokens (single-token rows first, as ``step`` orders them) with their positions, the
        slots their K/V go to, and each request's page table up to the pages its context covers. Index
        arithmetic in NumPy, handed to PyTorch without a copy: PyTorch's per-op overhead made it 0.2 ms of
        every step. A prefill chunk whose prompt logprobs were asked for wants the logits of every row it
        feeds (``ForwardBatch.rows``), the others only their last."""
        ps = self.ps
        fed = np.array([n for _, n in batch], dtype=np.int64)
        cached = np.array([s.num_cached for s, _ in batch], dtype=np.int64)
        ids: list[int] = []
        tables: list[tuple[int, ...]] = []
        for s, n in batch:
            ids += s.tokens[s.num_cached: s.num_cached + n]
            tables.append(s.run.pages[: -(-(s.num_cached + n) // ps)])
        row_seq = np.repeat(np.arange(len(batch)), fed)
        starts = np.cumsum(fed) - fed  # each request's first packed row
        positions = cached[row_seq] + np.arange(len(ids)) - starts[row_seq]
        widths = np.array([len(t) for t in tables], dtype=np.int64)
        flat = np.fromiter((p for t in tables for p in t), dtype=np.int64, count=int(widths.sum()))
        offsets = np.cumsum(widths) - widths
        write_slots = flat[offsets[row_seq] + positions // ps] * ps + positions % ps
        n_dec = int((fed == 1).sum())
        dev = self.model.device
        on = torch.from_numpy if dev.type == "cpu" else (lambda a: torch.from_numpy(a).to(dev))
        decode = None
        if n_dec:
            pages = np.zeros((n_dec, int(widths[:n_dec].max())), dtype=np.int64)
            for i, t in enumerate(tables[:n_dec]):
                pages[i, : len(t)] = t
            decode = DecodeRows(on(pages), on(positions[:n_dec] + 1))
        spans = [Span(int(start), n, s.num_cached, on(np.array(t, dtype=np.int64)))
                 for (s, n), t, start in zip(batch[n_dec:], tables[n_dec:], starts[n_dec:])]
        last = starts + fed - 1
        rows = None
        if any(wants_prompt_logprobs(s) for s, _ in batch):
            ranges = [range(a, a + n) if wants_prompt_logprobs(s) else range(a + n - 1, a + n)
                      for (s, n), a in zip(batch, starts.tolist())]
            last = np.fromiter((i for r in ranges for i in r), dtype=np.int64)
            ends = np.cumsum([len(r) for r in ranges])
            rows = [range(e - len(r), e) for r, e in zip(ranges, ends.tolist())]
        return ForwardBatch(input_ids=on(np.array(ids, dtype=np.int64)),
                            positions=on(positions.clip(max=self.model.cfg.max_context - 1)),
                            write_slots=on(write_slots),
                            logits_index=on(last), decode=decode, spans=spans, rows=rows)
