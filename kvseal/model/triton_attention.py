"""Paged attention in Triton: decode rows and prefill chunks read the pool in place, for a GPU.

It has the interface of the CPU kernel that ``PagedAttention`` takes (``kvseal.model.kernels.DecodeKernel``):
``fits``, ``prefill_fits``, a call for decode rows, ``prefill`` for a chunk. Both read each page's keys and values
of one layer straight from the pool ``kv[page, layer, 0|1, kv_head, offset, head_dim]`` and keep an online
softmax in fp32; slots a row may not see are never loaded (a page's stale tail never reaches a result).

- ``_paged_rows`` (decode): one program per row and KV head, for that head's ``G`` query heads; it walks the
  row's own pages, up to its length.
- ``_prefill_block`` (a chunk): one program per block of query tokens and KV head, so each page is loaded once
  per block and both products are matrix products; causal by position.

Held equal to the plain-PyTorch reference (``attention.decode_attention``, SDPA over gathered pages) on the CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, tests/test_gpu.py), so CI checks them without a GPU. Used
by ``--device cuda`` (``LlamaModel.to_device``), which no GPU has run yet (docs/gpu.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# the kernels below are built for Triton's interpreter when this is set as this module loads (triton.jit
# decides then): they then run on CPU tensors too
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _paged_rows(q_ptr, kv_ptr, pages_ptr, lens_ptr, out_ptr, layer, n_layers, page_stride, scale,
                KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + row)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    o = tl.arange(0, PS)
    heads = row * (KVH * G) + h * G + g
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=g[:, None] < G, other=0.0).to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for p in range(tl.cdiv(n, PS)):  # this row's pages only; slots at or past n are neither loaded nor weighted
        live = (p * PS + o) < n  # [PS]
        page = tl.load(pages_ptr + row * page_stride + p).to(tl.int64)
        k_base = ((page * n_layers + layer) * 2 * KVH + h) * (PS * D)
        v_base = k_base + KVH * PS * D
        k = tl.load(kv_ptr + k_base + o[:, None] * D + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, PS]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite from the first page on: every row has a slot there
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        v = tl.load(kv_ptr + v_base + o[:, None] * D + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)


@triton.jit
def _prefill_block(q_ptr, kv_ptr, pages_ptr, out_ptr, layer, n_layers, pos0, n_tokens, scale,
                   KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, D: tl.constexpr,
                   PS: tl.constexpr, IEEE: tl.constexpr):
    """``BQ`` query tokens of one chunk x the ``G`` query heads of KV head ``h``: ``BQ * GP`` rows that share
    every page's keys and values, so each page is loaded once per block, and both products are matrix products
    (``tl.dot``: tensor cores on a GPU). Row ``r`` is token ``r // GP``, head ``r % GP``; causal by position."""
    blk = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BQ * GP)
    t = blk * BQ + r // GP  # the row's token within the chunk
    g = r % GP
    live_row = (t < n_tokens) & (g < G)
    pos = pos0 + t  # the row's position: it sees slots 0 .. pos
    d = tl.arange(0, D)
    o = tl.arange(0, PS)
    heads = t * (KVH * G) + h * G + g
    # fp32 operands: Triton 3.6's interpreter multiplies bf16 operands of tl.dot as raw bits; on a GPU the
    # products then run as TF32 (bf16 models) or IEEE fp32 (fp32 models)
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=live_row[:, None], other=0.0).to(tl.float32)
    m_i = tl.full([BQ * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ * GP], tl.float32)
    acc = tl.zeros([BQ * GP, D], tl.float32)
    last = tl.minimum(pos0 + (blk + 1) * BQ, pos0 + n_tokens)  # slots the block's last token sees, + 1
    for p in range(tl.cdiv(last, PS)):
        slot = p * PS + o
        page = tl.load(pages_ptr + p).to(tl.int64)
        k_base = ((page * n_layers + layer) * 2 * KVH + h) * (PS * D)
        v_base = k_base + KVH * PS * D
        seen = (slot < last)[:, None]
        k = tl.load(kv_ptr + k_base + o[:, None] * D + d[None, :], mask=seen, other=0.0).to(tl.float32)
        v = tl.load(kv_ptr + v_base + o[:, None] * D + d[None, :], mask=seen, other=0.0).to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(slot[None, :] <= pos[:, None], s * scale, float("-inf"))  # [rows, PS]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite from the first page on: slot 0 is seen by every row
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(w, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(w, v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live_row[:, None])


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonAttention:
    """Paged attention for ``PagedAttention``'s kernel slot, on a CUDA pool (or any pool, interpreted)."""

    def fits(self, kv: torch.Tensor) -> bool:
        """Pages and heads the program can tile (powers of two), on a device Triton runs on."""
        on_device = kv.is_cuda or INTERPRETED
        return on_device and kv.is_contiguous() and _pow2(kv.shape[4]) and _pow2(kv.shape[5])

    def prefill_fits(self, q: torch.Tensor, kv: torch.Tensor) -> bool:
        return self.fits(kv) and q.dtype == kv.dtype

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, layer: int, pages: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
        """Decode rows: q [B, H, D], page tables [B, P], lengths [B] (the new token included) → [B, H*D]."""
        rows, heads, dim = q.shape
        n_layers, kvh, ps = kv.shape[1], kv.shape[3], kv.shape[4]
        group = heads // kvh
        out = torch.empty(rows, heads * dim, dtype=q.dtype, device=q.device)
        _paged_rows[(rows, kvh)](q.contiguous(), kv, pages.contiguous(), lens.to(torch.int32).contiguous(), out, layer,
                                 n_layers, pages.shape[1], dim**-0.5, KVH=kvh, G=group,
                                 GP=triton.next_power_of_2(group), D=dim, PS=ps)
        return out

    def prefill(self, q: torch.Tensor, kv: torch.Tensor, layer: int, pages: torch.Tensor,
                pos0: int) -> torch.Tensor:
        """A chunk's T tokens at positions ``pos0 ..`` (their keys already in the pool): q [T, H, D] → [T, H*D],
        in blocks of ``BQ`` tokens (``_prefill_block``)."""
        n, heads, dim = q.shape
        n_layers, kvh, ps = kv.shape[1], kv.shape[3], kv.shape[4]
        group = heads // kvh
        gp = triton.next_power_of_2(group)
        bq = max(64 // gp, 1)  # 64 rows a block (tl.dot wants 16 at least)
        out = torch.empty(n, heads * dim, dtype=q.dtype, device=q.device)
        _prefill_block[(triton.cdiv(n, bq), kvh)](q.contiguous(), kv, pages.contiguous(), out, layer, n_layers, pos0, n,
                                                  dim**-0.5, KVH=kvh, G=group, GP=gp, BQ=bq, D=dim, PS=ps,
                                                  IEEE=q.dtype == torch.float32)
        return out
