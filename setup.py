"""Builds kvseal's one native kernel (paged decode attention, a C ABI loaded with ctypes); all metadata is in
pyproject.toml. ``-march=native``: the library is built on the machine that runs it, by ``pip install``."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "kvseal.model._decode_attention", ["kvseal/model/csrc/decode_attention.cpp"], language="c++",
    extra_compile_args=["-O3", "-march=native", "-fopenmp", "-std=c++17"], extra_link_args=["-fopenmp"])])
