"""Paged attention in Triton: decode rows and prefill chunks read the pool in place, for a GPU.

The first piece of kvseal on a GPU (``docs/gpu.md``). It has the interface of the CPU kernel that
``PagedAttention`` takes (``kvseal.model.kernels.DecodeKernel``): ``fits``, ``prefill_fits``, a call for decode
rows, ``prefill`` for a chunk. One program handles one query token and one KV head (its ``G`` query heads): it
walks the row's page table, loads each page's keys and values of this layer straight from the pool
``kv[page, layer, 0|1, kv_head, offset, head_dim]`` and keeps an online softmax in fp32. Slots at or past the
row's length are masked out, so a page's stale tail is never read into the result. A prefill chunk is the same
program once per token, with the chunk's one page table and a length of ``pos0 + t + 1`` (causal).

Held equal to the plain-PyTorch reference (``attention.decode_attention``, SDPA over gathered pages) on the CPU
through Triton's interpreter (``TRITON_INTERPRET=1``, tests/test_gpu.py), so CI checks them without a GPU.
Nothing routes a step here yet: kvseal has no option that puts a model on a GPU.
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


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonAttention:
    """Paged attention for ``PagedAttention``'s kernel slot, on a CUDA pool (or any pool, interpreted)."""

    name = "triton"

    def fits(self, kv: torch.Tensor) -> bool:
        """Pages and heads the program can tile (powers of two), on a device Triton runs on."""
        on_device = kv.is_cuda or INTERPRETED
        return on_device and kv.is_contiguous() and _pow2(kv.shape[4]) and _pow2(kv.shape[5])

    def prefill_fits(self, q: torch.Tensor, kv: torch.Tensor) -> bool:
        return self.fits(kv) and q.dtype == kv.dtype

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, layer: int, pages: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
        """Decode rows: q [B, H, D], page tables [B, P], lengths [B] (the new token included) → [B, H*D]."""
        return self._run(q, kv, layer, pages.contiguous(), pages.shape[1], lens)

    def prefill(self, q: torch.Tensor, kv: torch.Tensor, layer: int, pages: torch.Tensor,
                pos0: int) -> torch.Tensor:
        """A chunk's T tokens at positions ``pos0 ..`` (their keys already in the pool): q [T, H, D] → [T, H*D]."""
        lens = torch.arange(pos0 + 1, pos0 + q.shape[0] + 1, device=q.device, dtype=torch.int32)
        return self._run(q, kv, layer, pages.contiguous(), 0, lens)

    @staticmethod
    def _run(q: torch.Tensor, kv: torch.Tensor, layer: int, pages: torch.Tensor, page_stride: int,
             lens: torch.Tensor) -> torch.Tensor:
        rows, heads, dim = q.shape
        n_layers, kvh, ps = kv.shape[1], kv.shape[3], kv.shape[4]
        group = heads // kvh
        q = q.contiguous()
        out = torch.empty(rows, heads * dim, dtype=q.dtype, device=q.device)
        _paged_rows[(rows, kvh)](q, kv, pages, lens.to(torch.int32).contiguous(), out, layer, n_layers, page_stride,
                                 dim**-0.5, KVH=kvh, G=group, GP=triton.next_power_of_2(group), D=dim, PS=ps)
        return out
