"""Shared fixtures: the real default model loaded once per dtype, and live servers as real processes."""

from __future__ import annotations

import functools
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import httpx
import pytest
import torch

from kvseal.engine.build import off_main_thread
from kvseal.model import cpu
from kvseal.model.loader import load
from kvseal.transfer.auth import ClusterSecret, Signer, write_secret_file

import forked

# Under pytest-xdist (make test) two test files run at once on the machine's cores. Every engine, in this
# process or a server's, then runs on one thread: an OpenMP team whose cores another process also uses waits at
# each of its barriers for a descheduled member (steps 10-40x slower, measured), where single threads just share.
# A server given --threads also leaves the cores lock alone (kvseal.cli.core_lock), so the two files' engines do
# not take turns. The tests that measure time or load are marked ``alone`` and run afterwards on idle cores.
PARALLEL = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if PARALLEL:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# make test hands whole files to its two workers in collection order (--no-loadscope-reorder): the longest go
# first, so that none of them starts last while the other worker sits idle (ordered by one make test on a Zen 4)
LONGEST_FIRST = ["test_protocol_models", "test_faults", "test_model", "test_architectures", "test_probe",
                 "test_disagg", "test_isolation", "test_auth", "test_weights", "test_portability", "test_readme"]


def pytest_collection_modifyitems(config, items) -> None:
    if PARALLEL:
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


MODEL = "SmolLM2-135M-Instruct.Q4_1"
# every build of the native kernels this CPU runs: kernel tests hold each to the reference, so a machine with
# the widest instructions also tests the narrower levels (KVSEAL_ISA picks the one a process serves with)
KERNEL_LEVELS = [lv for lv in cpu.runnable(cpu.usable_flags()) if lv in cpu.built()]


@pytest.fixture(params=KERNEL_LEVELS)
def level(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def fp32_model():
    return off_main_thread(lambda: load(None, torch.float32, progress=False))


@pytest.fixture(scope="session")
def bf16_model():
    return off_main_thread(lambda: load(None, torch.bfloat16, progress=False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_secret_lock = threading.Lock()


@functools.cache
def _make_secret() -> str:
    return str(write_secret_file(Path(tempfile.mkdtemp(prefix="kvseal-test-")) / "secret"))


def cluster_secret() -> str:
    """One cluster secret for the session's workers and routers (a 0600 file in a private directory). Locked:
    Trio starts its workers from two threads at once."""
    with _secret_lock:
        return _make_secret()


def node_signer(role: str = "router") -> Signer:
    """Signs requests as a node of ``role``: how a test reads worker details or knocks on their doors."""
    return Signer(ClusterSecret.from_file(cluster_secret()), role, "pytest")


def signed(method: str, url: str, role: str = "router", body: bytes = b"", **kw) -> httpx.Response:
    target = httpx.URL(url).raw_path.decode()
    headers = node_signer(role).headers(method, target, body)
    return httpx.request(method, url, content=body, headers=headers, timeout=kw.pop("timeout", 30), **kw)


def _lost_port(out: str, port: int) -> bool:
    """The process could not bind the port that free_port chose: another socket took it in between (free_port
    cannot hold it for a child that binds seconds later). Only that port: any other bind error is the server's."""
    return f"('127.0.0.1', {port}): address already in use" in out or f"listen on 127.0.0.1:{port}:" in out


def _log_start(role: str, seconds: float) -> None:
    """With KVSEAL_TEST_STARTS=FILE, each server start appends its test, role and seconds to healthy (a line
    each, tab-separated): where a suite's time goes to starting servers."""
    if path := os.environ.get("KVSEAL_TEST_STARTS"):
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{role}\t{seconds:.2f}\n")


class Server:
    """A kvseal process on a free loopback port, killed at teardown. Workers and routers get the session's
    cluster secret unless the args name one (or switch auth off)."""

    def __init__(self, args: list[str], env: dict | None = None, timeout: float = 180, port: int | None = None) -> None:
        self.args, self.env, self.timeout = args, env, timeout
        self.port = port or free_port()
        tls = "--ssl-certfile" in args
        ca = args[args.index("--ssl-ca") + 1] if "--ssl-ca" in args else None
        self.verify = ssl.create_default_context(cafile=ca) if ca else True
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.worker = args[0] in ("prefill", "decode")
        if args[0] in ("prefill", "decode", "router") and not {"--cluster-secret-file", "--insecure-no-auth"} & set(args):
            args = [*args, "--cluster-secret-file", cluster_secret()]
        if args[0] in ("prefill", "decode", "serve") and not {"--kv-pool-tokens", "--kv-memory"} & set(args):
            # a third of the default pool: faulting 1.5 GiB in costs 1-3 s of a start when two workers start at once
            args = [*args, "--kv-memory", "0.5"]
        if PARALLEL and args[0] in ("prefill", "decode", "serve") and "--threads" not in args:
            args = [*args, "--threads", "1"]
        self.proc = launch([*args, "--port", str(self.port)], env or {})
        t0 = time.time()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read()
                if port is None and _lost_port(out, self.port):  # free_port's port taken before the bind: again
                    self.__init__(self.args, self.env, self.timeout)
                    return
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{out}")
            try:
                if httpx.get(self.url + "/health", timeout=2, verify=self.verify).status_code == 200:
                    _log_start(args[0], time.time() - t0)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"{args[0]} did not become healthy:\n{self.proc.stdout.read()[-3000:]}")

    def kill(self) -> None:
        """kill -9, as a crash would: no cleanup, no answer."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)

    def restart(self) -> None:
        """Kill and start again with the same arguments on the same port (the router knows it by URL)."""
        self.kill()
        self.__init__(self.args, self.env, self.timeout, self.port)

    def health(self) -> dict:
        if self.worker:  # pool details only for signed callers
            return signed("GET", self.url + "/health", timeout=10, verify=self.verify).json()
        # a router's full health: each worker's pool checked now (the quick probes carry no integrity check)
        return httpx.get(self.url + "/health", params={"full": "true"}, timeout=30, verify=self.verify).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


class Forked:
    """A server forked from the session's forkserver (tests/forked.py), with the part of ``Popen``'s interface
    the tests use: ``pid``, ``poll``, ``wait``, ``kill`` and ``stdout`` (its output so far)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        fd, log = tempfile.mkstemp(prefix="kvseal-server-", suffix=".log")
        os.close(fd)
        self.stdout = open(log)  # noqa: SIM115 - read at teardown; the server unlinks the file once it has it
        # daemon: one a test left running is stopped when pytest exits (multiprocessing joins the others)
        self._p = _forkserver().Process(target=forked.run, args=(argv, env, log), daemon=True)
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"kvseal (pid {self.pid})", timeout)
        return self._p.exitcode

    def kill(self) -> None:
        self._p.kill()


@functools.cache
def _forkserver():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(forked.PRELOAD)
    return ctx


FORK = os.environ.get("KVSEAL_TEST_FORK", "1") != "0"


def launch(argv: list[str], env: dict[str, str]) -> subprocess.Popen | Forked:
    """``kvseal ARGV`` with ``env`` over this process's: forked (tests/forked.py) when every variable given is
    one a server reads as it runs, otherwise a fresh interpreter."""
    full_env = {**os.environ, **env}
    if FORK and all(k.startswith(forked.RUNTIME_ENV) for k in env):
        return Forked(argv, full_env)
    return subprocess.Popen([sys.executable, "-m", "kvseal.cli", *argv], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_pages_back(server: Server, timeout: float = 20) -> dict:
    """Pool conservation seen from outside: nothing reserved, owned or quarantined once idle."""
    deadline = time.time() + timeout
    h = server.health()
    while time.time() < deadline:
        h = server.health()
        pools = h.get("pools", [h])
        if all(p.get("free_pages") == p.get("total_pages") and p.get("integrity_ok") is True for p in pools):
            return h
        time.sleep(0.2)
    raise AssertionError(f"pages not returned: {h}")


@pytest.fixture(scope="session")
def colocated():
    s = Server(["serve", "--colocated", "--kv-pool-tokens", "16384"])
    yield s
    s.stop()


@pytest.fixture(scope="session")
def disagg():
    s = Server(["serve", "--kv-pool-tokens", "16384"])
    yield s
    s.stop()


class Trio:
    """A router over one prefill and one decode worker, each a real process; the workers load in parallel."""

    def __init__(self, worker: list[str] = (), router: list[str] | None = (), env: dict | None = None,
                 prefill: list[str] = (), decode: list[str] = ()) -> None:
        with ThreadPoolExecutor(2) as ex:
            started = [ex.submit(Server, [role, *worker, *extra], env)
                       for role, extra in (("prefill", prefill), ("decode", decode))]
        self.servers = [f.result() for f in started if f.exception() is None]
        if len(self.servers) < 2:
            self.stop()
            raise next(f.exception() for f in started if f.exception() is not None)
        self.pre, self.dec = self.servers
        if router is None:  # workers only: each test brings its router (routed)
            return
        try:
            self.router = Server(["router", "--prefill", self.pre.url, "--decode", self.dec.url, *router], env)
        except BaseException:
            self.stop()
            raise
        self.servers.insert(0, self.router)
        self.url = self.router.url

    def __enter__(self) -> Self:
        return self

    def arm(self, faults: str = "", delay: float = 2.0) -> None:
        """Set both workers' fault points (they started with ``KVSEAL_FAULTS=armable``; "" disarms)."""
        for s in (self.pre, self.dec):
            body = json.dumps({"faults": faults, "delay": delay}).encode()
            r = signed("POST", s.url + "/faults", body=body)
            assert r.status_code == 200, r.text

    @contextmanager
    def routed(self, router: list[str] = (), fault: str = "", delay: float = 2.0) -> Iterator[Server]:
        """A router of the caller's own flags over these workers, with ``fault`` armed on both (workers
        started with ``KVSEAL_FAULTS=armable``) until it stops: tests that differ only in router flags share
        one pair of workers. The workers start idle and whole."""
        wait_pages_back(self.pre)
        wait_pages_back(self.dec)
        self.arm(fault, delay)
        r = Server(["router", "--prefill", self.pre.url, "--decode", self.dec.url, *router])
        try:
            yield r
        finally:
            r.stop()
            self.arm("")

    def wait_ready(self, timeout: float = 30) -> None:
        """Every worker back in the router's service (a fence after a fault clears at the next probes)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            workers = httpx.get(self.url + "/health", timeout=10).json().get("workers", {})
            if workers and all(workers.values()):
                return
            time.sleep(0.2)
        raise AssertionError(f"workers not back in service: {workers}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def complete(url: str, prompt: str, n: int = 8, key: str = "none", **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, **kw})


def prometheus_jobs(web_port: int, query: str, want: int = 3, timeout: float = 60) -> set[str]:
    """The jobs a Prometheus on ``web_port`` has scraped ``query`` from, once it has ``want`` of them (or the
    timeout passes)."""
    jobs: set[str] = set()
    deadline = time.time() + timeout
    while time.time() < deadline and len(jobs) < want:
        time.sleep(1)
        try:
            r = httpx.get(f"http://127.0.0.1:{web_port}/api/v1/query", params={"query": query})
            jobs = {s["metric"]["job"] for s in r.json()["data"]["result"]}
        except (httpx.HTTPError, KeyError, ValueError):
            continue
    return jobs
