"""The compiled paged decode kernel equals the plain-PyTorch reference: ragged lengths, fragmented pages, GQA,
partial last pages, bf16 and fp32; and the real model picks it up."""

import pytest
import torch

from kvseal.model.attention import decode_attention, gather_kv, gather_rows
from kvseal.model.kernels import DecodeKernel, library_path


@pytest.fixture(scope="module")
def kernel():
    path = library_path()
    assert path is not None, "the install did not build kvseal/model/_decode_attention (see setup.py)"
    return DecodeKernel(path)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim,page", [
    (9, 3, 64, 16), (8, 8, 32, 16), (12, 2, 128, 16), (16, 2, 64, 16),  # bf16 fast path: 16-slot pages
    (8, 8, 32, 4), (12, 2, 128, 8), (18, 2, 64, 16)])  # the portable loop (odd pages, a group of 9)
def test_kernel_matches_reference(kernel, dtype, tol, heads, kv_heads, dim, page):
    gen = torch.Generator().manual_seed(heads * dim + page)
    layers, n_pages = 3, 64
    kv = torch.randn(n_pages, layers, 2, kv_heads, page, dim, generator=gen).to(dtype)
    lens = torch.tensor([1, page, page + 1, 5 * page - 3, 37, 3 * page])
    width = int(-(-lens.max() // page))
    perm = torch.randperm(n_pages, generator=gen)
    pages = perm[: len(lens) * width].view(len(lens), width).contiguous()  # scattered, distinct pages
    # queries as the model has them: rows of a wider [n, heads + kv_heads, dim] tensor
    q = torch.randn(len(lens), heads + kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    for layer in range(layers):
        rows = gather_rows(kv, pages)
        mask = torch.arange(width * page)[None, :] < lens[:, None]
        ref = decode_attention(q.float(), gather_kv(kv, rows, layer, 0).float(), gather_kv(kv, rows, layer, 1).float(),
                               mask)
        got = kernel(q, kv, layer, pages, lens)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_the_model_uses_the_kernel(bf16_model, fp32_model):
    assert bf16_model.model.decode_kernel is not None and fp32_model.model.decode_kernel is not None
