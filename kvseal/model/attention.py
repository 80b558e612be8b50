"""Paged attention over the pool, for one packed (ragged) batch: single-token rows and prefill chunks.

A step's tokens are packed into one ``[N]`` row set (no padding): the first ``n_decode`` rows are requests
that feed one token (decode), each followed by nothing; the rest are prefill chunks (``Span``), each a run of
consecutive rows of one request. Linear layers run on all ``N`` rows at once; only attention is split:

- decode rows: one query per request against its pages, through ``decode_attention`` (plain PyTorch: gather
  the pages, grouped-query product) or the in-place kernel of ``kvseal.model.kernels`` when it is built;
- a prefill chunk, with the kernel (bf16, 16-slot pages, AVX-512 BF16): causal attention over its pages read
  in place (its own keys are already stored); in plain PyTorch: a chunk whose request has no earlier context
  is causal SDPA over its own fresh keys and values (nothing in the pool is read), a later chunk is SDPA over
  its pages gathered from the pool, masked so token ``t`` sees positions ``<= pos0+t``.

A layer with a sliding window, soft-capped scores or a scale other than ``head_dim ** -0.5`` (``LayerShape``:
Mistral, Qwen2's windowed layers, Gemma 2/3, Phi-3) takes ``shaped_attention`` instead, for decode rows and
prefill chunks alike: the same gathered pages, scores computed in fp32, capped, masked to the window
(a token at position ``p`` sees ``p - window + 1 .. p``) and to causality. Those models never reach the kernel
(``ModelConfig.plain``).

The pool is page-major, ``kv[page, layer, 0|1, kv_head, offset, head_dim]`` (``kvseal.kv.pool``): one
layer's keys for one head of one page are a contiguous ``[page_size, head_dim]`` row, so a gather is one
``index_select`` of rows straight into ``[B, KVH, P * page_size, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Span:
    """A prefill chunk: packed rows ``[start, start + n)``, positions ``pos0 ..``, its request's pages."""

    start: int
    n: int
    pos0: int
    pages: torch.Tensor  # [P] int64


@dataclass(frozen=True)
class LayerShape:
    """What one layer's attention computes beyond plain causal attention."""

    window: int = 0  # a token sees this many positions, itself included; 0 = all
    softcap: float = 0.0  # scores = softcap * tanh(scores / softcap); 0 = none
    scale: float = 0.0  # the scores' scale
    plain: bool = True  # none of the above: the SDPA / kernel paths apply


@dataclass
class DecodeRows:
    """The single-token rows ``[0, n)``: page tables ``[n, P]`` and context lengths (new token included)."""

    pages: torch.Tensor
    lens: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.pages.shape[0])


def gather_rows(kv: torch.Tensor, read_pages: torch.Tensor) -> torch.Tensor:
    """[B, KVH, P] ids of layer 0's key rows for each page table entry, in ``kv`` viewed as rows of
    ``[page_size, D]``; layer ``i``'s keys (``j=0``) or values (``j=1``) are ``(2 * i + j) * KVH`` further on."""
    n_layers, kvh = kv.shape[1], kv.shape[3]
    return read_pages[:, None, :] * (n_layers * 2 * kvh) + torch.arange(kvh, device=read_pages.device)[None, :, None]


def write_rows(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[N, KVH] ids of layer 0's key rows of flat pool ``slots`` in ``kv`` viewed as rows of ``[D]``; layer
    ``i``'s keys or values are ``(2 * i + j) * KVH * page_size`` further on."""
    n_layers, kvh, ps = kv.shape[1], kv.shape[3], kv.shape[4]
    page, offset = slots // ps, slots % ps
    return (page * (n_layers * 2 * kvh * ps) + offset)[:, None] + torch.arange(kvh, device=slots.device)[None, :] * ps


def gather_kv(kv: torch.Tensor, rows: torch.Tensor, layer: int, j: int) -> torch.Tensor:
    """Keys (``j=0``) or values (``j=1``) of ``layer`` for the pages in ``rows`` (``gather_rows``):
    ``[B, KVH, P * page_size, D]``."""
    bsz, kvh, n_pages = rows.shape
    ps, dim = kv.shape[4], kv.shape[5]
    picked = kv.view(-1, ps, dim).index_select(0, (rows + (2 * layer + j) * kvh).reshape(-1))
    return picked.view(bsz, kvh, n_pages * ps, dim)


def scatter_kv(kv: torch.Tensor, rows: torch.Tensor, layer: int, j: int, new: torch.Tensor) -> None:
    """Write ``new [N, KVH, D]`` to the slots behind ``rows`` (``write_rows``) as ``layer``'s keys or values."""
    step = (2 * layer + j) * kv.shape[3] * kv.shape[4]
    kv.view(-1, kv.shape[5]).index_copy_(0, (rows + step).reshape(-1), new.reshape(-1, kv.shape[5]))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, D]; keys/vals [B, KVH, L, D]; mask [B, L] (True = attend) → [B, H*D]. The reference."""
    bsz, heads, dim = q.shape
    kv_heads = keys.shape[1]
    qg = q.view(bsz, kv_heads, heads // kv_heads, dim)  # [B, KVH, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * dim**-0.5  # [B, KVH, G, L]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(q.dtype), vals)  # [B, KVH, G, D]
    return out.reshape(bsz, heads * dim)


def shaped_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, pos: torch.Tensor,
                     n_ctx: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    """q [B, T, H, D] at positions ``pos`` [B, T]; keys/vals [B, KVH, L, D] (slot ``j`` holds position ``j``),
    ``n_ctx`` [B] valid slots → [B, T, H*D]. Each query sees positions ``<= pos``, ``< n_ctx``, and within the
    layer's window; scores in fp32, soft-capped before the mask, as transformers' eager attention."""
    bsz, t, heads, dim = q.shape
    kvh, length = keys.shape[1], keys.shape[2]
    qg = q.permute(0, 2, 1, 3).reshape(bsz, kvh, heads // kvh * t, dim)  # [B, KVH, G*T, D]
    scores = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) * shape.scale  # [B, KVH, G*T, L]
    if shape.softcap:
        scores = torch.tanh(scores / shape.softcap) * shape.softcap
    j = torch.arange(length, device=pos.device)[None, None, :]
    p = pos[:, :, None]
    allowed = (j <= p) & (j < n_ctx[:, None, None])
    if shape.window:
        allowed &= j > p - shape.window
    allowed = allowed[:, None, None].expand(bsz, 1, heads // kvh, t, length).reshape(bsz, 1, -1, length)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).to(vals.dtype)
    out = torch.matmul(probs, vals)  # [B, KVH, G*T, D]
    return out.view(bsz, heads, t, dim).permute(0, 2, 1, 3).reshape(bsz, t, heads * dim)


class PagedAttention:
    """Attention for one forward pass: the per-step metadata is built once here and reused by every layer."""

    def __init__(self, kv: torch.Tensor, decode: DecodeRows | None, spans: list[Span], kernel: object = None,
                 shapes: list[LayerShape] | None = None) -> None:
        self.kv = kv
        self.decode = decode
        self.spans = spans
        self.shapes = shapes
        # kvseal.model.kernels.DecodeKernel, or None for the plain PyTorch path
        self.kernel = kernel if kernel is not None and kernel.fits(kv) else None
        if shapes is not None and not all(s.plain for s in shapes):
            self.kernel = None
        if decode is not None and self.kernel is None:
            n_ctx = decode.pages.shape[1] * kv.shape[4]
            self.d_rows = gather_rows(kv, decode.pages)
            self.d_mask = torch.arange(n_ctx, device=decode.lens.device)[None, :] < decode.lens[:, None]
        self.in_place: bool | None = None  # prefill chunks through the kernel; decided at the first layer
        self.s_rows: list = []
        self.s_mask: list = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, H, D], this step's k/v [N, KVH, D] (already in the pool) → [N, H*D]."""
        if self.shapes is not None and not self.shapes[layer].plain:
            return self._shaped(layer, q, self.shapes[layer])
        outs = []
        if self.decode is not None:
            outs.append(self._decode(layer, q[: self.decode.n]))
        if self.spans and self.in_place is None:
            self.in_place = self.kernel is not None and self.kernel.prefill_fits(q, self.kv)
            if not self.in_place:  # the gather rows and masks the plain path reuses in every layer
                self.s_rows = [gather_rows(self.kv, s.pages[None]) if s.pos0 else None for s in self.spans]
                self.s_mask = [_chunk_mask(s, self.kv.shape[4]) if s.pos0 else None for s in self.spans]
        if self.in_place:
            for s in self.spans:
                outs.append(self.kernel.prefill(q[s.start: s.start + s.n], self.kv, layer, s.pages, s.pos0))
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        for s, rows, mask in zip(self.spans, self.s_rows, self.s_mask):
            qs = q[s.start: s.start + s.n].transpose(0, 1)[None]  # [1, H, T, D]
            if rows is None:  # first chunk: its keys are exactly this step's
                ks, vs = k[s.start: s.start + s.n].transpose(0, 1)[None], v[s.start: s.start + s.n].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                ks, vs = gather_kv(self.kv, rows, layer, 0), gather_kv(self.kv, rows, layer, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(s.n, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _shaped(self, layer: int, q: torch.Tensor, shape: LayerShape) -> torch.Tensor:
        """Every row through ``shaped_attention``, reading the pool (this step's keys are already there)."""
        outs = []
        if self.decode is not None:
            d = self.decode
            keys, vals = gather_kv(self.kv, self.d_rows, layer, 0), gather_kv(self.kv, self.d_rows, layer, 1)
            outs.append(shaped_attention(q[: d.n, None], keys, vals, (d.lens - 1)[:, None], d.lens, shape)[:, 0])
        for s in self.spans:
            rows = gather_rows(self.kv, s.pages[None])
            keys, vals = gather_kv(self.kv, rows, layer, 0), gather_kv(self.kv, rows, layer, 1)
            pos = (s.pos0 + torch.arange(s.n, device=s.pages.device))[None]
            n_ctx = torch.tensor([s.pos0 + s.n], device=s.pages.device)
            outs.append(shaped_attention(q[s.start: s.start + s.n][None], keys, vals, pos, n_ctx, shape)[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(q, self.kv, layer, self.decode.pages, self.decode.lens)
        keys, vals = gather_kv(self.kv, self.d_rows, layer, 0), gather_kv(self.kv, self.d_rows, layer, 1)
        return decode_attention(q, keys, vals, self.d_mask)


def _chunk_mask(s: Span, page_size: int) -> torch.Tensor:
    """[1, 1, T, P * page_size]: token ``t`` of the chunk sees pool positions ``0 .. pos0 + t``."""
    n_ctx, dev = s.pages.shape[0] * page_size, s.pages.device
    pos = s.pos0 + torch.arange(s.n, device=dev)
    return (torch.arange(n_ctx, device=dev)[None, :] <= pos[:, None])[None, None]
