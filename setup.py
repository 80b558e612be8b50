"""Builds kvseal's native kernels (paged decode attention and the fused per-layer ops: one library with a C ABI,
loaded with ctypes); all metadata is in pyproject.toml. ``-march=native``: the library is built on the machine
that runs it, by ``pip install``. ``-ffp-contract=off``: the fused ops round where PyTorch rounds."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "kvseal.model._kernels", ["kvseal/model/csrc/decode_attention.cpp", "kvseal/model/csrc/prefill_attention.cpp",
                             "kvseal/model/csrc/gemm.cpp", "kvseal/model/csrc/layers.cpp",
                             "kvseal/model/csrc/fused.cpp"],
    depends=["kvseal/model/csrc/common.h"], language="c++",
    extra_compile_args=["-O3", "-march=native", "-fopenmp", "-std=c++17", "-ffp-contract=off"],
    extra_link_args=["-fopenmp"])])
