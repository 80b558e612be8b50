"""Weight-only int8/int4 linear layers: the packed kernels compute with exactly the weights they claim
(``dequantized``), large steps take the bf16 path unchanged, and the real model runs in every mode."""

import pytest
import torch
import torch.nn.functional as F
from engine_util import chat_ids, generate, make_engine

from kvseal.model.kernels import Gemm, library_path
from kvseal.model.quant import Linear, dequantize_int4, int4_codes, prepack


@pytest.mark.parametrize("mode,kernel", [("int8", "native"), ("int8", "torch"), ("int4", "native"), ("int4", "torch")])
def test_packed_kernel_equals_its_dequantized_weight(mode, kernel, monkeypatch):
    """Each packed kernel, the project's (where the GEMM is built) and PyTorch's (where not)."""
    from kvseal.model import quant
    if kernel == "torch":
        monkeypatch.setattr(quant, "load_gemm", lambda: None)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16)
    lin = Linear(w, b, mode, small_rows=4)
    native = lin.q8 if mode == "int8" else lin.q4
    if kernel == "torch":
        assert native is None
    elif quant.load_gemm() is not None:
        assert native is not None
    for rows in (1, 4):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        ref = F.linear(x.float(), lin.dequantized().float(), b.float())
        torch.testing.assert_close(lin(x).float(), ref, atol=0.05, rtol=0.02)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)  # above small_rows: the bf16 weight, bit for bit
    assert torch.equal(lin(x), F.linear(x, w, b))
    assert (lin.dequantized().float() - w.float()).norm() / w.float().norm() < (0.12 if mode == "int4" else 0.02)


def test_int4_grid_reproduces_a_4bit_group_exactly():
    """Weights already on a 4-bit grid per group of 32 (as GGUF Q4_1 blocks are) come back unchanged."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (8, 64), generator=gen)
    codes[:, ::32] = 0
    codes[:, 1::32] = 15  # every group spans the full grid, as a min/max quantizer's does
    scale = torch.rand(8, 2, generator=gen)[..., None] * 0.01 + 0.001
    lo = torch.randn(8, 2, generator=gen)[..., None] * 0.01
    w = (codes.view(8, 2, 32) * scale + lo).view(8, 64)
    got = dequantize_int4(*int4_codes(w))
    torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_model_serves_in_every_weight_mode(bf16_model, mode):
    prompts = [chat_ids(bf16_model, "What is the capital of Germany?")]
    bf16_model.model.use_weights(mode)
    try:
        engine = make_engine(bf16_model, dtype="bf16")
        try:
            out = generate(engine, prompts, 12, eos=(2,))[0]
        finally:
            engine.stop()
    finally:
        bf16_model.model.use_weights("bf16")
    assert "Berlin" in bf16_model.tokenizer.decode(out)


def test_bf16_linear_equals_f_linear_and_ignores_batch_size(level):
    """Both bf16 paths compute what F.linear computes: the same fp32 sum rounded once (it lands on the other
    side of a rounding boundary for a rare element, one bf16 step away, or fp32 rounding apart where the sum
    cancels to near zero). oneDNN's prepacked weight gave F.linear's bits on a Zen 4 and under two pytest
    workers on a Xeon with AMX, but not there with two threads in one process. With the native GEMM a row's
    result does not depend on how many rows share the step (the batch invariance the isolation probe relies
    on); oneDNN's does, for one row of the down projection (K = 1536), which is why the native GEMM serves
    every step where it is built."""
    gen = torch.Generator().manual_seed(3)
    for n, k in ((3072, 576), (576, 1536), (48 * 3 + 16, 64), (48 + 32, 64)):
        w = (0.05 * torch.randn(n, k, generator=gen)).to(torch.bfloat16)
        x = torch.randn(512, k, generator=gen).to(torch.bfloat16)
        ref = F.linear(x, w)
        step = ref.float().abs() * 2.0**-7 + (x.float().abs() @ w.float().abs().T) * 2.0**-20
        onednn = Linear(w)
        onednn.gemm, onednn.packed = None, prepack(w)
        if onednn.packed is not None:
            assert ((onednn(x).float() - ref.float()).abs() <= step).all()
        gemm = Gemm(library_path(level))
        if not gemm.fits(w):
            pytest.skip(f"no native GEMM at the {level} level")
        packed = gemm.pack(w)

        def native(rows: torch.Tensor, gemm: Gemm = gemm, packed: torch.Tensor = packed, n: int = n) -> torch.Tensor:
            return gemm(rows, packed, n)

        full = native(x)
        assert ((full.float() - ref.float()).abs() <= step).all()
        assert (full != ref).float().mean() < 2e-3
        exact = x.float() @ w.float().T
        assert (full.float() - exact).abs().mean() <= (ref.float() - exact).abs().mean() * 1.01
        for rows in (1, 2, 3, 8, 9, 32, 50, 100):  # one or two rows take wider panels than more; AMX: 50 = 32 + 18
            assert torch.equal(native(x[:rows].contiguous()), full[:rows])
            assert torch.equal(native(x[rows:2 * rows]), full[rows:2 * rows])


def test_fp32_activations_with_bf16_weights_equal_f_linear_on_the_rounded_weights(level):
    """fp32 compute over bf16 weights (``--dtype auto`` without bf16 dot products): fp32 F.linear with the
    weights rounded to bf16, to fp32 rounding (sums in another order), and a row's result whatever shares its
    step."""
    gen = torch.Generator().manual_seed(6)
    gemm = Gemm(library_path(level))
    for n, k in ((3072, 576), (576, 1536), (48 * 3 + 16, 64), (48 + 32, 64)):
        w = 0.05 * torch.randn(n, k, generator=gen)
        if not gemm.fits(w):
            pytest.skip(f"no native GEMM at the {level} level")
        packed = gemm.pack(w)
        x = torch.randn(100, k, generator=gen)
        full = gemm(x, packed, n)
        assert full.dtype == torch.float32
        ref = F.linear(x, w.to(torch.bfloat16).float())
        bound = (x.abs() @ w.abs().T) * 2.0**-20  # a few fp32 ulps of the sum of |products|
        assert ((full - ref).abs() <= bound).all()
        for rows in (1, 2, 3, 8, 9, 32):  # one or two rows take wider panels than more
            assert torch.equal(gemm(x[:rows].contiguous(), packed, n), full[:rows])
            assert torch.equal(gemm(x[rows:2 * rows], packed, n), full[rows:2 * rows])


def _holds_to_the_dequantized_weight(kernel, x: torch.Tensor, deq: torch.Tensor, bound: torch.Tensor) -> None:
    """A weight-only kernel against fp32 F.linear on its dequantized weight: fp32 x within ``bound``, bf16 x also
    one bf16 rounding of the output; and a row's result the same whatever rows share its step."""
    full = kernel(x)
    assert full.dtype == torch.float32 and ((full - x @ deq.T).abs() <= bound).all()
    xb = x.to(torch.bfloat16)
    fullb = kernel(xb)
    ref = xb.float() @ deq.T
    assert fullb.dtype == torch.bfloat16
    assert ((fullb.float() - ref).abs() <= ref.abs() * 2.0**-8 + bound).all()
    for rows in (1, 2, 3, 8, 9):
        for a, xs in ((full, x), (fullb, xb)):
            assert torch.equal(kernel(xs[:rows].contiguous()), a[:rows])
            assert torch.equal(kernel(xs[rows:2 * rows]), a[rows:2 * rows])


def _packed_q8(gemm: Gemm, w: torch.Tensor, x: torch.Tensor) -> tuple:
    """int8: the packed layout gives back exactly the int8 weights and scales; the scale is applied after the
    sum (fp32 rounding apart)."""
    from kvseal.model.quant import quantize_int8
    n, k = w.shape
    q, scales = quantize_int8(w)
    packed = gemm.pack_q8(q, scales)
    q2, s2 = Gemm.unpack_q8(packed, n, k)
    assert torch.equal(q2, q) and torch.equal(s2, scales.float())
    deq = q.float() * scales.float()[:, None]
    return (lambda rows: gemm.q8(rows, packed, n)), deq, (x.abs() @ deq.abs().T) * 2.0**-20


def _packed_q4(gemm: Gemm, w: torch.Tensor, x: torch.Tensor) -> tuple:
    """int4 (GGUF Q4_1's grid): the packed layout gives back exactly the codes, scales and mins; scale and min are
    applied per group after the sums of x * code and of x (each a few fp32 ulps of its sum of magnitudes)."""
    from kvseal.model.quant import q4_grid
    n, k = w.shape
    codes, scales, mins = q4_grid(w)
    packed = gemm.pack_q4(codes, scales, mins)
    c2, s2, m2 = Gemm.unpack_q4(packed, n, k)
    assert torch.equal(c2, codes) and torch.equal(s2, scales) and torch.equal(m2, mins)
    deq = (codes.view(n, k // 32, 32).float() * scales.float()[..., None] + mins.float()[..., None]).view(n, k)
    assert (deq - w.float()).abs().max() <= scales.float().max() * 0.51 + mins.float().abs().max() * 2**-8
    per_weight = 15 * scales.float().repeat_interleave(32, 1) + mins.float().abs().repeat_interleave(32, 1)
    return (lambda rows: gemm.q4(rows, packed, n)), deq, (x.abs() @ per_weight.T) * 2.0**-19


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_weight_only_kernels_compute_with_their_weights_whatever_shares_the_step(level, kind):
    """The native int8 and int4 kernels (``--weights int8|int4`` on small steps): bf16 and fp32 activations
    against fp32 F.linear on the dequantized weight (fp32 rounding apart, and one bf16 rounding of the output),
    the packed layout giving back exactly what was packed, and a row's result the same whatever rows share its
    step (one row runs wider panels than several)."""
    gen = torch.Generator().manual_seed(8)
    gemm = Gemm(library_path(level))
    for n, k in ((960, 576), (576, 1536), (48 * 3 + 16, 64), (32, 32)):
        w = (0.05 * torch.randn(n, k, generator=gen)).to(torch.bfloat16)
        if not (gemm.fits(w) if kind == "int8" else gemm.q4_fits(w)):
            pytest.skip(f"no native GEMM at the {level} level")
        x = torch.randn(13, k, generator=gen)
        kernel, deq, bound = (_packed_q8 if kind == "int8" else _packed_q4)(gemm, w, x)
        _holds_to_the_dequantized_weight(kernel, x, deq, bound)


def test_an_fp32_model_keeps_its_weights_exact_or_reads_them_as_bf16(monkeypatch):
    """``--weights fp32`` is F.linear on the exact weights; ``bf16`` in an fp32 model computes with the rounded
    weights, through the GEMM where it is built (no fp32 copy kept) and through F.linear on an fp32 copy of them
    where not."""
    from kvseal.model import quant
    gen = torch.Generator().manual_seed(7)
    w, x = 0.05 * torch.randn(64, 128, generator=gen), torch.randn(3, 128, generator=gen)
    exact = Linear(w, None, "fp32")
    assert exact.gemm is None and torch.equal(exact(x), F.linear(x, w))
    ref = F.linear(x, w.to(torch.bfloat16).float())
    rounded = Linear(w, None, "bf16")
    if rounded.gemm is not None:
        assert rounded.plain is None
        torch.testing.assert_close(rounded(x), ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(quant, "load_gemm", lambda: None)
    assert torch.equal(Linear(w, None, "bf16")(x), ref)
    with pytest.raises(ValueError, match="fp32 model"):
        Linear(w.to(torch.bfloat16), None, "fp32")


def test_gate_up_gemm_with_silu_equals_gemm_then_silu_mul(level):
    """The gate/up GEMM with SiLU(gate) * up in its epilogue (what the native layer loop runs) gives the bits
    of the GEMM followed by the fused silu_mul, for every row-count remainder and an odd number of blocks."""
    from kvseal.model.kernels import FusedOps
    gemm = Gemm(library_path(level))
    gen = torch.Generator().manual_seed(4)
    silu_mul = FusedOps(library_path(level), torch.bfloat16).silu_mul
    for inter, k in ((1536, 576), (80, 64)):
        w = (0.05 * torch.randn(2 * inter, k, generator=gen)).to(torch.bfloat16)
        if not gemm.silu_fits(w):
            pytest.skip(f"the fused gate/up GEMM is built at the avx512_bf16 and amx_bf16 levels only (this is {level})")
        packed = gemm.pack(w)
        for rows in (1, 2, 3, 4, 5, 6, 7, 13, 50, 64):
            x = (2 * torch.randn(rows, k, generator=gen)).to(torch.bfloat16)
            assert torch.equal(gemm.silu(x, packed, inter), silu_mul(gemm(x, packed, 2 * inter))), (inter, rows)


_THREADS_SCRIPT = """
import os, sys
import torch
sys.path.insert(0, "tests")
from engine_util import generate
from kvseal.engine.build import WorkerSpec, build_engine
before = len(os.listdir("/proc/self/task"))
engine, lm, _ = build_engine(WorkerSpec(weights="int4", kv_pool_tokens=4096, context=2048))
generate(engine, [list(range(100, 140))], 4)
print(len(os.listdir("/proc/self/task")) - before, torch.get_num_threads())
engine.stop()
"""


def test_packing_weights_leaves_the_main_thread_without_an_openmp_team():
    """Packing int4 weights runs off the main thread. An OpenMP team on the main thread beside the engine's makes
    libgomp throttle the engine's spin-wait (measured: batch-1 steps 2x slower); a team shows up as one more OS
    thread. A fresh process: the engine thread and its team's workers are all that may appear."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    added, omp = int(out[-2]), int(out[-1])
    assert added == 1 + (omp - 1), f"{added} threads appeared; expected the engine thread and {omp - 1} OpenMP workers"
