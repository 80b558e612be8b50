"""Shared fixtures: the real default model loaded once per dtype, and live servers as real processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Self

import httpx
import pytest
import torch

from kvseal.engine.build import off_main_thread
from kvseal.model.loader import load

MODEL = "SmolLM2-135M-Instruct.Q4_1"


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


class Server:
    """A kvseal process on a free loopback port, killed at teardown."""

    def __init__(self, args: list[str], env: dict | None = None, timeout: float = 180) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvseal.cli", *args, "--port", str(self.port)],
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("server did not become healthy")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


def wait_pages_back(server: Server, timeout: float = 20) -> dict:
    """Pool conservation seen from outside: nothing reserved, owned or quarantined once idle."""
    deadline = time.time() + timeout
    h = server.health()
    while time.time() < deadline:
        h = server.health()
        pools = h.get("pools", [h])
        if all(p["free_pages"] == p["total_pages"] and p.get("integrity_ok", True) for p in pools):
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

    def __init__(self, worker: list[str] = (), router: list[str] = (), env: dict | None = None,
                 prefill: list[str] = (), decode: list[str] = ()) -> None:
        with ThreadPoolExecutor(2) as ex:
            started = [ex.submit(Server, [role, *worker, *extra], env)
                       for role, extra in (("prefill", prefill), ("decode", decode))]
        self.servers = [f.result() for f in started if f.exception() is None]
        if len(self.servers) < 2:
            self.stop()
            raise next(f.exception() for f in started if f.exception() is not None)
        self.pre, self.dec = self.servers
        try:
            self.router = Server(["router", "--prefill", self.pre.url, "--decode", self.dec.url, *router], env)
        except BaseException:
            self.stop()
            raise
        self.servers.insert(0, self.router)
        self.url = self.router.url

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def complete(url: str, prompt: str, n: int = 8, key: str = "none", **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, **kw})
