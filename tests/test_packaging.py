"""The package declares exactly the distributions its code imports (plus those it needs through another
library, named with the reason), says what it is, and the front door loads no PyTorch."""

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THROUGH = {
    "accelerate",  # transformers loads GGUF files through it (kvseal bench --hf-baseline)
    "httptools", "uvloop",  # uvicorn's "auto" HTTP parser and event loop pick them when installed
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_declared_dependencies_are_exactly_those_imported():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the gpu extra: what the GPU modules import (kvseal.model.triton_attention), optional on a CPU host
    needs = project["dependencies"] + project["optional-dependencies"]["gpu"]
    declared = {norm(re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0]) for d in needs}
    dists = packages_distributions()
    imported = set()
    for f in (ROOT / "kvseal").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for n in names:
                top = n.split(".")[0]
                if top in sys.stdlib_module_names or top == "kvseal":
                    continue
                imported |= {norm(d) for d in dists.get(top, [top])}
    assert declared - THROUGH == imported, (f"declared, never imported: {sorted(declared - THROUGH - imported)}; "
                                            f"imported, not declared: {sorted(imported - declared)}")


def test_the_package_says_what_it_is():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").read_text().count("Apache License") >= 1
    assert project["readme"] == "README.md" and project["classifiers"]
    assert (ROOT / "CHANGELOG.md").exists()


def start_router(env: dict | None = None) -> tuple[object, str]:
    """A router over no live worker: /health is 503 (degraded), /v1/models answers once it is up."""
    import os
    import subprocess
    import time

    import httpx
    from conftest import cluster_secret, free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvseal.cli", "router", "--prefill", "http://127.0.0.1:9",
                             "--decode", "http://127.0.0.1:9", "--cluster-secret-file", cluster_secret(),
                             "--port", str(port)], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    return proc, url


def test_the_router_serves_without_loading_pytorch(bf16_model):
    """The router runs no model: PyTorch stays out of its process (~1 s of every start, a few hundred MB), yet
    it tokenizes, applies the chat template and compiles a grammar. Red if any module on its path imports torch
    at the top, or if transformers is left to import it. (``bf16_model``: the load cache, where the tokenizer of
    the default GGUF file is read from, is written.)"""
    import httpx
    from conftest import MODEL

    proc, url = start_router()
    try:
        tok = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert tok.status_code == 200 and tok.json()["count"] > 5, tok.text
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_object"}}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert reply.status_code == 503, reply.text  # the grammar compiled; no worker to run it (never a 500)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the router loaded PyTorch"
        # a scrape storm costs the front door an HTTP exchange per scrape: half as much CPU on these (README)
        assert "/httptools/" in maps and "/uvloop/" in maps, "uvicorn fell back to h11 or asyncio's own loop"
    finally:
        proc.kill()
        proc.wait(10)


def test_a_router_reading_a_gguf_tokenizer_still_starts():
    """Without the load cache (a fresh host, or ``KVSEAL_CACHE=off``) the tokenizer comes from the GGUF file,
    which transformers reads through PyTorch: the router keeps it then, and serves."""
    import httpx
    from conftest import MODEL

    proc, url = start_router({"KVSEAL_CACHE": "off"})
    try:
        assert proc.poll() is None, "the router died at start"
        tok = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "The capital of France"})
        assert tok.status_code == 200 and tok.json()["count"] >= 4, tok.text
    finally:
        proc.kill()
        proc.wait(10)
