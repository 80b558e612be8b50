"""Servers for the tests, forked from a process that has already imported what a server imports.

A fresh ``python -m kvseal.cli decode`` spends ~2.5 of its ~4 CPU-seconds to healthy importing PyTorch,
transformers, FastAPI and kvseal; the suite starts over a hundred servers on two cores. A forkserver
(``multiprocessing``) imports them once per pytest process and forks each server from there: the server then
runs ``kvseal.cli.main`` with its own arguments and environment, exactly as the command would.

What a fork cannot give a server is an environment read while those modules loaded (``KVSEAL_ISA``, oneDNN's
and OpenMP's variables, ``LD_PRELOAD``…): a server asked for with any variable outside ``RUNTIME_ENV`` starts as
a fresh interpreter (tests/conftest.py). Nothing in the forkserver runs a parallel PyTorch op before it forks,
so no OpenMP team is copied into a child without its threads; its one other thread is numpy's idle OpenBLAS
server, which OpenBLAS shuts down at a fork and starts again when needed. ``KVSEAL_TEST_FORK=0`` starts every
server fresh.
"""

from __future__ import annotations

import os
import sys

# kvseal.cli first: it sets GOMP_SPINCOUNT before PyTorch loads libgomp, as the command does
PRELOAD = ["kvseal.cli", "torch", "transformers", "fastapi", "uvicorn", "kvseal.engine.build",
           "kvseal.server.worker", "kvseal.server.decode", "kvseal.server.prefill", "kvseal.server.router",
           "kvseal.server.api", "kvseal.server.colocated", "kvseal.server.launch", "kvseal.server.served",
           "kvseal.transfer.mooncake", "kvseal.transfer.shm"]

# read by kvseal (or Mooncake) when a server runs, not when its modules load: a forked server sees them
RUNTIME_ENV = ("KVSEAL_FAULTS", "KVSEAL_FAULT_SEED", "KVSEAL_FAULT_DELAY", "KVSEAL_UNSAFE", "KVSEAL_CACHE", "MC_TCP_")


def run(argv: list[str], env: dict[str, str], log: str) -> None:
    """The forked server: its own session (killpg reaches its children), its output to ``log`` (which it
    unlinks: the test holds it open), its environment, then the command."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.unlink(log)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    from kvseal.cli import main

    main(argv)
