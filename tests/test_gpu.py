"""What of the GPU path runs here, with no GPU: the Triton paged-attention kernels (kvseal.model.triton_attention)
held equal to the plain-PyTorch path on the CPU through Triton's interpreter (decode rows and prefill chunks,
fragmented page tables, lengths that end mid-page over stale slots holding large values, grouped-query heads,
fp32 and bf16, the default model end to end), bench/gpu.py's checks, and ``--device cuda``'s refusals."""

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # as triton and the kernels load: they are built to run on the CPU, in NumPy
pytest.importorskip("triton")

from triton.runtime import interpreter

from kvseal.model.attention import DecodeRows, PagedAttention, Span
from kvseal.model.triton_attention import INTERPRETED, TritonAttention

del os.environ["TRITON_INTERPRET"]  # not for the servers other tests start; set again while these run
assert INTERPRETED, "kvseal.model.triton_attention was imported before this module, built for a GPU"

_patch_lang_tensor = interpreter._patch_lang_tensor


def _index_as_scalar(tensor: object, scope: object) -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with ``int(array)``, which NumPy 2.4 refuses for
    a one-element array (triton-lang/triton#9171, fixed upstream the same way): any ``range(n)`` over a
    runtime argument fails. Only the interpreter is patched; compiled kernels never run this."""
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))


interpreter._patch_lang_tensor = _index_as_scalar


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter reads it at each launch too


PS, D, LAYERS = 16, 64, 2


def pool_and_tables(lens: list[int], kvh: int, dtype: torch.dtype, gen: torch.Generator):
    """A pool of random pages, each request's pages scattered through it; every slot past a request's length
    holds large values (another request's stale bytes), so reading one shows in the result."""
    n_pages = sum(-(-n // PS) for n in lens) + 5
    kv = torch.randn(n_pages, LAYERS, 2, kvh, PS, D, generator=gen)
    perm = torch.randperm(n_pages, generator=gen).tolist()
    width = max(-(-n // PS) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    for b, n in enumerate(lens):
        pages = [perm.pop() for _ in range(-(-n // PS))]
        tables[b, : len(pages)] = torch.tensor(pages)
        tables[b, len(pages):] = perm[0]  # padding entries name some other page: never read past the length
        if n % PS:
            kv[pages[-1], :, :, :, n % PS:] = 1e3
    return kv.to(dtype), tables


def fresh_kv(kv: torch.Tensor, pages: torch.Tensor, layer: int, pos: range) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's keys and values [T, KVH, D], read back from the slots of positions ``pos``."""
    slots = [(int(pages[x // PS]), x % PS) for x in pos]
    k = torch.stack([kv[p, layer, 0, :, o] for p, o in slots])
    v = torch.stack([kv[p, layer, 1, :, o] for p, o in slots])
    return k, v


@pytest.mark.parametrize("heads,kvh", [(9, 3), (4, 4), (8, 2)], ids=["gqa3", "mha", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_rows_read_in_place_equal_the_reference(heads, kvh, dtype):
    gen = torch.Generator().manual_seed(heads * 10 + kvh)
    lens = [1, 16, 17, 40, 5]
    kv, tables = pool_and_tables(lens, kvh, dtype, gen)
    q = torch.randn(len(lens), heads, D, generator=gen).to(dtype)
    rows = DecodeRows(tables, torch.tensor(lens))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for layer in range(LAYERS):
        plain = PagedAttention(kv.float(), rows, [])(layer, q.float(), None, None)
        fast = PagedAttention(kv, rows, [], kernel=TritonAttention())
        assert fast.kernel is not None
        got = fast(layer, q, None, None)
        assert got.dtype == dtype and got.shape == (len(lens), heads * D)
        torch.testing.assert_close(got.float(), plain, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_chunks_and_decode_rows_in_one_step_equal_the_reference(dtype):
    """A step of two decode rows, a first chunk (positions 0..12) and a later chunk (20..39, its earlier
    context in the pool): each token sees its own positions and earlier ones only."""
    heads, kvh = 9, 3
    gen = torch.Generator().manual_seed(7)
    lens = [23, 3, 13, 40]  # two decode rows; the chunks' requests end at 13 and 40
    kv, tables = pool_and_tables(lens, kvh, dtype, gen)
    spans = [Span(2, 13, 0, tables[2, :1]), Span(15, 20, 20, tables[3, :3])]
    rows = DecodeRows(tables[:2, :2], torch.tensor(lens[:2]))
    q = torch.randn(35, heads, D, generator=gen).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for layer in range(LAYERS):
        k = torch.zeros(35, kvh, D, dtype=dtype)
        v = torch.zeros_like(k)
        for s in spans:
            k[s.start: s.start + s.n], v[s.start: s.start + s.n] = fresh_kv(kv, s.pages, layer, range(s.pos0, s.pos0 + s.n))
        plain = PagedAttention(kv.float(), rows, spans)(layer, q.float(), k.float(), v.float())
        fast = PagedAttention(kv, rows, spans, kernel=TritonAttention())
        got = fast(layer, q, k, v)
        assert fast.in_place, "the chunks went through the kernel"
        torch.testing.assert_close(got.float(), plain, atol=tol, rtol=tol)


def test_a_stale_slot_read_shows_in_the_result():
    """The check above can fail: a kernel that ignored the length (read a whole last page) is far off."""
    gen = torch.Generator().manual_seed(3)
    kv, tables = pool_and_tables([17], 3, torch.float32, gen)
    q = torch.randn(1, 9, D, generator=gen)
    right = TritonAttention()(q, kv, 0, tables, torch.tensor([17]))
    whole_pages = TritonAttention()(q, kv, 0, tables, torch.tensor([32]))
    assert (right - whole_pages).abs().max() > 1.0


def test_pages_it_cannot_tile_are_left_to_the_plain_path():
    kv = torch.zeros(4, 1, 2, 1, 12, D)  # 12-slot pages: not a power of two
    assert not TritonAttention().fits(kv)
    assert PagedAttention(kv, None, [], kernel=TritonAttention()).kernel is None


def test_the_model_generates_the_same_tokens_through_the_kernels(fp32_model):
    """The default model, its pool written by the engine as in serving, attention through the Triton kernels
    (the rest of the forward as on this CPU, the native layer loop off): greedy tokens and logits as the plain
    path's. A prefill chunk, then decode rows."""
    from engine_util import generate, make_engine

    from kvseal.model.loader import load

    lm = load(None, torch.float32, progress=False)
    lm.model.native = None  # the native loop has its own attention; the GPU has none of it
    ids = fp32_model.tokenizer.encode("The capital of France is", add_special_tokens=False)  # short: interpreted
    plain = make_engine(lm, pages=64)
    try:
        want = generate(plain, [ids], 3)
    finally:
        plain.stop()
    calls = {"decode": 0, "prefill": 0}

    class Counted(TritonAttention):
        def __call__(self, *a):
            calls["decode"] += 1
            return super().__call__(*a)

        def prefill(self, *a):
            calls["prefill"] += 1
            return super().prefill(*a)

    lm.model.decode_kernel = Counted()
    fast = make_engine(lm, pages=64)
    try:
        got = generate(fast, [ids], 3)
    finally:
        fast.stop()
    layers = lm.model.cfg.num_layers
    assert calls == {"decode": 2 * layers, "prefill": layers}, calls  # the prompt's chunk, then two decode steps
    assert got == want and len(got[0]) == 3


def test_the_gpu_check_script_runs_its_correctness_part_here(tmp_path):
    """bench/gpu.py is the first thing to run on a GPU; its checks run here, interpreted (the transfer check on
    the staged path), and its serving part against a disaggregated server of the default model's shape, so it
    cannot rot unseen while no GPU is at hand."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "gpu.py"
    out = tmp_path / "gpu.json"
    serving = ["--serving", "smollm2-135m", "--modes", "disaggregated", "--streams", "2", "--prompt", "32",
               "--output", "8", "--shapes-dir", str(tmp_path / "shapes"), "--server-args", "--threads 1"]
    r = subprocess.run([sys.executable, str(script), "--interpret", "--out", str(out), *serving],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["correctness"][0]["in_place"] and rep["correctness"][0]["max_err"] < 0.02
    assert rep["transfer"]["write_never_landed"] == {"refused_by_checksum": True,
                                                     "pool_holds_the_first_requests_bytes": True}
    [row] = rep["serving"]
    assert row["mode"] == "disaggregated" and row["levels"][0]["output_tok_s"] > 0 and not rep["errors"]
    assert "KV pages staged through host memory" in (tmp_path / "serve-smollm2-135m-disaggregated.log").read_text()


@pytest.mark.parametrize("argv,says", [
    (["serve", "--device", "cuda"], "no CUDA device here"),
    (["decode", "--port", "1", "--device", "cuda"], "no CUDA device here"),
    (["serve", "--colocated", "--device", "cuda"], "no CUDA device here"),
    (["serve", "--colocated", "--device", "cuda", "--weights", "int8"], "no CUDA device here"),
], ids=["disaggregated", "a-worker", "colocated", "int8"])
def test_device_cuda_is_refused_where_it_cannot_run(argv, says, capsys):
    """Before anything loads, with the reason (this CPU-only PyTorch has no CUDA)."""
    from kvseal.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert says in str(e.value.code), e.value.code
