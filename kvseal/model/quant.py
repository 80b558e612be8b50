"""Linear layers with the weight kernel chosen per step: bf16, or weight-only int8 / int4 for small batches.

``--weights bf16`` runs bf16 weights through the project's GEMM (``csrc/gemm.cpp``, packed once at load),
which computes what ``F.linear`` computes (the same fp32 sum rounded once; a rare element lands one bf16
step away) and gives a row the same result whatever shares its step, hands its work out dynamically (a core that
another process borrows for a moment does not hold up the other), and streams weights faster for few rows.
Where it is not built or does not fit (no AVX-512 BF16, a bias, odd shapes, ``KVSEAL_KERNELS=off``), the
weight is prepacked once for oneDNN (``mkldnn._reorder_linear_weight``): the same arithmetic as
``F.linear`` too, without reordering the weight on every call, which made ``F.linear`` 25–30% slower at
this model's shapes. fp32 weights keep plain ``F.linear``. ``int8`` (per-output-channel symmetric scales) and ``int4``
(groups of 32 along K, asymmetric: scale and zero per group, the same grid as GGUF's Q4_1 blocks) keep a
packed copy beside the bf16 weight and use PyTorch's own weight-only kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``) when a step has at most ``small_rows`` rows: a decode step of a few streams
reads every weight once for very little arithmetic, so it is bound by the bytes read, and 1 or ½ byte per
weight beats 2. Larger steps are compute-bound, where the packed kernels are no faster, and use bf16.

A request's tokens can therefore depend on how many others share its steps (int vs bf16 rounding); with
``bf16`` they do not. ``dequantized()`` gives the weight a packed kernel computes with, for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvseal.model.kernels import Gemm, load_gemm

WEIGHT_MODES = ("bf16", "int8", "int4")
INT4_GROUP = 32


class Linear:
    """``y = x @ W.T (+ b)`` for ``x [M, K]``; ``weight`` is ``[N, K]`` in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, mode: str = "bf16",
                 small_rows: int = 0) -> None:
        if mode not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, not {mode!r}")
        self.weight, self.bias, self.mode, self.small_rows = weight, bias, mode, small_rows
        packable = weight.dtype == torch.bfloat16 and weight.shape[1] % INT4_GROUP == 0
        if mode != "bf16" and not packable:
            self.mode = "bf16"  # fp32 models (tests, references) and odd shapes keep the exact path
        if self.mode == "int8":
            self.q, self.scales = quantize_int8(weight)
        elif self.mode == "int4":
            self.q, self.scales = quantize_int4(weight)
        gemm = load_gemm()
        self.gemm: Gemm | None = gemm if gemm is not None and bias is None and gemm.fits(weight) else None
        self.packed = self.gemm.pack(weight) if self.gemm is not None else prepack(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "bf16" or x.shape[0] > self.small_rows:
            if self.gemm is not None:
                return self.gemm(x, self.packed, self.weight.shape[0])
            if self.packed is None:
                return F.linear(x, self.weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q, INT4_GROUP, self.scales)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        if self.mode == "int8":
            return (self.q.float() * self.scales.float()[:, None]).to(self.weight.dtype)
        if self.mode == "int4":
            return dequantize_int4(*int4_codes(self.weight)).to(self.weight.dtype)
        return self.weight


def prepack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a bf16 weight (None: fp32, or a PyTorch built without oneDNN)."""
    if w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w, 32)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(1).clamp(min=1e-8) / 127
    q = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale.to(w.dtype)


def int4_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` in 0..15 and ``[K/32, N, 2]`` (scale, zero) with ``w ≈ (code - 8) * scale + zero``."""
    n, k = w.shape
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(w.dtype)
    return codes, sz


def dequantize_int4(codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    scale, zero = sz.float()[..., 0].t(), sz.float()[..., 1].t()  # [N, K/32]
    c = codes.view(n, k // INT4_GROUP, INT4_GROUP).float()
    return ((c - 8) * scale[..., None] + zero[..., None]).view(n, k)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, sz = int4_codes(w)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), sz
