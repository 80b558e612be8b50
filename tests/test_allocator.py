"""An engine keeps the memory it frees for its next step (``kvseal.engine.build.keep_freed_memory``)."""

import platform
import subprocess
import sys

import pytest

ALLOCATE = """
import resource, sys, torch
torch.set_num_threads(2)  # as an engine runs (with one thread, as engines run under pytest-xdist, glibc kept them)
if sys.argv[1] == "kept":
    from kvseal.engine.build import keep_freed_memory
    assert keep_freed_memory()
x = torch.randn(32, 49152)
for _ in range(3):
    y = x * 2
    del y
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    y = x * 2  # a sampling step's [32, V] temporary (6 MB), freed
    z = torch.empty(64 << 20, dtype=torch.uint8)  # and a larger block of the forward's in between
    del z, y
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt (elsewhere the call does nothing)")
def test_freed_temporaries_are_not_faulted_in_again():
    """20 steps of a 6 MB temporary computed on two threads: by default glibc gives each back to the kernel
    and faults its ~1,500 pages in again the next time (4,600-7,700 minor faults here; 1,559 held to one
    core); kept, ~25."""
    faults = {mode: int(subprocess.run([sys.executable, "-c", ALLOCATE, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("default", "kept")}
    assert faults["default"] > 1000 and faults["kept"] < 200, faults


def test_every_engine_asks_for_it(monkeypatch):
    from kvseal.config import WorkerSpec
    from kvseal.engine import build

    asked = []
    monkeypatch.setattr(build, "keep_freed_memory", lambda: asked.append(1) or True)
    engine, _, _ = build.build_engine(WorkerSpec(kv_pool_tokens=1024, context=1024))
    engine.stop()
    assert asked == [1]
