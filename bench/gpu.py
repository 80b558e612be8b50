"""The first GPU check: the Triton paged-attention kernels compiled on the device, kvseal's engine and its
staged KV transfer there, each held equal to a reference; then the kernels' speed and serving under load.

    python bench/gpu_carry.py                # here: the wheels and shapes a GPU machine with no network lacks
    python bench/gpu.py                      # on a CUDA machine: JSON to stdout and bench/out/gpu.json
    python bench/gpu.py --interpret          # the checks only, small, on the CPU (Triton's interpreter)

It needs torch, triton, transformers and this repository (run from its root), and kvseal's other dependencies:
``bench/gpu_carry.py`` downloads wheels of those the device image lacks, and writes the config-only
checkpoints the serving part loads with dummy weights (docs/gpu.md says how to carry them). Each part that
fails is recorded under ``errors`` and the next still runs; the report is written after every part.

- **Correctness**, per model shape (SmolLM2-135M 9/3 heads of 64; Llama-3.2-1B 32/8 of 64; Llama-3.1-8B 32/8
  of 128) in bf16: decode rows with mixed lengths over fragmented page tables whose stale tails hold large values,
  and a prefill chunk after earlier context, against ``PagedAttention``'s plain path run on the CPU in fp32 over
  the same pool. ``max_err`` is the largest absolute difference; ``ok`` is ``max_err < 0.02`` (bf16 rounding).
- **Engine**: kvseal's engine on the device (``LlamaModel.to_device``, the pool there) against transformers on
  the same device, fp32, a random Llama with wide weights: the same greedy tokens for prompts decoded together.
- **Transfer**: pages from one pool on the device to another through host memory, as the disaggregated workers
  move them (kvseal.transfer.staging): checksums equal, other pages untouched; a write that never lands is
  refused by the checksum. On the device it also times one 256-page staged transfer of the 8B shape.
- **Speed** (not with ``--interpret``): one layer's decode attention at 1, 32 and 256 rows of 512 tokens each.
  ``bytes`` counts the keys and values read (the lower bound on traffic); ``of_peak`` divides the achieved rate
  by ``--peak-gbs`` (the H200's 4,800 GB/s by default; give the copy bandwidth measured on the card instead).
- **Prefill speed** (not with ``--interpret``): one chunk of 512 tokens from position 0, per shape, in TFLOP/s
  of the causal products (compare with the card's TF32 rate: the block's products run TF32).
- **Serving** (``--serving``; by default every shape on a GPU, none with ``--interpret``): ``kvseal serve
  --device cuda``, colocated and disaggregated, dummy weights, at 1, 32 and 256 streams of 512-token prompts
  and 64 new tokens: output tok/s, TTFT and ITL (p50/p99), one server at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128)}
PS = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="run the kernels in Triton's interpreter on the CPU")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the card's memory bandwidth, GB/s")
    ap.add_argument("--out", default=str(ROOT / "bench/out/gpu.json"))
    ap.add_argument("--serving", default=None, metavar="SHAPE[,SHAPE]",
                    help="shapes to serve under load (default: all three on a GPU, none with --interpret)")
    ap.add_argument("--modes", default="colocated,disaggregated")
    ap.add_argument("--streams", default="1,32,256")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64, help="new tokens per request")
    ap.add_argument("--shapes-dir", default=str(ROOT / ".gpu-shapes"),
                    help="config-only checkpoints (bench/gpu_carry.py writes them; bench/shapes.py DIR)")
    ap.add_argument("--server-args", default="", help="more flags for every kvseal serve it starts")
    a = ap.parse_args()
    if a.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton loads: the kernels are built for the interpreter
    sys.path.insert(0, str(ROOT))
    import torch

    if a.interpret:
        _interpreter_fix()
    from kvseal.model.triton_attention import TritonAttention

    device = "cpu" if a.interpret else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --interpret for the CPU check")
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
              "torch": torch.__version__, "triton": __import__("triton").__version__,
              "correctness": [], "speed": [], "prefill_speed": [], "serving": [], "errors": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def section(name: str, fn: Callable[[], None]) -> None:
        """One part; its failure is recorded and the next part still runs (a device's time is scarce), and the
        report so far is written after each, so a run cut off still leaves what it measured."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded in the report, which then says ok: false
            report["errors"][name] = f"{type(e).__name__}: {e}"[-3000:]
        out.write_text(json.dumps(report, indent=1) + "\n")

    kernel = TritonAttention()
    sizes = {"rows": [1, 16, 17, 5], "chunk": (20, 13)} if a.interpret else \
        {"rows": [1, 15, 16, 17, 100, 511, 512, 300], "chunk": (200, 137)}
    shapes = {"smollm2-135m": SHAPES["smollm2-135m"]} if a.interpret else SHAPES
    for name, (heads, kvh, dim) in shapes.items():
        section(f"correctness {name}", lambda name=name, heads=heads, kvh=kvh, dim=dim: report["correctness"].append(
            {"shape": name, **check(kernel, heads, kvh, dim, sizes, device, torch)}))
    section("engine", lambda: report.__setitem__("engine", engine_check(device, a.interpret, torch)))
    section("transfer", lambda: report.__setitem__("transfer", transfer_check(device, a.interpret, torch)))
    if not a.interpret:
        for name, (heads, kvh, dim) in SHAPES.items():
            for rows in (1, 32, 256):
                section(f"speed {name} {rows}", lambda name=name, heads=heads, kvh=kvh, dim=dim, rows=rows:
                        report["speed"].append({"shape": name, "rows": rows, **speed(kernel, heads, kvh, dim, rows,
                                                                                       512, a.peak_gbs, torch)}))
            section(f"prefill_speed {name}", lambda name=name, heads=heads, kvh=kvh, dim=dim: report[
                "prefill_speed"].append({"shape": name, **prefill_speed(kernel, heads, kvh, dim, 512, torch)}))
    wanted = a.serving if a.serving is not None else ("" if a.interpret else ",".join(SHAPES))
    for name in [x for x in wanted.split(",") if x]:
        for mode in a.modes.split(","):
            section(f"serving {name} {mode}", lambda name=name, mode=mode: report["serving"].append(
                serving(a, name, mode, device)))
    report["ok"] = (not report["errors"] and all(c["ok"] for c in report["correctness"])
                    and report.get("engine", {}).get("ok", False) and report.get("transfer", {}).get("ok", False))
    text = json.dumps(report, indent=1)
    print(text)
    out.write_text(text + "\n")
    return 0 if report["ok"] else 1


def serving(a: argparse.Namespace, shape: str, mode: str, device: str) -> dict:
    """``kvseal serve`` on ``device`` (``--colocated`` or disaggregated on this one host), dummy weights of a
    config-only checkpoint of ``shape``, then ``a.streams`` concurrent streams of ``a.prompt``-token prompts and
    ``a.output`` new tokens each, one level after another (``kvseal.bench.level``: output tok/s, TTFT and ITL
    p50/p99). The pool holds every stream's tokens. Off a GPU (``--interpret``) the disaggregated workers move
    their pages the way GPU pools do (``KVSEAL_KV_STAGING=1``). The server's log goes beside the report."""
    import asyncio
    import shlex
    import signal
    import socket
    import subprocess
    import time

    import httpx

    from kvseal.bench import level

    model = Path(a.shapes_dir) / shape
    if not (model / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "bench"))
        from shapes import write  # needs the default model's tokenizer: here, not on a GPU machine with no wheel

        write(Path(a.shapes_dir), shape)
    streams = [int(x) for x in a.streams.split(",")]
    page = 16
    tokens = max(streams) * (-(-(a.prompt + a.output + 1) // page) * page)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvseal.cli", "serve", *(["--colocated"] if mode == "colocated" else []),
            "--model", str(model), "--load-format", "dummy", "--device", device, "--port", str(port),
            "--kv-pool-tokens", str(tokens), "--context", str(-(-(a.prompt + a.output + 1) // page) * page),
            "--max-running", str(max(streams)), *shlex.split(a.server_args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)  # the server's kernels: compiled on a GPU; off one, the plain path
    if device == "cpu":
        env["KVSEAL_KV_STAGING"] = "1"
    log = Path(a.out).parent / f"serve-{shape}-{mode}.log"
    row = {"shape": shape, "mode": mode, "prompt": a.prompt, "output": a.output, "pool_tokens": tokens}
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 900:
                raise TimeoutError(f"serve not healthy in 900 s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        row["start_s"] = time.time() - t0
        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        row["levels"] = [asyncio.run(level(url, name, n, a.prompt, a.output, 1)) for n in streams]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return row


def pool(lens: list[int], kvh: int, dim: int, torch, gen):
    """One layer's pool (bf16) with each row's pages scattered through it and stale tails of large values."""
    n_pages = sum(-(-n // PS) for n in lens) + 3
    kv = torch.randn(n_pages, 1, 2, kvh, PS, dim, generator=gen)
    perm = torch.randperm(n_pages, generator=gen).tolist()
    tables = torch.full((len(lens), max(-(-n // PS) for n in lens)), perm[0], dtype=torch.int64)
    for b, n in enumerate(lens):
        pages = [perm.pop() for _ in range(-(-n // PS))]
        tables[b, : len(pages)] = torch.tensor(pages)
        if n % PS:
            kv[pages[-1], :, :, :, n % PS:] = 1e3
    return kv.to(torch.bfloat16), tables


def check(kernel, heads: int, kvh: int, dim: int, sizes: dict, device: str, torch) -> dict:
    from kvseal.model.attention import DecodeRows, PagedAttention, Span

    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    lens = sizes["rows"]
    pos0, n = sizes["chunk"]
    kv, tables = pool([*lens, pos0 + n], kvh, dim, torch, gen)
    q = torch.randn(len(lens) + n, heads, dim, generator=gen).to(torch.bfloat16)
    rows = DecodeRows(tables[: len(lens)], torch.tensor(lens))
    span = Span(len(lens), n, pos0, tables[len(lens), : -(-(pos0 + n) // PS)].contiguous())
    k = torch.stack([kv[span.pages[x // PS], 0, 0, :, x % PS] for x in range(pos0, pos0 + n)])
    v = torch.stack([kv[span.pages[x // PS], 0, 1, :, x % PS] for x in range(pos0, pos0 + n)])
    k = torch.cat([torch.zeros(len(lens), kvh, dim, dtype=k.dtype), k])
    v = torch.cat([torch.zeros(len(lens), kvh, dim, dtype=v.dtype), v])
    want = PagedAttention(kv.float(), rows, [span])(0, q.float(), k.float(), v.float())
    on = DecodeRows(rows.pages.to(device), rows.lens.to(device))
    fast = PagedAttention(kv.to(device), on, [Span(span.start, n, pos0, span.pages.to(device))], kernel=kernel)
    got = fast(0, q.to(device), k.to(device), v.to(device)).float().cpu()
    err = float((got - want).abs().max())
    return {"decode_rows": lens, "prefill_chunk": {"pos0": pos0, "tokens": n}, "in_place": bool(fast.in_place),
            "max_err": err, "ok": err < 0.02 and bool(fast.in_place) and fast.kernel is kernel}


def engine_check(device: str, interpret: bool, torch) -> dict:
    """kvseal's engine on ``device`` (``LlamaModel.to_device``, a pool there, the Triton kernels) against
    transformers on the same device, both fp32, on a random small Llama made by transformers: greedy tokens for
    a batch of prompts of mixed lengths (prefill chunks, then decode rows together). On the CPU (``--interpret``)
    the model stays there with the interpreted kernels, the same engine code otherwise."""
    import tempfile
    import threading

    import transformers

    from kvseal.config import EngineConfig, PoolConfig
    from kvseal.engine.engine import Engine
    from kvseal.engine.request import SamplingParams
    from kvseal.engine.sequence import Sequence
    from kvseal.kv.pool import PagePool
    from kvseal.model.llama import LlamaModel
    from kvseal.model.loader import _assemble, _read_hf_dir
    from kvseal.model.triton_attention import TritonAttention

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2 if
                                      interpret else 4, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=True,
                                      initializer_range=0.2)  # wide: outputs that vary, not one token repeated
    hf = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        cfg, raw = _read_hf_dir(Path(d), progress=False)
    model = LlamaModel(cfg, _assemble(cfg, raw, torch.float32), torch.float32)
    if interpret:
        model.native, model.decode_kernel = None, TritonAttention()  # the CPU's own layer loop has its own attention
    else:
        model.to_device(device)
        hf = hf.to(device)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in ((5, 19) if interpret else (5, 19, 40, 77))]
    new = 4 if interpret else 12
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), dtype=torch.int64,
                                                                                          device=device),
                            max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    pool = PagePool(PoolConfig(num_pages=64), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                    device=model.device)
    engine = Engine(EngineConfig(pool=PoolConfig(num_pages=64), dtype="fp32"), model, pool).start()
    got: list[list[int]] = [[] for _ in prompts]
    done = threading.Semaphore(0)
    try:
        for i, p in enumerate(prompts):
            def sink(ev, i=i):
                got[i].extend(ev.token_ids)
                if ev.finish_reason:
                    done.release()
            engine.submit(Sequence(100 + i, p, SamplingParams(max_tokens=new, temperature=0), sink))
        finished = all(done.acquire(timeout=300) for _ in prompts)
    finally:
        engine.stop()
    same = sum(g == w for g, w in zip(got, want))
    return {"model": f"random Llama, {cfg.num_layers} layers, 8/2 heads of 32, fp32",
            "prompts": [len(p) for p in prompts], "new_tokens": new, "same_as_transformers": f"{same} of {len(prompts)}", "kvseal": got,
            "transformers": want, "ok": finished and same == len(prompts)}


def transfer_check(device: str, interpret: bool, torch) -> dict:
    """Pages from one pool on ``device`` to another through host memory, by the code the disaggregated workers
    run (kvseal.transfer.staging): prefill's pages staged out and hashed, written by the shm transport into
    decode's landing area, taken in, and hashed again over decode's pool. Then the 2026 incident's shape: a
    second lease on the same pages whose write never lands. The landing area still holds the first request's
    bytes; the checksum must refuse them (with it off, they are what decode would attend over). On the CPU
    (``--interpret``) the same path runs with ``KVSEAL_KV_STAGING=1``."""
    import shutil
    import tempfile
    import time

    from kvseal.config import PoolConfig
    from kvseal.kv.pool import PagePool
    from kvseal.transfer import messages as P
    from kvseal.transfer import staging
    from kvseal.transfer.shm import ShmWriter

    if interpret:
        os.environ[staging.ENV] = "1"
    layers, kvh, dim = (2, 2, 64) if interpret else (32, 8, 128)  # Llama-3.1-8B's page shape on the device
    cfg = PoolConfig(num_pages=64, page_size=PS)
    shape = (cfg.num_pages, layers, 2, kvh, PS, dim)
    gen = torch.Generator().manual_seed(7)
    pre = PagePool(cfg, layers, kvh, dim, torch.bfloat16, device=device)
    pre.kv.copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as f:
        f.truncate(pre.kv[0].nbytes * cfg.num_pages)
        writer = ShmWriter()
        landing = writer.target(f.name, list(shape), torch.bfloat16)
        dec = PagePool(cfg, layers, kvh, dim, torch.bfloat16, device=device, landing=landing)
        dec.kv.copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))  # other requests' pages
        before = dec.kv.clone()
        src, dst, n = [5, 6, 7, 20], [3, 4, 9, 10], 3 * PS + 5

        def send(first_src: list[int], write: bool) -> str:
            data, at = staging.stage_out(pre.kv, first_src)
            if write:
                writer.write(data, at, f.name, list(shape), dst, transient=data is not pre.kv)
            return P.checksum(data, at, n, 1, 2, dst, [0] * len(dst), 9)

        sent = send(src, True)
        dec.take_in(dst)
        got = P.checksum(dec.kv, dst, n, 1, 2, dst, [0] * len(dst), 9)
        others = [p for p in range(cfg.num_pages) if p not in dst]
        first = {"checksum_equal": sent == got, "pages_equal": bool(torch.equal(dec.kv[dst], pre.kv[src])),
                 "other_pages_untouched": bool(torch.equal(dec.kv[others], before[others]))}
        # a second request on the same decode pages, its prompt in other prefill pages; its write never lands
        sent2 = send([30, 31, 32, 33], False)
        dec.take_in(dst)
        got2 = P.checksum(dec.kv, dst, n, 1, 2, dst, [0] * len(dst), 9)
        stale = {"refused_by_checksum": sent2 != got2,
                 "pool_holds_the_first_requests_bytes": bool(torch.equal(dec.kv[dst], pre.kv[src]))}
        out = {"first_transfer": first, "write_never_landed": stale}
        # one 256-page transfer end to end (stage out, write, take in), if the file's 1 GiB fits where it lives:
        # a write past a full tmpfs is a SIGBUS, which would end this script and every part after this one
        room = shutil.disk_usage(Path(f.name).parent).free
        out["landing_dir_free_gib"] = room / 2**30
        if not interpret and room >= 2 * 512 * pre.kv[0].nbytes:
            big = PoolConfig(num_pages=512, page_size=PS)
            bshape = (512, layers, 2, kvh, PS, dim)
            bpre = PagePool(big, layers, kvh, dim, torch.bfloat16, device=device)
            f.truncate(bpre.kv[0].nbytes * 512)
            writer2 = ShmWriter()
            bdec = PagePool(big, layers, kvh, dim, torch.bfloat16, device=device,
                            landing=writer2.target(f.name, list(bshape), torch.bfloat16))
            pages = list(range(0, 512, 2))
            for rep in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                data, at = staging.stage_out(bpre.kv, pages)
                writer2.write(data, at, f.name, list(bshape), pages, transient=True)
                bdec.take_in(pages)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            nbytes = len(pages) * bpre.kv[0].nbytes
            out["staged_256_pages"] = {"bytes": nbytes, "seconds": dt, "gb_s": nbytes / dt / 1e9}
    out["ok"] = all(first.values()) and stale["refused_by_checksum"]
    return out


def speed(kernel, heads: int, kvh: int, dim: int, rows: int, ctx: int, peak_gbs: float, torch) -> dict:
    gen = torch.Generator().manual_seed(rows)
    per_row = ctx // PS
    kv = torch.randn(rows * per_row, 1, 2, kvh, PS, dim, generator=gen).to(torch.bfloat16).cuda()
    tables = torch.randperm(rows * per_row, generator=gen).view(rows, per_row).cuda()
    lens = torch.full((rows,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, heads, dim, dtype=torch.bfloat16, device="cuda")
    us = _timed_us(lambda: kernel(q, kv, 0, tables, lens), torch)
    moved = rows * ctx * kvh * dim * 2 * 2  # keys and values, bf16
    gbs = moved / us / 1e3
    return {"ctx": ctx, "us": round(us, 2), "bytes": moved, "gbs": round(gbs, 1), "of_peak": round(gbs / peak_gbs, 3)}


def prefill_speed(kernel, heads: int, kvh: int, dim: int, tokens: int, torch) -> dict:
    """One chunk of ``tokens`` from position 0: the causal products' FLOPs over the time."""
    gen = torch.Generator().manual_seed(tokens)
    n_pages = tokens // PS
    kv = torch.randn(n_pages, 1, 2, kvh, PS, dim, generator=gen).to(torch.bfloat16).cuda()
    pages = torch.randperm(n_pages, generator=gen).cuda()
    q = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device="cuda")
    us = _timed_us(lambda: kernel.prefill(q, kv, 0, pages, 0), torch)
    flops = 2 * 2 * heads * dim * tokens * (tokens + 1) / 2  # q·k and p·v over the causal half
    return {"tokens": tokens, "us": round(us, 2), "tflops": round(flops / us / 1e6, 2)}


def _timed_us(fn, torch, reps: int = 50) -> float:
    for _ in range(3):  # compiles, then warms
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def _interpreter_fix() -> None:
    """Triton 3.6's interpreter cannot take a runtime loop bound under NumPy 2.4 (triton-lang/triton#9171); the
    same scalar conversion the upstream fix makes (tests/test_gpu.py carries the same)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def fixed(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    interpreter._patch_lang_tensor = fixed


if __name__ == "__main__":
    sys.exit(main())
