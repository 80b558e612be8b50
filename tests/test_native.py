"""The kernels' own checks in C++ (``tests/native/check_kernels.cpp``: each kernel against a scalar reference),
linked with the library of every level this CPU runs, and cross-compiled for aarch64 and run under
qemu-aarch64 (Debian's ``g++-aarch64-linux-gnu`` and ``qemu-user``, which ``make setup`` installs): the Arm
build is held to the same references although no Arm machine runs the suite."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import KERNEL_LEVELS

from kvseal.model import cpu

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "native" / "check_kernels.cpp"
SOURCES = sorted((ROOT / "kvseal" / "model" / "csrc").glob("*.cpp"))
# the driver itself is plain loops: -O1 (aarch64 g++ 12 hits an internal error vectorizing one of its sums)
DRIVER_FLAGS = ["-O1", "-std=c++17", "-fopenmp", "-ffp-contract=off"]


def _counts(out: str) -> tuple[int, int]:
    m = re.search(r"^(\d+) passed, (\d+) failed$", out, re.MULTILINE)
    assert m, out
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("level", KERNEL_LEVELS)
def test_native_checks_pass_at_every_level(tmp_path, level):
    exe = tmp_path / "check"
    lib = Path(cpu.library_for(level))
    subprocess.run(["g++", *DRIVER_FLAGS, str(DRIVER), str(lib), f"-Wl,-rpath,{lib.parent}", "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, check=False)
    passed, failed = _counts(r.stdout)
    assert f"kernels built for level {level}" in r.stdout
    assert failed == 0 and r.returncode == 0, r.stdout
    assert passed >= 16, r.stdout  # decode x10, norm, rope, silu x2 each; the GEMM and prefill where built


@pytest.mark.skipif(cpu.arch() != "x86_64", reason="cross-compiles from x86-64")
def test_the_aarch64_build_passes_the_same_checks_under_qemu(tmp_path):
    gxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    assert gxx and qemu, "make setup installs g++-aarch64-linux-gnu and qemu-user"
    flags = cpu.COMMON_FLAGS + cpu.BUILD_FLAGS["aarch64"]["generic"] + ['-DKVSEAL_LEVEL="generic"', "-fPIC"]
    objs = []
    for src in SOURCES:
        objs.append(tmp_path / f"{src.stem}.o")
        subprocess.run([gxx, "-c", *flags, str(src), "-o", str(objs[-1])], check=True, capture_output=True, timeout=300)
    exe = tmp_path / "check"
    subprocess.run([gxx, *DRIVER_FLAGS, "-march=armv8-a", str(DRIVER), *map(str, objs), "-o", str(exe)], check=True,
                   capture_output=True, timeout=300)
    r = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", str(exe)], capture_output=True, text=True, timeout=300,
                       check=False)
    passed, failed = _counts(r.stdout)
    assert failed == 0 and r.returncode == 0 and passed >= 16, r.stdout
