"""What ``bench/gpu.py`` needs on a GPU machine that has no network: run it here, carry the two folders there.

    python bench/gpu_carry.py        # writes .gpu-wheels/ and .gpu-shapes/ (both git-ignored)

- ``.gpu-wheels/``: wheels (CPython 3.12, manylinux x86-64 up to glibc 2.31; the image is Ubuntu 24.04's 2.39) of kvseal's dependencies that the device image
  lacks, at the versions installed here, so pydantic and pydantic-core (and the rest) match each other.
- ``.gpu-shapes/``: config-only checkpoints of the three shapes ``bench/gpu.py`` serves with dummy weights
  (``bench/shapes.py``), each with SmolLM2's tokenizer.

There: ``pip install --no-deps .gpu-wheels/*.whl && python3 bench/gpu.py --out $OUT/gpu.json``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# kvseal's imports that the device image (KINDS.md in the tool library) does not hold, with what they import
MISSING = ["msgspec", "llguidance", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
           "typing-inspection", "uvicorn", "httptools", "gguf"]


def main() -> int:
    wheels = ROOT / ".gpu-wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    pins = [f"{name}=={version(name)}" for name in MISSING]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_31_x86_64", "--platform", "any", "-d", str(wheels), *pins], check=True)
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(1, str(ROOT))
    from shapes import SHAPES, write

    for name in SHAPES:
        write(ROOT / ".gpu-shapes", name)
    size = sum(f.stat().st_size for d in (wheels, ROOT / ".gpu-shapes") for f in d.rglob("*") if f.is_file())
    print(f"{len(list(wheels.glob('*.whl')))} wheels in {wheels}, {len(SHAPES)} shapes in {ROOT / '.gpu-shapes'}; "
          f"{size / 2**20:.1f} MiB to carry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
