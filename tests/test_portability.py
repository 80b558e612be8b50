"""kvseal runs on every CPU it meets: kernel levels chosen from the CPU's features (and forced lower with
KVSEAL_ISA), refused with the missing features named, never a library with instructions above its level, an
install that succeeds without a compiler, ``--dtype auto``, and a server that answers at the AVX2 level with
oneDNN held to AVX2 as well (what an AVX2-only machine such as a Zen 1 EPYC offers)."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import KERNEL_LEVELS, MODEL, Server

from kvseal.model import cpu
from kvseal.model.quant import prepack

ROOT = Path(__file__).resolve().parent.parent
ZEN1 = frozenset({"fpu", "sse2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "sha_ni"})  # an AVX2-only EPYC, as /proc/cpuinfo lists it


@pytest.fixture
def fresh_choice(monkeypatch):
    """Lets a test set KVSEAL_ISA / KVSEAL_KERNELS for this process's choice, and restores it after."""
    cpu.choice.cache_clear()
    monkeypatch.delenv("KVSEAL_ISA", raising=False)  # the suite may run with a level forced
    monkeypatch.delenv("KVSEAL_KERNELS", raising=False)
    yield monkeypatch
    monkeypatch.undo()
    cpu.choice.cache_clear()
    cpu.amx.cache_clear()


def test_levels_follow_the_cpu_features():
    assert cpu.runnable(ZEN1, "x86_64") == ["generic", "avx2"]
    zen4 = ZEN1 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"}
    assert cpu.runnable(ZEN1 - {"bmi2"}, "x86_64") == ["generic"]  # x86-64-v3 code may use BMI2
    assert cpu.runnable(zen4, "x86_64") == ["generic", "avx2", "avx512", "avx512_bf16"]
    assert cpu.runnable(zen4 - {"avx512_bf16"}, "x86_64")[-1] == "avx512"  # Skylake-X .. Ice Lake
    assert cpu.runnable(zen4 | {"amx_tile", "amx_bf16"}, "x86_64")[-1] == "amx_bf16"  # Sapphire Rapids on
    assert cpu.runnable(zen4 | {"amx_tile"}, "x86_64")[-1] == "avx512_bf16"
    assert cpu.runnable(frozenset({"asimd"}), "aarch64") == ["generic"]


@pytest.mark.parametrize("errno_", [0, errno.EPERM, errno.EINVAL])
def test_amx_is_used_only_where_linux_lends_the_tiles(fresh_choice, errno_):
    """A CPU with AMX whose kernel refuses the process the tile state (before Linux 5.16, or a sandbox filtering
    arch_prctl): the choice stays at avx512_bf16 and says why, and a forced amx_bf16 is refused at start."""
    xeon = ZEN1 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", *cpu.AMX}
    fresh_choice.setattr(cpu, "arch", lambda: "x86_64")
    fresh_choice.setattr(cpu, "cpu_flags", lambda: xeon)
    fresh_choice.setattr(cpu, "built", lambda: list(cpu.levels("x86_64")))
    fresh_choice.setattr(cpu, "_request_amx", lambda: errno_)
    cpu.amx.cache_clear()
    c = cpu.choice()
    if errno_ == 0:
        assert (cpu.amx(), c.level, c.reason) == ("granted", "amx_bf16", "the best this CPU runs")
        return
    assert cpu.amx().startswith("refused by Linux") and os.strerror(errno_) in cpu.amx()
    assert c.level == c.ceiling == "avx512_bf16" and "not amx_bf16: AMX tile state refused" in c.reason
    assert cpu.runnable(cpu.usable_flags())[-1] == "avx512_bf16"
    fresh_choice.setenv("KVSEAL_ISA", "amx_bf16")
    cpu.choice.cache_clear()
    with pytest.raises(cpu.LevelError, match="KVSEAL_ISA=amx_bf16: this CPU has AMX, but its tile state was refused"):
        cpu.choice()


def test_a_level_the_cpu_cannot_run_is_refused_naming_what_it_lacks():
    with pytest.raises(cpu.LevelError, match="lacks avx512f, avx512bw, avx512cd, avx512dq, avx512vl, avx512_bf16"):
        cpu.check_level("avx512_bf16", ZEN1, "x86_64")
    with pytest.raises(cpu.LevelError, match="not a kernel level of x86_64"):
        cpu.check_level("neon", ZEN1, "x86_64")
    cpu.check_level("avx2", ZEN1, "x86_64")


def _kvseal(*args: str, **env: str) -> subprocess.CompletedProcess:
    """kvseal with exactly the given KVSEAL_ISA / KVSEAL_KERNELS (not those the suite may run with)."""
    base = {k: v for k, v in os.environ.items() if k not in ("KVSEAL_ISA", "KVSEAL_KERNELS")}
    return subprocess.run([sys.executable, "-m", "kvseal.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**base, **env}, cwd=ROOT, check=False)


def test_env_reports_the_forced_level_and_auto_dtype():
    if "avx2" not in KERNEL_LEVELS:
        pytest.skip("this CPU does not run the avx2 level")
    f = json.loads(_kvseal("env", "--json", KVSEAL_ISA="avx2").stdout)
    assert (f["kernels"], f["forced"], f["dtype"], f["weights"]) == ("avx2", "avx2", "fp32", "bf16")
    assert f["onednn_bf16"] is False and "avx2" in f["features"] and f["compiler"]
    top = json.loads(_kvseal("env", "--json").stdout)
    assert top["kernels"] == KERNEL_LEVELS[-1] and top["forced"] is None
    assert top["amx"] == cpu.amx() and (top["amx"] == "absent") == (not set(cpu.AMX) <= cpu.cpu_flags())
    assert cpu._request_amx() != 0 or set(cpu.AMX) <= cpu.cpu_flags()  # the real call: no tiles lent without AMX
    assert top["dtype"] == ("bf16" if "avx512_bf16" in cpu.cpu_flags() or "amx_bf16" in cpu.cpu_flags() else "fp32")
    import torch

    assert top["torch_cuda"] == torch.version.cuda and top["gpus"] == [] and top["triton"] == _dist("triton")


def _dist(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


@pytest.mark.parametrize("cmd", [["env"], ["serve", "--colocated"], ["decode", "--port", "1"]])
def test_a_bad_level_stops_the_start_with_one_line(cmd):
    r = _kvseal(*cmd, KVSEAL_ISA="avx9")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().endswith("KVSEAL_ISA=avx9: not a kernel level of x86_64 (levels: generic, avx2, avx512, "
                                     "avx512_bf16, amx_bf16)") or cpu.arch() != "x86_64"
    assert len(r.stderr.strip().splitlines()) == 1


def test_fp32_weights_in_a_bf16_model_are_refused_at_start():
    r = _kvseal("serve", "--colocated", "--dtype", "bf16", "--weights", "fp32")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--weights fp32 needs --dtype fp32" in r.stderr


def test_auto_dtype_and_onednn_follow_the_level(fresh_choice):
    import torch
    if "avx2" not in KERNEL_LEVELS:
        pytest.skip("this CPU does not run the avx2 level")
    fresh_choice.setenv("KVSEAL_ISA", "avx2")
    assert cpu.resolve_dtype("auto")[0] == "fp32" and cpu.resolve_dtype("bf16")[0] == "bf16"
    assert cpu.resolve_weights("auto", "auto") == "bf16" and cpu.resolve_weights("auto", "fp32") == "fp32"
    # oneDNN's bf16 reorder dies on AVX2-only CPUs: kvseal never asks for it below AVX-512
    assert prepack(torch.zeros(32, 32, dtype=torch.bfloat16)) is None


def test_no_built_library_means_plain_pytorch_said_so(fresh_choice):
    fresh_choice.setattr(cpu, "built", list)
    c = cpu.choice()
    assert c.level is None and "plain PyTorch" in c.reason
    fresh_choice.setenv("KVSEAL_ISA", "generic")
    cpu.choice.cache_clear()
    with pytest.raises(cpu.LevelError, match="did not build"):
        cpu.choice()


def test_the_install_succeeds_without_a_compiler(tmp_path):
    """Every level is optional: with a compiler that always fails, setup.py still exits 0 and builds nothing."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "kvseal" / "model" / "csrc", tmp_path / "kvseal" / "model" / "csrc")
    shutil.copy(ROOT / "kvseal" / "model" / "cpu.py", tmp_path / "kvseal" / "model" / "cpu.py")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "CC": "/bin/false", "CXX": "/bin/false"}, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "failed" in r.stderr and not list(tmp_path.rglob("*.so"))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_no_library_holds_instructions_above_its_level():
    """What -march=native would break: the generic build has no AVX, the avx2 build no AVX-512, only the
    avx512_bf16 build has bf16 dot products."""
    banned = {"generic": ("ymm", "zmm"), "avx2": ("zmm",), "avx512": ("vdpbf16ps", "vcvtne2ps2bf16", "vcvtneps2bf16")}
    for level, words in banned.items():
        path = cpu.library_for(level)
        if path is None:
            continue
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                              check=True).stdout
        found = [w for w in words if w in text]
        assert not found, f"{level} build uses {found}"


def test_a_server_at_the_avx2_level_answers():
    """The AVX2 level serves with fp32 compute over bf16 weights, oneDNN held to AVX2 too (its bf16 reorder,
    which killed start-up on an AVX2-only EPYC, is never asked for), through the official client."""
    if "avx2" not in KERNEL_LEVELS:
        pytest.skip("this CPU does not run the avx2 level")
    from openai import OpenAI
    env = {"KVSEAL_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    s = Server(["serve", "--colocated", "--kv-pool-tokens", "4096", "--context", "2048"], env=env)
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="none")
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      max_tokens=12, temperature=0)
        assert "Paris" in r.choices[0].message.content
    finally:
        s.stop()
    log = s.proc.stdout.read()
    assert "kernels avx2 (forced by KVSEAL_ISA=avx2)" in log and "dtype fp32 (auto" in log and "weights bf16" in log


def test_workers_that_compute_in_different_dtypes_refuse_the_transfer_by_name():
    """``--dtype auto`` can pick bf16 on one host and fp32 on another: the lease carries the decode pool's dtype
    and prefill refuses to write into a pool of another type, naming it (the checksum would catch the bytes
    anyway, as a bare integrity failure), and no page stays taken."""
    from conftest import Trio, complete, wait_pages_back
    worker = ["--kv-pool-tokens", "4096", "--context", "2048"]
    with Trio(worker, prefill=["--dtype", "bf16"], decode=["--dtype", "fp32"]) as t:
        r = complete(t.url, "One, two,")
        assert r.status_code >= 500 and "decode pool holds float32, this worker computes bfloat16" in r.text, r.text
        wait_pages_back(t.dec)
