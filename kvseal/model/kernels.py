"""The project's own compiled kernel: paged decode attention that reads the pool in place.

``csrc/decode_attention.cpp`` is built by the normal install (``setup.py``, g++ with ``-march=native`` and
OpenMP) into ``kvseal/model/_decode_attention*.so`` and called through ctypes; it has a C ABI and no Python or
PyTorch headers. It shares PyTorch's OpenMP runtime (the same ``libgomp.so.1``), so ``torch.set_num_threads``
governs it too, and ctypes drops the GIL for the call. The plain-PyTorch reference
(``kvseal.model.attention.decode_attention``) stays, and is used when the library is absent or
``KVSEAL_KERNELS=off``; ``tests/test_kernels.py`` holds the two equal.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

import torch

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGS = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float]


def library_path() -> str | None:
    spec = importlib.util.find_spec("kvseal.model._decode_attention")
    return spec.origin if spec is not None else None


class DecodeKernel:
    """``(q [n, H, D] rows of any stride, kv pool, layer, pages [n, P] int64, lens [n] int64) → [n, H*D]``."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self._fns = {torch.bfloat16: lib.kvseal_decode_attention_bf16, torch.float32: lib.kvseal_decode_attention_f32}
        for fn in self._fns.values():
            fn.argtypes, fn.restype = _ARGS, None
        group, dim, page = _I64(), _I64(), _I64()
        lib.kvseal_decode_limits(ctypes.byref(group), ctypes.byref(dim), ctypes.byref(page))
        self.limits = (group.value, dim.value, page.value)

    def supports(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        group, dim, _ = self.limits
        return dtype in self._fns and heads // kv_heads <= group and head_dim <= dim

    def fits(self, kv: torch.Tensor) -> bool:
        return kv.shape[4] <= self.limits[2]

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, layer: int, pages: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
        n, heads, dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == dim and q.dtype == kv.dtype and kv.is_contiguous()
        assert pages.dtype == lens.dtype == torch.int64 and pages.is_contiguous() and lens.is_contiguous()
        out = torch.empty((n, heads * dim), dtype=q.dtype)
        _, layers, _, kv_heads, page_size, _ = kv.shape
        self._fns[q.dtype](q.data_ptr(), q.stride(0), kv.data_ptr(), out.data_ptr(), pages.data_ptr(),
                           lens.data_ptr(), n, pages.shape[1], heads, kv_heads, dim, page_size, layers, layer,
                           dim**-0.5)
        return out


def load_decode_kernel(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel if it was built and fits this model, else None (the plain PyTorch path runs)."""
    if os.environ.get("KVSEAL_KERNELS", "on") == "off":
        return None
    path = library_path()
    if path is None:
        return None
    k = DecodeKernel(path)
    return k if k.supports(heads, kv_heads, head_dim, dtype) else None
