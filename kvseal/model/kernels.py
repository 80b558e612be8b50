"""The project's own compiled kernels: paged decode and prefill attention that read the pool in place, the bf16
and weight-only int8 linear layers (``csrc/gemm.cpp``), and the fused per-layer ops (residual add + RMSNorm,
RoPE + K/V store, SiLU * up).

``csrc/*.cpp`` are built by the normal install (``setup.py``, g++ with OpenMP) once per instruction-set level
into ``kvseal/model/_kernels_<level>*.so``; ``kvseal.model.cpu`` picks the level this CPU runs (or the one
``KVSEAL_ISA`` forces), and every class here takes the path of one library, so tests can hold each level to
the reference on one machine. The libraries have a C ABI and no Python or PyTorch headers. They share
PyTorch's OpenMP runtime (the same ``libgomp.so.1``), so ``torch.set_num_threads`` governs them too, and
ctypes drops the GIL for the call. The plain-PyTorch references (``kvseal.model.attention.decode_attention``;
``rms_norm``, ``apply_rope``, ``scatter_kv`` and ``F.silu(gate) * up`` in ``kvseal.model.llama``) stay, and
are used when no library was built or ``KVSEAL_KERNELS=off``; ``tests/test_kernels.py`` holds each kernel
equal to its reference, at every level this CPU runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvseal.model import cpu

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGS = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float]


def library_path(level: str | None = None) -> str | None:
    """The library of ``level`` (default: the one this process chose, ``kvseal.model.cpu.choice``)."""
    if level is None:
        level = cpu.choice().level
    return cpu.library_for(level) if level is not None else None


@functools.cache
def library_info(path: str) -> tuple[str, str]:
    """(level, compiler) that a library says it was built with."""
    lib = ctypes.CDLL(path)
    lib.kvseal_level.restype = lib.kvseal_compiler.restype = ctypes.c_char_p
    return lib.kvseal_level().decode(), lib.kvseal_compiler().decode()


class DecodeKernel:
    """Paged attention reading the pool in place. Calling it is decode: ``(q [n, H, D] rows of any stride, kv
    pool, layer, pages [n, P] int64, lens [n] int64) → [n, H*D]``; ``prefill`` is one causal chunk."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self._fns = {torch.bfloat16: lib.kvseal_decode_attention_bf16, torch.float32: lib.kvseal_decode_attention_f32}
        for fn in self._fns.values():
            fn.argtypes, fn.restype = _ARGS, None
        group, dim, page = _I64(), _I64(), _I64()
        lib.kvseal_decode_limits(ctypes.byref(group), ctypes.byref(dim), ctypes.byref(page))
        self.limits = (group.value, dim.value, page.value)
        self._prefill = {torch.bfloat16: lib.kvseal_prefill_attention_bf16,
                         torch.float32: lib.kvseal_prefill_attention_f32}
        self._prefill_supported = {torch.bfloat16: lib.kvseal_prefill_supported,
                                   torch.float32: lib.kvseal_prefill_f32_supported}
        for fn in self._prefill.values():
            fn.argtypes, fn.restype = [_PTR, _I64, _PTR, _PTR, _PTR, *[_I64] * 8, ctypes.c_float], ctypes.c_int
        for fn in self._prefill_supported.values():
            fn.argtypes, fn.restype = [_I64] * 4, ctypes.c_int

    def prefill_fits(self, q: torch.Tensor, kv: torch.Tensor) -> bool:
        """Whether ``prefill`` takes this shape (16-slot pages; bf16 at the AVX-512 BF16 level, fp32 at the AVX2
        and AVX-512 levels; ...)."""
        _, heads, dim = q.shape
        return q.dtype == kv.dtype and self.prefill_takes(heads, kv.shape[3], dim, kv)

    def prefill_takes(self, heads: int, kv_heads: int, dim: int, kv: torch.Tensor) -> bool:
        """``prefill_fits`` for a query of ``heads`` x ``dim`` in the model's dtype."""
        fn = self._prefill_supported.get(kv.dtype)
        return fn is not None and bool(fn(heads, kv_heads, dim, kv.shape[4]))

    def prefill(self, q: torch.Tensor, kv: torch.Tensor, layer: int, pages: torch.Tensor, pos0: int) -> torch.Tensor:
        """Causal attention of one chunk: ``q [n, H, D]`` (rows of any stride) at positions ``pos0 ..
        pos0 + n - 1`` over the request's ``pages`` (its own keys already stored) → ``[n, H*D]``."""
        n, heads, dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == dim and kv.is_contiguous()
        assert pages.dtype == torch.int64 and pages.is_contiguous() and pages.shape[0] * kv.shape[4] >= pos0 + n
        out = torch.empty((n, heads * dim), dtype=q.dtype)
        _, layers, _, kv_heads, page_size, _ = kv.shape
        ok = self._prefill[kv.dtype](q.data_ptr(), q.stride(0), kv.data_ptr(), out.data_ptr(), pages.data_ptr(), n,
                                     pos0, heads, kv_heads, dim, page_size, layers, layer, dim**-0.5)
        assert ok, "prefill kernel called for a shape it does not take (check prefill_fits)"
        return out

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


class FusedOps:
    """The fused per-layer ops, on contiguous tensors of the model dtype (bf16 or fp32)."""

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        lib = ctypes.CDLL(path)
        suffix = {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
        self._norm = getattr(lib, f"kvseal_add_rms_norm_{suffix}")
        self._norm.argtypes, self._norm.restype = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float], None
        self._rope = getattr(lib, f"kvseal_rope_store_{suffix}")
        self._rope.argtypes, self._rope.restype = [_PTR, *[_I64] * 5, _PTR, _PTR, _PTR, _PTR, _PTR, *[_I64] * 3], None
        self._silu = getattr(lib, f"kvseal_silu_mul_{suffix}")
        self._silu.argtypes, self._silu.restype = [_PTR, _PTR, _I64, _I64], None

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``x += delta`` in place (when given), then returns ``rms_norm(x, weight, eps)``."""
        n, hidden = x.shape
        assert x.is_contiguous() and (delta is None or delta.is_contiguous()) and weight.is_contiguous()
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                   n, hidden, eps)
        return out

    def rope_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, layer: int) -> None:
        """Rotates the query and key heads of ``qkv [n, (heads + 2 kv_heads) * D]`` in place and writes keys
        and values to ``slots`` of ``layer`` in the page-major pool ``kv``."""
        n = qkv.shape[0]
        dim = kv.shape[5]
        assert qkv.stride(1) == 1 and kv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        assert positions.dtype == slots.dtype == torch.int64 and positions.is_contiguous() and slots.is_contiguous()
        self._rope(qkv.data_ptr(), n, qkv.stride(0), heads, kv_heads, dim, cos.data_ptr(), sin.data_ptr(),
                   positions.data_ptr(), kv.data_ptr(), slots.data_ptr(), kv.shape[1], layer, kv.shape[4])

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``F.silu(gate) * up`` for ``gate_up [n, 2 * inter]`` (gate first)."""
        n, two = gate_up.shape
        assert gate_up.is_contiguous()
        out = torch.empty((n, two // 2), dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), out.data_ptr(), n, two // 2)
        return out


class Gemm:
    """``y = x @ W.T`` with ``W`` packed once as bf16 (``pack``), fp32 sums, batch invariant. bf16 ``x``: ``F.linear``'s
    fp32 sum rounded once (a rare element one bf16 step away); fp32 ``x``: fp32 out, the weights read as bf16."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self._supported = lib.kvseal_gemm_supported
        self._supported.argtypes, self._supported.restype = [_I64, _I64], ctypes.c_int
        self._pack = lib.kvseal_gemm_pack_bf16
        self._pack.argtypes, self._pack.restype = [_PTR, _I64, _I64, _PTR], None
        self._gemm = lib.kvseal_gemm_bf16
        self._gemm.argtypes, self._gemm.restype = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR], None
        self._gemm_f32 = lib.kvseal_gemm_f32
        self._gemm_f32.argtypes, self._gemm_f32.restype = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR], None
        self._silu_supported = lib.kvseal_gemm_silu_supported
        self._silu_supported.argtypes, self._silu_supported.restype = [_I64, _I64], ctypes.c_int
        self._silu = lib.kvseal_gemm_silu_bf16
        self._silu.argtypes, self._silu.restype = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR], None
        self._pack_q8 = lib.kvseal_gemm_pack_q8
        self._pack_q8.argtypes, self._pack_q8.restype = [_PTR, _PTR, _I64, _I64, _PTR], None
        self._q8 = {torch.bfloat16: lib.kvseal_gemm_q8_bf16, torch.float32: lib.kvseal_gemm_q8_f32}
        for fn in self._q8.values():
            fn.argtypes, fn.restype = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR], None
        self._q4_supported = lib.kvseal_gemm_q4_supported
        self._q4_supported.argtypes, self._q4_supported.restype = [_I64, _I64], ctypes.c_int
        self._pack_q4 = lib.kvseal_gemm_pack_q4
        self._pack_q4.argtypes, self._pack_q4.restype = [_PTR, _PTR, _PTR, _I64, _I64, _PTR], None
        self._q4 = {torch.bfloat16: lib.kvseal_gemm_q4_bf16, torch.float32: lib.kvseal_gemm_q4_f32}
        for fn in self._q4.values():
            fn.argtypes, fn.restype = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR], None

    def fits(self, w: torch.Tensor) -> bool:
        """Whether this library takes a weight of ``w``'s shape (any float dtype: ``pack`` stores it as bf16)."""
        return w.is_floating_point() and w.dim() == 2 and bool(self._supported(*w.shape))

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """The kernel's layout of ``w [N, K]`` rounded to bf16 (a flat tensor of the same size)."""
        w = w.to(torch.bfloat16).contiguous()
        packed = torch.empty(w.numel(), dtype=torch.bfloat16)  # PyTorch aligns CPU tensors to 64 bytes
        assert packed.data_ptr() % 64 == 0
        self._pack(w.data_ptr(), w.shape[0], w.shape[1], packed.data_ptr())
        return packed

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        m, k = x.shape
        assert x.dtype in (torch.bfloat16, torch.float32) and x.stride(1) == 1 and packed.numel() == n * k
        out = torch.empty((m, n), dtype=x.dtype)
        fn = self._gemm if x.dtype == torch.bfloat16 else self._gemm_f32
        fn(x.data_ptr(), x.stride(0), m, packed.data_ptr(), n, k, out.data_ptr())
        return out

    def pack_q8(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The int8 kernel's layout of ``q [N, K]`` int8 with a scale per row ``scales [N]``: a flat int8 tensor of
        ``N * K`` weights and then the ``N`` scales as fp32 (``unpack_q8`` reverses it)."""
        n, k = q.shape
        assert q.dtype == torch.int8 and bool(self._supported(n, k))
        q, scales = q.contiguous(), scales.to(torch.float32).contiguous()
        packed = torch.empty(n * k + 4 * n, dtype=torch.int8)
        assert packed.data_ptr() % 64 == 0
        self._pack_q8(q.data_ptr(), scales.data_ptr(), n, k, packed.data_ptr())
        return packed

    @staticmethod
    def unpack_q8(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [N, K], scales [N])`` back from ``pack_q8``'s layout."""
        q = packed[: n * k].view(n // 16, k, 16).permute(0, 2, 1).reshape(n, k)
        return q, packed[n * k:].view(torch.float32)

    def q8(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """``x @ (q * scales).T`` for ``packed`` from ``pack_q8``: each weight widened to fp32 in registers, fp32
        sums in order, scaled once; bf16 ``x`` gives bf16 (rounded once), fp32 gives fp32. A row's result does not
        depend on the other rows."""
        m, k = x.shape
        assert x.dtype in self._q8 and x.stride(1) == 1 and packed.numel() == n * k + 4 * n
        out = torch.empty((m, n), dtype=x.dtype)
        self._q8[x.dtype](x.data_ptr(), x.stride(0), m, packed.data_ptr(), n, k, out.data_ptr())
        return out

    def q4_fits(self, w: torch.Tensor) -> bool:
        """Whether the int4 kernel takes a weight of ``w``'s shape (N a multiple of 16, K of 32)."""
        return w.dim() == 2 and bool(self._q4_supported(*w.shape))

    def pack_q4(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
        """The int4 kernel's layout of ``codes [N, K]`` (0..15) with a bf16 scale and min per group of 32 along K
        (``[N, K / 32]`` each; the weight is ``code * scale + min``): a flat uint8 tensor, 5/8 of a byte a
        weight (``unpack_q4`` reverses it)."""
        n, k = codes.shape
        assert bool(self._q4_supported(n, k)) and scales.shape == mins.shape == (n, k // 32)
        codes = codes.to(torch.uint8).contiguous()
        scales, mins = scales.to(torch.bfloat16).contiguous(), mins.to(torch.bfloat16).contiguous()
        packed = torch.empty(n * k // 2 + n * k // 8, dtype=torch.uint8)
        assert packed.data_ptr() % 64 == 0
        self._pack_q4(codes.data_ptr(), scales.data_ptr(), mins.data_ptr(), n, k, packed.data_ptr())
        return packed

    @staticmethod
    def unpack_q4(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes [N, K] uint8, scales [N, K / 32] bf16, mins)`` back from ``pack_q4``'s layout."""
        groups = packed.view(n // 16, k // 32, 320)
        b = groups[..., :256].reshape(n // 16, k // 32, 32, 8)
        codes = torch.cat([b & 15, b >> 4], -1)  # [blocks, groups, 32 k, 16 columns]
        codes = codes.permute(0, 3, 1, 2).reshape(n, k)
        sz = groups[..., 256:].contiguous().view(torch.bfloat16).view(n // 16, k // 32, 2, 16)
        scales, mins = (sz[:, :, i].permute(0, 2, 1).reshape(n, k // 32) for i in (0, 1))
        return codes, scales, mins

    def q4(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """``x @ W.T`` for the int4 weights ``packed`` by ``pack_q4``: per group of 32, fp32 sums of x times the codes
        in order, then scale times that plus min times the group's sum of x; bf16 ``x`` gives bf16 (rounded once),
        fp32 gives fp32. A row's result does not depend on the other rows."""
        m, k = x.shape
        assert x.dtype in self._q4 and x.stride(1) == 1 and packed.numel() == n * k // 2 + n * k // 8
        out = torch.empty((m, n), dtype=x.dtype)
        self._q4[x.dtype](x.data_ptr(), x.stride(0), m, packed.data_ptr(), n, k, out.data_ptr())
        return out

    def silu_fits(self, w: torch.Tensor) -> bool:
        """Can ``silu`` take this ``[gate; up]`` weight ``[2 inter, K]``."""
        return self.fits(w) and bool(self._silu_supported(w.shape[0] // 2, w.shape[1]))

    def silu(self, x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
        """``silu(gate) * up`` of ``x @ [gate; up].T`` (weight packed by ``pack``), rounded as ``self(x)`` and then
        ``FusedOps.silu_mul`` round: the same bits, without the ``[M, 2 inter]`` product in memory."""
        m, k = x.shape
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and packed.numel() == 2 * inter * k
        out = torch.empty((m, inter), dtype=torch.bfloat16)
        self._silu(x.data_ptr(), x.stride(0), m, packed.data_ptr(), inter, k, out.data_ptr())
        return out


class NativeLayers:
    """All decoder layers of one forward in one call (``csrc/layers.cpp``): the kernels of
    ``LlamaModel._layers_fused`` in the same order, without the Python loop around them. bf16 or fp32 (a step
    with a prefill chunk only where ``DecodeKernel.prefill_takes`` its shape)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self._fns = {torch.bfloat16: lib.kvseal_layers_bf16, torch.float32: lib.kvseal_layers_f32}
        f32 = ctypes.c_float
        for fn in self._fns.values():
            fn.argtypes = [_PTR, _I64, _PTR, *[_I64] * 7, f32, f32, *[_PTR] * 5, _I64, _I64, _PTR, _PTR, _I64, _I64,
                           _PTR, *[_PTR] * 6, _PTR]
            fn.restype = ctypes.c_int

    QUANT = {"packed": 0, "q8": 1, "q4": 2}  # the layer loop's code for each kind of weight

    def __call__(self, x: torch.Tensor, table: torch.Tensor, cfg: object, scale: float, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                 dec_pages: torch.Tensor | None, dec_lens: torch.Tensor | None, spans: torch.Tensor,
                 times: ctypes.Array, weights: str = "packed") -> None:
        """Runs the layers over ``x [n, hidden]`` in place (the residual stream after the last layer). ``weights``:
        what the table points to: ``packed`` bf16 (``Gemm.pack``), ``q8`` int8 (``Gemm.pack_q8``) or ``q4`` int4
        weights (``Gemm.pack_q4``)."""
        n, hidden = x.shape
        heads, kvh, dim, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        bufs = [torch.empty((n, w), dtype=x.dtype)
                for w in (hidden, (heads + 2 * kvh) * dim, heads * dim, hidden, 2 * inter, inter)]
        n_dec = 0 if dec_pages is None else dec_pages.shape[0]
        ok = self._fns[x.dtype](
            x.data_ptr(), n, table.data_ptr(), self.QUANT[weights], table.shape[0], hidden, heads, kvh, dim, inter,
            cfg.rms_eps, scale, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            kv.data_ptr(), kv.shape[4], n_dec, None if n_dec == 0 else dec_pages.data_ptr(),
            None if n_dec == 0 else dec_lens.data_ptr(), 0 if n_dec == 0 else dec_pages.shape[1],
            spans.shape[0], spans.data_ptr(), *[t.data_ptr() for t in bufs], times)
        assert ok, "native layers called with a prefill chunk the kernel does not take"


def kernels_enabled() -> bool:
    return library_path() is not None


def load_decode_kernel(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel if it was built and fits this model, else None (the plain PyTorch path runs)."""
    if not kernels_enabled():
        return None
    k = DecodeKernel(library_path())
    return k if k.supports(heads, kv_heads, head_dim, dtype) else None


def load_gemm() -> Gemm | None:
    """The GEMM of the chosen library (weights then skip oneDNN), else None."""
    return _gemm(library_path()) if kernels_enabled() else None


@functools.cache
def _gemm(path: str) -> Gemm:
    return Gemm(path)


def load_native_layers() -> NativeLayers | None:
    return NativeLayers(library_path()) if kernels_enabled() else None


def load_fused_ops(head_dim: int, dtype: torch.dtype) -> FusedOps | None:
    """The fused per-layer ops if they were built, else None (the plain PyTorch ops run)."""
    if not kernels_enabled() or dtype not in (torch.bfloat16, torch.float32) or head_dim > 512:
        return None
    return FusedOps(library_path(), dtype)
