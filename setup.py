"""Builds kvseal's native kernels once per instruction-set level (``kvseal/model/_kernels_<level>``: one
library with a C ABI each, loaded with ctypes; ``kvseal.model.cpu`` picks one at run time from the CPU's
features). All metadata is in pyproject.toml.

Never tuned to the build machine (no native -march): a library built on one x86-64 machine must load on any other, so each level names
its instructions (x86-64-v3 for AVX2 + FMA, x86-64-v4 for AVX-512, plus AVX-512 BF16; the table is
``kvseal.model.cpu.BUILD_FLAGS``) and ``-mtune=generic``.
Every level is optional: without a C++ compiler (or one too old for a level's flags) the install still
succeeds and kvseal runs plain PyTorch or the levels that did build. ``-ffp-contract=off``: the fused ops
round where PyTorch rounds."""

import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# the level tables live in kvseal/model/cpu.py (standard library only), loaded by path: the package's
# dependencies are not installed yet when this runs
_spec = importlib.util.spec_from_file_location("_kvseal_cpu", os.path.join("kvseal", "model", "cpu.py"))
cpu = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cpu  # dataclasses look their module up there
_spec.loader.exec_module(cpu)

SOURCES = ["kvseal/model/csrc/decode_attention.cpp", "kvseal/model/csrc/prefill_attention.cpp",
           "kvseal/model/csrc/gemm.cpp", "kvseal/model/csrc/layers.cpp", "kvseal/model/csrc/fused.cpp",
           "kvseal/model/csrc/info.cpp"]


class PerLevelBuild(build_ext):
    """The levels compile the same sources with different flags: each gets its own object directory, so one
    level's objects are never linked into another's library."""

    def build_extension(self, ext: Extension) -> None:
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rsplit("_kernels_", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


setup(
    ext_modules=[Extension(f"kvseal.model._kernels_{name}", SOURCES, depends=["kvseal/model/csrc/common.h"],
                           language="c++", extra_compile_args=cpu.COMMON_FLAGS + flags, extra_link_args=["-fopenmp"],
                           define_macros=[("KVSEAL_LEVEL", f'"{name}"')], optional=True)
                 for name, flags in cpu.BUILD_FLAGS.get(cpu.arch(), {"generic": []}).items()],
    cmdclass={"build_ext": PerLevelBuild},
)
