"""Llama-family decoder (GQA, RoPE, RMSNorm, SwiGLU, tied embeddings) whose attention reads the paged pool.

One forward serves prefill and decode alike: queries are a padded ``[B, T]`` batch, keys and values are
gathered from the pool page by page through each request's page table ``read_pages [B, P]``, and
``mask [B, 1, T, P * page_size]`` hides padding, unwritten slots and the future. New K/V are scattered into
the pool *before* the gather, so a token attends to itself. This plain-PyTorch path is the reference; it is
also the fast path.

The pool is page-major, ``kv[page, layer, 0|1, kv_head, offset, head_dim]`` (see ``kvseal.kv.pool``): one
layer's keys for one head of one page are a contiguous row of ``page_size * head_dim``, so the gather is one
``index_select`` of such rows straight into ``[B, KVH, P * page_size, D]``, the layout attention multiplies.

Numerics mirror Hugging Face's Llama (RMSNorm in fp32, RoPE tables in fp32 cast to the activation dtype) so
greedy tokens match transformers in the same dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvseal.config import ModelConfig


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(H + 2*KVH) * D, hidden]: q, k, v fused into one matmul
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 * inter, hidden]: gate and up fused
    w_down: torch.Tensor


@dataclass
class Weights:
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding itself when tied


@dataclass
class ForwardBatch:
    """Everything one forward pass needs; built by the runner from page tables."""

    input_ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    write_index: torch.Tensor  # [N] indices into the flattened [B*T] of real (non-pad) tokens
    write_slots: torch.Tensor  # [N] flat pool slots (page * page_size + offset) those tokens' K/V go to
    read_pages: torch.Tensor  # [B, P] each request's page table (pad = any page; masked out)
    mask: torch.Tensor  # [B, 1, T, P * page_size] bool, True = attend
    logits_index: torch.Tensor  # [B] index into [B*T] of the token whose next-token logits we want


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and a *signed* sin: ``rotate_half(x) * sin == roll(x, D/2) * cat(-sin, sin)``, one op fewer."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(cfg.max_context, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    half = cfg.head_dim // 2
    return emb.cos().to(dtype), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``, bit for bit (negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def gather_rows(kv: torch.Tensor, read_pages: torch.Tensor) -> torch.Tensor:
    """[B, KVH, P] ids of layer 0's key rows for each page table entry, in ``kv`` viewed as rows of
    ``[page_size, D]``; layer ``i``'s keys (``j=0``) or values (``j=1``) are ``(2 * i + j) * KVH`` further on."""
    n_layers, kvh = kv.shape[1], kv.shape[3]
    return read_pages[:, None, :] * (n_layers * 2 * kvh) + torch.arange(kvh)[None, :, None]


def write_rows(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[N, KVH] ids of layer 0's key rows of flat pool ``slots`` in ``kv`` viewed as rows of ``[D]``; layer
    ``i``'s keys or values are ``(2 * i + j) * KVH * page_size`` further on."""
    n_layers, kvh, ps = kv.shape[1], kv.shape[3], kv.shape[4]
    page, offset = slots // ps, slots % ps
    return (page * (n_layers * 2 * kvh * ps) + offset)[:, None] + torch.arange(kvh)[None, :] * ps


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


def paged_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D]; keys/vals [B, KVH, L, D] gathered from the pool by page; mask [B, 1, T, L] → [B, T, H*D].

    Prefill (T > 1) uses PyTorch's SDPA (flash kernel on CPU: no L×L matrix in memory). Decode (T == 1) uses
    an explicit grouped-query product over the gathered pages, several times faster than SDPA with a mask on
    CPU; a test holds it equal to SDPA.
    """
    bsz, t, heads, dim = q.shape
    if t > 1:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(bsz, t, heads * dim)
    return decode_attention(q, keys, vals, mask)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    bsz, _, heads, dim = q.shape
    kv_heads, n_ctx = keys.shape[1], keys.shape[2]
    qg = q.view(bsz, kv_heads, heads // kv_heads, dim)  # [B, KVH, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * dim**-0.5  # [B, KVH, G, L]
    scores = scores.masked_fill(~mask.view(bsz, 1, 1, n_ctx), float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(q.dtype), vals)  # [B, KVH, G, D]
    return out.reshape(bsz, 1, heads * dim)


class LlamaModel:
    """Stateless apart from weights: the KV lives in the pool passed to ``forward``."""

    def __init__(self, cfg: ModelConfig, weights: Weights, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.w = weights
        self.dtype = dtype
        self.cos, self.sin = rope_tables(cfg, dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @torch.inference_mode()
    def forward(self, kv: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        """Returns fp32 logits [B, vocab] for ``b.logits_index``; writes new K/V into ``kv``."""
        cfg = self.cfg
        bsz, t = b.input_ids.shape
        kvh, dim = cfg.num_kv_heads, cfg.head_dim
        x = F.embedding(b.input_ids, self.w.embed)
        cos = self.cos[b.positions].unsqueeze(2)  # [B, T, 1, D]
        sin = self.sin[b.positions].unsqueeze(2)
        reads = gather_rows(kv, b.read_pages)
        writes = write_rows(kv, b.write_slots)
        all_real = b.write_index.numel() == bsz * t  # decode: no padding to skip
        for i, layer in enumerate(self.w.layers):
            h = rms_norm(x, layer.attn_norm, cfg.rms_eps)
            qkv = F.linear(h, layer.wqkv, layer.bqkv)
            qk = apply_rope(qkv[..., : self.q_size + self.kv_size].view(bsz, t, cfg.num_heads + kvh, dim), cos, sin)
            q, k = qk[:, :, : cfg.num_heads], qk[:, :, cfg.num_heads:]
            v = qkv[..., self.q_size + self.kv_size:]
            for j, new in ((0, k), (1, v)):
                new = new.reshape(bsz * t, kvh, dim)
                scatter_kv(kv, writes, i, j, new if all_real else new.index_select(0, b.write_index))
            keys, vals = gather_kv(kv, reads, i, 0), gather_kv(kv, reads, i, 1)
            x = x + F.linear(paged_attention(q, keys, vals, b.mask), layer.wo)
            h = rms_norm(x, layer.mlp_norm, cfg.rms_eps)
            gate, up = F.linear(h, layer.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
        last = x.reshape(bsz * t, -1).index_select(0, b.logits_index)
        return F.linear(rms_norm(last, self.w.norm, cfg.rms_eps), self.w.lm_head).float()
