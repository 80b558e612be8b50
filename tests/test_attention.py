"""Paged attention against a dense reference, with fragmented page tables and mixed lengths."""

import torch
import torch.nn.functional as F

from kvseal.model.llama import (
    decode_attention,
    gather_kv,
    gather_rows,
    paged_attention,
    scatter_kv,
    write_rows,
)

PS, KVH, H, D = 4, 2, 6, 16


def dense_reference(q, k_dense, v_dense, lens, q_pos):
    """Plain causal attention per request over its own dense K/V; q [T, H, D], k/v [L, KVH, D]."""
    outs = []
    for b in range(len(lens)):
        L = lens[b]
        k = k_dense[b][:L].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        v = v_dense[b][:L].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        qb = q[b].transpose(0, 1)  # [H, T, D]
        mask = torch.arange(L)[None, :] <= q_pos[b][:, None]
        outs.append(F.scaled_dot_product_attention(qb, k, v, attn_mask=mask).transpose(0, 1))
    return outs


def scatter_to_pool(k_dense, v_dense, lens, n_pages, gen):
    """Put each request's K/V into random, interleaved pages of one pool (layer 1 of 2, in the engine's
    page-major layout, through the model's own write path); return pool and page tables."""
    pool = torch.randn(n_pages, 2, 2, KVH, PS, D, generator=gen)  # stale garbage everywhere else
    perm = torch.randperm(n_pages, generator=gen).tolist()
    tables = []
    for b, L in enumerate(lens):
        pages = [perm.pop() for _ in range(-(-L // PS))]
        tables.append(pages)
        slots = torch.tensor([pages[pos // PS] * PS + pos % PS for pos in range(L)])
        rows = write_rows(pool, slots)
        scatter_kv(pool, rows, 1, 0, k_dense[b])
        scatter_kv(pool, rows, 1, 1, v_dense[b])
    return pool, tables


def gather(pool, tables):
    width = max(len(t) for t in tables)
    rows = gather_rows(pool, torch.tensor([t + [0] * (width - len(t)) for t in tables]))
    return gather_kv(pool, rows, 1, 0), gather_kv(pool, rows, 1, 1), width * PS


def test_page_major_rows_address_the_pool_layout():
    """The row arithmetic agrees with plain indexing of kv[page, layer, 0|1, head, offset, D]."""
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(8, 3, 2, KVH, PS, D, generator=gen)
    pages = torch.tensor([[5, 2], [7, 0]])
    keys = gather_kv(pool, gather_rows(pool, pages), 2, 1)  # layer 2, values
    for b in range(2):
        for h in range(KVH):
            want = torch.cat([pool[p, 2, 1, h] for p in pages[b].tolist()])
            assert torch.equal(keys[b, h], want)
    new = torch.randn(2, KVH, D, generator=gen)
    scatter_kv(pool, write_rows(pool, torch.tensor([3 * PS + 1, 6 * PS + 3])), 1, 0, new)
    assert torch.equal(pool[3, 1, 0, :, 1], new[0]) and torch.equal(pool[6, 1, 0, :, 3], new[1])


def test_paged_prefill_and_decode_match_dense_reference():
    gen = torch.Generator().manual_seed(0)
    lens = [5, 13, 1, 9]
    k_dense = [torch.randn(L, KVH, D, generator=gen) for L in lens]
    v_dense = [torch.randn(L, KVH, D, generator=gen) for L in lens]
    pool, tables = scatter_to_pool(k_dense, v_dense, lens, 32, gen)
    keys, vals, n_ctx = gather(pool, tables)
    # prefill: every request queries all of its positions (padded to the longest)
    T = max(lens)
    q = torch.randn(len(lens), T, H, D, generator=gen)
    pos = torch.arange(T)[None, :].expand(len(lens), T)
    lens_t = torch.tensor(lens)
    mask = (torch.arange(n_ctx)[None, None, :] <= pos[:, :, None]) & (torch.arange(n_ctx) < lens_t[:, None, None])
    out = paged_attention(q, keys, vals, mask.unsqueeze(1)).view(len(lens), T, H, D)
    ref = dense_reference(q, k_dense, v_dense, lens, pos)
    for b, L in enumerate(lens):
        torch.testing.assert_close(out[b, :L], ref[b][:L], atol=1e-5, rtol=1e-5)
    # decode: one query at the last position of each request
    qd = torch.randn(len(lens), 1, H, D, generator=gen)
    last = (lens_t - 1)[:, None]
    dmask = (torch.arange(n_ctx)[None, :] < lens_t[:, None]).view(len(lens), 1, 1, n_ctx)
    outd = paged_attention(qd, keys, vals, dmask).view(len(lens), H, D)
    refd = dense_reference(qd, k_dense, v_dense, lens, last)
    for b in range(len(lens)):
        torch.testing.assert_close(outd[b], refd[b][0], atol=1e-5, rtol=1e-5)


def test_fast_decode_attention_matches_sdpa():
    gen = torch.Generator().manual_seed(1)
    B, L = 3, 24
    q = torch.randn(B, 1, H, D, generator=gen)
    keys = torch.randn(B, KVH, L, D, generator=gen)
    vals = torch.randn(B, KVH, L, D, generator=gen)
    mask = (torch.arange(L)[None, :] < torch.tensor([24, 7, 16])[:, None]).view(B, 1, 1, L)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals,
                                         attn_mask=mask, enable_gqa=True).transpose(1, 2).reshape(B, 1, H * D)
    torch.testing.assert_close(decode_attention(q, keys, vals, mask), ref, atol=1e-5, rtol=1e-5)
