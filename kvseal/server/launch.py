"""``kvseal serve`` (default): router + 1 prefill + 1 decode worker as separate processes on this host."""

from __future__ import annotations

import argparse
import atexit
import ctypes
import gc
import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NoReturn

import httpx

from kvseal.config import UNSAFE_FLAGS, Protections, WorkerSpec
from kvseal.server import listen
from kvseal.transfer.auth import write_secret_file


def _worker_argv(a: argparse.Namespace) -> list[str]:
    out = []
    # Two engines on one host share its cores: each runs its forward passes with every core, one at a time,
    # under a lock file (kvseal.engine.cores). Measured here at 32 streams: ~1.3x the tok/s of one thread
    # per worker, and TTFT p50 2 s instead of 5 s; two full teams without the lock oversubscribe (TTFT 12 s).
    if a.threads:
        out += ["--threads", str(a.threads)]
    out += ["--share-cores", _core_lock_path(a)]
    for flag in ("model", "dtype", "kv_pool_tokens", "kv_memory", "page_size", "context", "max_running",
                 "step_token_budget", "weights", "prefix_cache", "tokenizer", "load_format", "device"):
        v = getattr(a, flag)
        if v is not None:
            out += [f"--{flag.replace('_', '-')}", str(v)]
    for flag in ("allow_pool_below_context", "scrub_on_free", "unsafe_no_all"):
        if getattr(a, flag, False):
            out.append("--" + flag.replace("_", "-"))
    out += [UNSAFE_FLAGS[n] for n in Protections.NAMES if getattr(a, f"unsafe_{n}", False)]
    return out


def _router_argv(a: argparse.Namespace) -> list[str]:
    """The ``serve`` flags the router concerns: the model's name, tokenizer and sampling defaults, the keys,
    the protections it applies."""
    out = []
    for flag in ("model", "tokenizer", "chat_template", "generation_config"):
        if getattr(a, flag) is not None:
            out += [f"--{flag.replace('_', '-')}", getattr(a, flag)]
    if a.served_model_name:
        out += ["--served-model-name", *a.served_model_name]
    if a.per_tenant_metrics:
        out.append("--per-tenant-metrics")
    if a.enable_auto_tool_choice:
        out.append("--enable-auto-tool-choice")
    if a.tool_call_parser:
        out += ["--tool-call-parser", a.tool_call_parser]
    if a.admin_key:
        out += ["--admin-key", a.admin_key]
    out += [f for f in _worker_argv(a) if f.startswith("--unsafe")]
    for k in a.api_key:
        out += ["--api-key", k]
    if a.api_keys:
        out += ["--api-keys", a.api_keys]
    return out


def serve_disaggregated(a: argparse.Namespace, spec: WorkerSpec) -> None:
    del spec  # validated already; the workers re-parse the same flags
    try:  # before any model loads: a taken front door fails now, with its reason
        front = listen.bind(a.host, a.port)
    except OSError as e:
        raise SystemExit(f"kvseal: cannot listen on {a.host}:{a.port}: {e.strerror}") from None
    socks = {"prefill": listen.bind_preferring(a.host, a.port + 1), "decode": listen.bind_preferring(a.host, a.port + 2)}
    ports = {role: s.getsockname()[1] for role, s in socks.items()}
    procs = []
    private = Path(tempfile.mkdtemp(prefix="kvseal-"))  # 0700: the secret of this cluster of three processes
    secret = ["--cluster-secret-file", str(write_secret_file(private / "cluster-secret"))]
    if a.insecure_no_auth:  # the signing-cost benchmark only (the workers refuse it without KVSEAL_UNSAFE=1)
        secret = ["--insecure-no-auth"]
    # SIGTERM to this process alone (kill PID, a container's stop) must stop the workers too, not orphan them
    signal.signal(signal.SIGTERM, _interrupt)
    weights = _shared_weights(a, private)
    fork = a.device == "cpu"  # a GPU's parent has asked CUDA about the device: a forked child could not use it
    if fork:
        preload()
    try:
        for role, port in ports.items():
            fd = socks[role].fileno()
            argv = [role, "--host", a.host, "--port", str(port), "--listen-fd", str(fd), "--transport", a.transport,
                    *secret, *weights, *_worker_argv(a)]
            procs.append(start(argv, socks[role], [front, *socks.values()], fork))
            socks[role].close()  # the worker holds it now
        for role, port in ports.items():
            _wait_healthy(listen.url(a.host, port), procs)
        router = ["router", "--host", a.host, "--port", str(a.port), "--listen-fd", str(front.fileno()), *secret,
                  "--prefill", listen.url(a.host, ports["prefill"]), "--decode", listen.url(a.host, ports["decode"]),
                  *_router_argv(a)]
        procs.append(start(router, front, list(socks.values()), fork))
        front.close()
        print(f"kvseal: router on {listen.url(a.host, a.port)} (prefill :{ports['prefill']}, decode :{ports['decode']})",
              flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for s in (front, *socks.values()):
            s.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if a.share_cores in (None, "auto") and a.device == "cpu":
            Path(_core_lock_path(a)).unlink(missing_ok=True)
        shutil.rmtree(private, ignore_errors=True)


# What a worker imports before it reads its flags (~5 CPU-seconds on a 2-core Zen 3): imported once here, before
# the three processes are forked, instead of once in each. Importing PyTorch starts no thread (its OpenMP team
# starts at the first parallel op, which this process never runs), so each child starts its own.
PRELOAD = ("torch", "transformers", "fastapi", "uvicorn", "kvseal.engine.build", "kvseal.server.worker",
           "kvseal.server.decode", "kvseal.server.prefill", "kvseal.server.router", "kvseal.server.api",
           "kvseal.transfer.mooncake", "kvseal.transfer.shm")


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the children's collector leaves these objects alone: their pages stay shared, not copied


def start(argv: list[str], keep: socket.socket, close: list[socket.socket], fork: bool) -> Child | subprocess.Popen:
    """``kvseal ARGV`` holding the listening socket ``keep``: forked from this process, or a fresh interpreter."""
    if fork:
        return Child(argv, keep, close)
    return subprocess.Popen([sys.executable, "-m", "kvseal.cli", *argv], pass_fds=(keep.fileno(),))


class Child:
    """``kvseal ARGV`` (a worker or the router) in a process forked from this one, with the part of ``Popen``'s
    interface ``serve`` uses. It keeps ``keep`` (its listening socket) and closes ``close`` (the others), sets
    SIGTERM back to its default, runs the command's ``main`` as ``python -m kvseal.cli ARGV`` would, with its own
    exit handlers, and exits with its status: it never returns into this process's code."""

    def __init__(self, argv: list[str], keep: socket.socket, close: list[socket.socket]) -> None:
        sys.stdout.flush()  # else what is buffered here would be written twice
        sys.stderr.flush()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            _child(argv, keep, [s for s in close if s is not keep])

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"kvseal {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _child(argv: list[str], keep: socket.socket, close: list[socket.socket]) -> NoReturn:
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        keep.detach()  # the command opens the descriptor itself (--listen-fd): no second owner to close it
        for s in close:
            s.close()
        atexit._clear()  # this process's handlers are not the child's; the child's own run as it exits
        sys.argv = [sys.argv[0], *argv]
        _name(f"kvseal-{argv[0]}")  # its command line is serve's: top and ps -e tell the three apart by this
        from kvseal.cli import main

        main(argv)
        code = 0
    except SystemExit as e:  # as the interpreter reads it: None is 0, a message is printed and is 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the exit status
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _name(name: str) -> None:
    """The process's name (``/proc/PID/comm``, 15 bytes), where the C library offers prctl."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _shared_weights(a: argparse.Namespace, private: Path) -> list[str]:
    """One packed copy of the weights for both workers; none for a model on a GPU (it runs unpacked weights,
    which each worker moves to the GPU itself)."""
    return ["--shared-weights", str(private / "weights")] if a.device == "cpu" else []


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _core_lock_path(a: argparse.Namespace) -> str:
    """``serve``'s two workers share a lock of their own unless told which one (or none) to use; by default
    none for a model on a GPU (its cores only launch work)."""
    if a.share_cores in (None, "auto"):
        if a.device != "cpu":
            return "none"
        return f"/dev/shm/kvseal-cores-{a.port}-{os.getpid()}"
    return a.share_cores


def _wait_healthy(url: str, procs: list[Child | subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a worker exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy")
