"""What this CPU can run, and which build of the native kernels (a *level*) to load.

The kernels in ``csrc/`` are compiled once per level by the normal install (``setup.py``), never with
``-march=native``: ``generic`` (baseline x86-64 or aarch64, vectorized by the compiler only), ``avx2``
(x86-64-v3: AVX2, FMA, F16C), ``avx512`` (x86-64-v4: AVX-512 F/BW/DQ/VL), ``avx512_bf16`` (plus AVX-512
BF16 dot products) and ``amx_bf16`` (plus AMX tiles, whose bf16 GEMM is the one change; only where Linux lends
the process the tile state). At start the process loads the highest level that this CPU runs and the install
built, as oneDNN and llama.cpp's ggml-cpu pick theirs. ``KVSEAL_ISA=LEVEL`` forces a lower one (for tests, and for
a user who hits a bug in a higher one); a level this CPU cannot run is refused with the features it lacks.
``KVSEAL_KERNELS=off`` loads none: the plain PyTorch path, which runs wherever PyTorch runs.

The level also bounds what kvseal asks of PyTorch: oneDNN's prepacked bf16 weights need AVX-512 (or
AVX-NE-CONVERT), and ``--dtype auto`` computes in bf16 only where the CPU has native bf16 dot products
(AVX-512 BF16 or AMX on x86, the BF16 extension on Arm), in fp32 elsewhere.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvseal.config import WorkerSpec

# level -> the /proc/cpuinfo flags it needs, per architecture, lowest first: everything its -march lets the
# compiler emit (x86-64-v3 also allows BMI1/2, MOVBE and LZCNT, listed as "abm"; v4 adds AVX-512 CD)
_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
LEVELS: dict[str, dict[str, tuple[str, ...]]] = {
    "x86_64": {"generic": (), "avx2": _V3, "avx512": _V4, "avx512_bf16": (*_V4, "avx512_bf16"),
               "amx_bf16": (*_V4, "avx512_bf16", "amx_tile", "amx_bf16")},
    "aarch64": {"generic": ()},
}


# level -> the compiler flags setup.py builds it with (tests/test_native.py builds the kernel checks with them)
BUILD_FLAGS: dict[str, dict[str, list[str]]] = {
    "x86_64": {
        "generic": ["-march=x86-64"],
        "avx2": ["-march=x86-64-v3"],
        "avx512": ["-march=x86-64-v4"],
        "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16"],
        "amx_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
    },
    "aarch64": {"generic": ["-march=armv8-a"]},
}
COMMON_FLAGS = ["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off", "-mtune=generic"]


class LevelError(ValueError):
    """A forced kernel level this machine cannot run (or that does not exist, or was not built)."""


def arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 ``flags``, Arm ``Features``); empty if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "CPU part"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


AMX = ("amx_tile", "amx_bf16")


def _request_amx() -> int:
    """Asks Linux to lend this process the AMX tile registers (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, Linux 5.16 on): 0 when it does, else the errno."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.syscall(158, 0x1023, 18) == 0 else ctypes.get_errno()  # SYS_arch_prctl on x86-64


@functools.cache
def amx() -> str:
    """``absent`` (the CPU has no AMX), ``granted``, or ``refused ...``: a CPU's AMX flags are a promise only
    once Linux lends the process the tile state, which an older kernel or a sandbox filtering the call does not
    (the kernels would then fall back to AVX-512 BF16 inside the GEMM, unsaid)."""
    if arch() != "x86_64" or not set(AMX) <= cpu_flags():
        return "absent"
    err = _request_amx()
    return "granted" if err == 0 else f"refused by Linux (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(err)})"


def usable_flags() -> frozenset[str]:
    """``cpu_flags()``, less AMX where Linux does not lend this process the tiles."""
    flags = cpu_flags()
    return flags - set(AMX) if amx().startswith("refused") else flags


def levels(machine: str | None = None) -> dict[str, tuple[str, ...]]:
    return LEVELS.get(machine or arch(), {"generic": ()})


def runnable(flags: frozenset[str], machine: str | None = None) -> list[str]:
    """Levels (lowest first) whose every feature is in ``flags``."""
    return [name for name, need in levels(machine).items() if set(need) <= flags]


def check_level(level: str, flags: frozenset[str], machine: str | None = None) -> None:
    """Raise ``LevelError`` naming what is wrong if this CPU cannot run ``level``."""
    known = levels(machine)
    if level not in known:
        raise LevelError(f"KVSEAL_ISA={level}: not a kernel level of {machine or arch()} (levels: {', '.join(known)})")
    missing = [f for f in known[level] if f not in flags]
    if missing:
        raise LevelError(f"KVSEAL_ISA={level}: this CPU lacks {', '.join(missing)} (it runs: "
                         f"{', '.join(runnable(flags, machine))})")


def library_for(level: str) -> str | None:
    spec = importlib.util.find_spec(f"kvseal.model._kernels_{level}")
    return spec.origin if spec is not None else None


def built() -> list[str]:
    return [lv for lv in levels() if library_for(lv) is not None]


@dataclass(frozen=True)
class Choice:
    """The kernel level this process uses (``None``: plain PyTorch), and why."""

    level: str | None
    ceiling: str  # the highest level kvseal lets itself (and oneDNN) use: the forced one, or the CPU's best
    reason: str

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware, as far as the ceiling allows."""
        if arch() == "aarch64":
            return "bf16" in cpu_flags()
        return self.ceiling in ("avx512_bf16", "amx_bf16")

    @property
    def onednn_bf16(self) -> bool:
        """Whether oneDNN's bf16 weight prepack runs here (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
        return (self.ceiling.startswith("avx512") or self.ceiling == "amx_bf16"
                or ("avx_ne_convert" in cpu_flags() and self.ceiling != "generic"))


@functools.cache
def choice() -> Choice:
    """Reads ``KVSEAL_ISA`` and ``KVSEAL_KERNELS`` once per process; raises ``LevelError`` on a bad level."""
    flags, have = usable_flags(), built()
    runs = runnable(flags)
    forced = os.environ.get("KVSEAL_ISA")
    if forced:
        check_level(forced, cpu_flags())
        if forced not in runs:  # the CPU has it, Linux does not lend it
            raise LevelError(f"KVSEAL_ISA={forced}: this CPU has AMX, but its tile state was {amx()}")
        ceiling = forced
    else:
        ceiling = runs[-1] if runs else "generic"
    if os.environ.get("KVSEAL_KERNELS", "on") == "off":
        return Choice(None, ceiling, "KVSEAL_KERNELS=off: plain PyTorch")
    if forced:
        if forced not in have:
            raise LevelError(f"KVSEAL_ISA={forced}: the install did not build that level (built: "
                             f"{', '.join(have) or 'none'})")
        return Choice(forced, ceiling, f"forced by KVSEAL_ISA={forced}")
    usable = [lv for lv in runs if lv in have]
    if not usable:
        return Choice(None, ceiling, "no native kernels were built (no C++ compiler at install?): plain PyTorch")
    best = usable[-1]
    why = "the best this CPU runs" if best == runs[-1] else f"the best built ({runs[-1]} was not built)"
    if amx().startswith("refused"):
        why += f"; not amx_bf16: AMX tile state {amx()}"
    return Choice(best, ceiling, why)


def resolve_dtype(dtype: str) -> tuple[str, str]:
    """``--dtype`` → (the dtype, why); ``auto`` is bf16 where the CPU has native bf16 dot products."""
    if dtype != "auto":
        return dtype, "asked for"
    if choice().native_bf16:
        return "bf16", "auto: this CPU has bf16 dot products"
    return "fp32", "auto: no bf16 dot products on this CPU (fp32 compute)"


def resolve_weights(weights: str, dtype_flag: str) -> str:
    """``--weights auto``: bf16 storage, except with an explicit ``--dtype fp32`` (exact fp32 weights)."""
    if weights != "auto":
        return weights
    return "fp32" if dtype_flag in ("fp32", "float32") else "bf16"


def resolve(spec: WorkerSpec) -> tuple[str, str]:
    """The worker's (dtype, weight mode) once ``auto`` is decided for this CPU (or GPU); raises ValueError on a
    pair that cannot run (fp32 weights in a bf16 model) or a device this host does not have."""
    dtype = resolve_dtype(spec.dtype)[0]
    weights = resolve_weights(spec.weights, spec.dtype)
    if spec.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            build = "built without CUDA" if torch.version.cuda is None else "no GPU visible"
            raise ValueError(f"--device cuda: no CUDA device here (torch {torch.__version__}, {build})")
        dtype = "bf16" if spec.dtype == "auto" else dtype  # every CUDA GPU kvseal targets has bf16 matrix units
        if weights in ("int8", "int4"):
            raise ValueError(f"--weights {weights} runs on the CPU only (its kernels are the CPU's)")
    if weights == "fp32" and dtype != "fp32":
        raise ValueError(f"--weights fp32 needs --dtype fp32 (the model computes in {dtype})")
    return dtype, weights
