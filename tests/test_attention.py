"""Paged attention against a dense reference, with fragmented page tables and mixed lengths."""

import torch
import torch.nn.functional as F

from kvseal.model.attention import (
    DecodeRows,
    PagedAttention,
    Span,
    decode_attention,
    gather_kv,
    gather_rows,
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


def packed_step(pool, tables, lens, feeds, gen):
    """One packed step over ``scatter_to_pool``'s requests: request ``b`` feeds its last ``feeds[b]`` tokens
    (1 = a decode row; the rest are chunks, ``feeds[b] == lens[b]`` a first chunk). Returns the attention
    output per request, its queries and their positions."""
    order = sorted(range(len(lens)), key=lambda b: feeds[b] != 1)
    q = torch.randn(sum(feeds), H, D, generator=gen)
    n_dec = sum(1 for f in feeds if f == 1)
    dec = DecodeRows(torch.tensor([tables[b] + [0] * (max(len(tables[c]) for c in order[:n_dec]) - len(tables[b]))
                                   for b in order[:n_dec]]), torch.tensor([lens[b] for b in order[:n_dec]])) \
        if n_dec else None
    spans, start = [], n_dec
    for b in order[n_dec:]:
        spans.append(Span(start, feeds[b], lens[b] - feeds[b], torch.tensor(tables[b])))
        start += feeds[b]
    # a first chunk's keys are this step's own: hand them in as the model would (they are also in the pool)
    k = torch.zeros(sum(feeds), KVH, D)
    v = torch.zeros(sum(feeds), KVH, D)
    for sp, b in zip(spans, order[n_dec:]):
        slots = torch.tensor([tables[b][p // PS] * PS + p % PS for p in range(sp.pos0, sp.pos0 + sp.n)])
        rows = write_rows(pool, slots) + 2 * KVH * PS
        k[sp.start: sp.start + sp.n] = pool.view(-1, D)[rows.reshape(-1)].view(sp.n, KVH, D)
        v[sp.start: sp.start + sp.n] = pool.view(-1, D)[(rows + KVH * PS).reshape(-1)].view(sp.n, KVH, D)
    out = PagedAttention(pool, dec, spans)(1, q, k, v).view(-1, H, D)
    starts = [0] * len(lens)
    for i, b in enumerate(order[:n_dec]):
        starts[b] = i
    for sp, b in zip(spans, order[n_dec:]):
        starts[b] = sp.start
    return [(out[starts[b]: starts[b] + feeds[b]], q[starts[b]: starts[b] + feeds[b]],
             torch.arange(lens[b] - feeds[b], lens[b])) for b in range(len(lens))]


def test_packed_chunks_and_decode_rows_match_dense_reference():
    """Decode rows, a first chunk and later chunks in one packed step, over fragmented pages, GQA."""
    gen = torch.Generator().manual_seed(0)
    lens = [5, 13, 1, 9, 20, 3]
    feeds = [1, 13, 1, 4, 7, 1]  # decode, first chunk, 1-token prompt, later chunk, later chunk, decode
    k_dense = [torch.randn(L, KVH, D, generator=gen) for L in lens]
    v_dense = [torch.randn(L, KVH, D, generator=gen) for L in lens]
    pool, tables = scatter_to_pool(k_dense, v_dense, lens, 40, gen)
    for b, (out, q, pos) in enumerate(packed_step(pool, tables, lens, feeds, gen)):
        ref = dense_reference([q], [k_dense[b]], [v_dense[b]], [lens[b]], [pos])[0]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_attention_matches_sdpa():
    gen = torch.Generator().manual_seed(1)
    B, L = 3, 24
    q = torch.randn(B, H, D, generator=gen)
    keys = torch.randn(B, KVH, L, D, generator=gen)
    vals = torch.randn(B, KVH, L, D, generator=gen)
    mask = torch.arange(L)[None, :] < torch.tensor([24, 7, 16])[:, None]
    ref = F.scaled_dot_product_attention(q[:, :, None], keys, vals, attn_mask=mask[:, None, None],
                                         enable_gqa=True).reshape(B, H * D)
    torch.testing.assert_close(decode_attention(q, keys, vals, mask), ref, atol=1e-5, rtol=1e-5)
