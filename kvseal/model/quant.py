"""Linear layers with the weight kernel chosen per step: fp32 or bf16 weights, or weight-only int8 / int4 for
small batches.

``bf16`` weights run through the project's GEMM (``csrc/gemm.cpp``, packed once at load) at any kernel level
from AVX2 up. With bf16 activations it computes what ``F.linear`` computes (the same fp32 sum rounded once;
a rare element lands one bf16 step away); with fp32 activations (``--dtype auto`` on a CPU without bf16 dot
products) it reads the weights as bf16 and computes in fp32, which halves the bytes a decode step reads.
Either way a row gets the same result whatever shares its step, the work is handed out dynamically (a core
that another process borrows for a moment does not hold up the other), and weights stream faster for few
rows. Where the GEMM is not built or does not fit (the generic level, a bias, odd shapes,
``KVSEAL_KERNELS=off``), a bf16 weight is prepacked once for oneDNN (``mkldnn._reorder_linear_weight``)
where this CPU runs oneDNN's bf16 path (AVX-512, ``kvseal.model.cpu``), else it runs through plain
``F.linear``; an fp32 model's bf16 weight then keeps an fp32 copy of the rounded values, so every path
computes with the same weights. ``fp32`` (an fp32 model only) keeps the exact weights and plain ``F.linear``:
the reference. ``int8`` (per-output-channel symmetric scales) and ``int4`` (groups of 32 along K,
asymmetric: scale and zero per group, the same grid as GGUF's Q4_1 blocks) keep a packed copy beside the
bf16 weight for the steps of at most ``small_rows`` rows: int8 through the project's kernel where the GEMM is
built (``Gemm.q8``: each weight widened to fp32 in registers, fp32 sums, for bf16 or fp32 activations; it
keeps no other int8 copy), else PyTorch's ``_weight_int8pack_mm``; int4 through the project's kernel too where
it is built (``Gemm.q4``: GGUF Q4_1's grid, a bf16 scale and min per group, codes widened to fp32 in registers;
PyTorch's ``_weight_int4pack_mm_for_cpu`` ran fp32 activations at 1 Gweight/s on a Zen 4, against the native
kernel's 20), else PyTorch's. A decode step of a few streams reads every weight once for very little
arithmetic, so it is bound by the bytes read, and 1 or ½ byte per weight beats 2. Larger steps are
compute-bound, where the packed kernels are no faster, and use bf16.

A request's tokens can therefore depend on how many others share its steps (int vs bf16 rounding); with
``bf16`` they do not. ``dequantized()`` gives the weight a packed kernel computes with, for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvseal.model import cpu
from kvseal.model.kernels import Gemm, load_gemm

WEIGHT_MODES = ("fp32", "bf16", "int8", "int4")
INT4_GROUP = 32


class Linear:
    """``y = x @ W.T (+ b)`` for ``x [M, K]``; ``weight`` is ``[N, K]`` in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, mode: str = "bf16",
                 small_rows: int = 0, packed: torch.Tensor | None = None) -> None:
        """``packed``: the GEMM's layout of ``weight``, already made (``kvseal.model.shared``); ``weight`` may
        then be a meta tensor (its shape and dtype)."""
        if mode not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, not {mode!r}")
        if mode == "fp32" and weight.dtype != torch.float32:
            raise ValueError("fp32 weights need an fp32 model (--dtype fp32)")
        self.weight, self.bias, self.mode, self.small_rows = weight, bias, mode, small_rows
        on_cpu = weight.device.type in ("cpu", "meta")
        if mode in ("int8", "int4") and not on_cpu:
            raise ValueError(f"--weights {mode} runs on the CPU only (its kernels are the CPU's)")
        if mode in ("int8", "int4") and weight.shape[1] % INT4_GROUP:
            self.mode = "bf16"  # odd shapes keep the bf16 path
        gemm = load_gemm() if on_cpu else None  # a GPU's weights: F.linear (cuBLAS)
        self.q8: torch.Tensor | None = None  # int8 weights in the native kernel's layout, scales included
        self.q4: torch.Tensor | None = None  # int4 codes, scales and mins in the native kernel's layout
        if self.mode == "int8":
            q, scales = quantize_int8(weight)
            if gemm is not None and gemm.fits(weight):
                self.q8, self.q8_gemm = gemm.pack_q8(q, scales), gemm
                self.q = self.scales = None
            else:
                self.q, self.scales = q, scales
        elif self.mode == "int4":
            if gemm is not None and gemm.q4_fits(weight):
                self.q4, self.q4_gemm = gemm.pack_q4(*q4_grid(weight)), gemm
                self.q = self.scales = None
            else:
                self.q, self.scales = quantize_int4(weight)
        if packed is not None:
            if mode != "bf16" or bias is not None or gemm is None or not gemm.fits(weight):
                raise ValueError("a packed weight needs the bf16 GEMM at this kernel level")
            self.gemm, self.plain, self.packed = gemm, None, packed
            return
        self.gemm: Gemm | None = None
        if self.mode != "fp32" and gemm is not None and bias is None and gemm.fits(weight):
            self.gemm = gemm
        # what F.linear computes with where the GEMM does not run: the weights this mode stands for (an fp32
        # model's bf16 weights as an fp32 copy of the rounded values; none is kept where the GEMM runs)
        self.plain = None if self.gemm is not None else self._mode_weight()
        self.packed = self.gemm.pack(weight) if self.gemm is not None else prepack(self.plain)

    def release(self) -> bool:
        """Drop the unpacked weight if no kernel of this mode reads it (the GEMM runs from its packed copy);
        True if dropped. Only its shape and dtype remain (a meta tensor)."""
        if self.gemm is None or self.weight.is_meta:
            return self.weight.is_meta
        self.weight = torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta")
        return True

    def _mode_weight(self) -> torch.Tensor:
        w = self.weight
        return w if self.mode == "fp32" or w.dtype == torch.bfloat16 else w.to(torch.bfloat16).to(w.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode in ("fp32", "bf16") or x.shape[0] > self.small_rows:
            if self.gemm is not None:
                return self.gemm(x, self.packed, self.weight.shape[0])
            if self.packed is None:
                return F.linear(x, self.plain, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
        if self.q8 is not None:
            y = self.q8_gemm.q8(x, self.q8, self.weight.shape[0])
        elif self.q4 is not None:
            y = self.q4_gemm.q4(x, self.q4, self.weight.shape[0])
        elif self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q, INT4_GROUP, self.scales)
        return y if self.bias is None else y + self.bias

    def int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weights and their per-row scales."""
        if self.q8 is not None:
            return Gemm.unpack_q8(self.q8, *self.weight.shape)
        return self.q, self.scales

    def dequantized(self) -> torch.Tensor:
        if self.mode == "int8":
            q, scales = self.int8()
            return (q.float() * scales.float()[:, None]).to(self.weight.dtype)
        if self.q4 is not None:
            codes, scales, mins = Gemm.unpack_q4(self.q4, *self.weight.shape)
            n, k = codes.shape
            w = codes.view(n, k // INT4_GROUP, INT4_GROUP).float() * scales.float()[..., None] + mins.float()[..., None]
            return w.view(n, k).to(self.weight.dtype)
        if self.mode == "int4":
            return dequantize_int4(*int4_codes(self.weight)).to(self.weight.dtype)
        return self._mode_weight()


def prepack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a bf16 weight (None: fp32, a PyTorch built without oneDNN, or a CPU where
    oneDNN's bf16 path does not run: it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and dies without)."""
    if (w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or not cpu.choice().onednn_bf16):
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


def q4_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native int4 kernel's grid, GGUF Q4_1's: codes ``[N, K]`` in 0..15 and a bf16 scale and min per group
    of 32 along K (``[N, K / 32]`` each), ``w ≈ code * scale + min``. The scale and min are rounded to bf16
    before the codes are chosen, so the codes fit the grid the kernel computes with."""
    n, k = w.shape
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo = g.amin(-1).to(torch.bfloat16)
    scale = ((g.amax(-1) - lo.float()) / 15).clamp(min=1e-8).to(torch.bfloat16)
    codes = ((g - lo.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15).to(torch.uint8)
    return codes.view(n, k), scale, lo


def dequantize_int4(codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    scale, zero = sz.float()[..., 0].t(), sz.float()[..., 1].t()  # [N, K/32]
    c = codes.view(n, k // INT4_GROUP, INT4_GROUP).float()
    return ((c - 8) * scale[..., None] + zero[..., None]).view(n, k)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, sz = int4_codes(w)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), sz
