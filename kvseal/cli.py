"""``kvseal serve | prefill | decode | router | preflight | bench``.

``serve`` starts router + 1 prefill + 1 decode worker as processes on this host (``--colocated``: one
process that does both). Protections are on; ``--unsafe-no-<name>`` turns one off, and is refused unless
``KVSEAL_UNSAFE=1`` is in the environment (tests and demonstrations only).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# Must precede the first torch import. libgomp's idle workers spin ~300k iterations by default, starving
# the HTTP thread on a small machine; 100k measured best here (bench/README: 32 streams, ~+15%).
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

from kvseal.config import UNSAFE_FLAGS, Protections, WorkerSpec
from kvseal.model.arch import ConfigError
from kvseal.model.cpu import LevelError, choice, resolve
from kvseal.server.served import add_front_args


def _bounded(kind: type, least: float, what: str, most: float = float("inf")) -> object:
    """An argparse type: a ``kind`` number in [least, most], else the usual one-line usage error naming the flag
    (a zero page size divided by zero, a negative thread count failed inside the engine thread)."""
    def convert(text: str) -> int | float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not least <= v <= most:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be {what}, not {text}")
        return v

    convert.__name__ = kind.__name__
    return convert


COUNT = _bounded(int, 1, "a positive integer")
THREADS = _bounded(int, 0, "0 (every core) or more")
PORT = _bounded(int, 0, "a port number (0-65535)", 65535)
SECONDS = _bounded(float, 1e-3, "a positive number of seconds", 1e9)
GIB = _bounded(float, 1e-6, "a positive number of GiB", 1e9)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 where the CPU has bf16 dot products (AVX-512 BF16, AMX, Arm BF16), else fp32")
    p.add_argument("--kv-pool-tokens", type=COUNT, default=None, help="pool size in tokens")
    p.add_argument("--kv-memory", type=GIB, default=1.5, help="pool memory in GiB (if no --kv-pool-tokens)")
    p.add_argument("--page-size", type=COUNT, default=16, help="tokens per KV page")
    p.add_argument("--context", "--max-model-len", dest="context", type=COUNT, default=None,
                   help="served context (default: the model's)")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer (HF directory or GGUF file) "
                   "other than the checkpoint's")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the checkpoint's shape (sizing, benchmarks), as vLLM's")
    p.add_argument("--allow-pool-below-context", action="store_true",
                   help="cap the served context at the pool instead of refusing to start")
    p.add_argument("--max-running", type=COUNT, default=64, help="requests in the running batch at most")
    p.add_argument("--step-token-budget", type=COUNT, default=None,
                   help="tokens per engine step (decodes + prefill chunks); bounds every stream's inter-token gap "
                        "(default: 512; 1024 on a prefill worker, which streams nothing itself)")
    p.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
                   help="linear-layer weights: bf16 (fp32 models widen them in the GEMM), fp32 (exact, fp32 models), "
                        "or weight-only int8/int4 for steps of few rows (bf16 above); auto: fp32 with --dtype fp32, "
                        "else bf16")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model and the KV pool live; cuda: experimental (not yet run on a GPU: "
                        "docs/gpu.md); a GPU pool's pages move between workers through host memory")
    p.add_argument("--threads", type=THREADS, default=0, help="torch threads (default: all cores)")
    p.add_argument("--share-cores", default="auto", metavar="LOCKFILE|auto|none",
                   help="time-share the cores with other engines using the same lock file (one forward at a time); "
                        "auto: every engine of this user on this host that uses all cores (no --threads)")
    p.add_argument("--scrub-on-free", action="store_true", help="zero pages when freed (costs bandwidth)")
    p.add_argument("--prefix-cache", default="on", choices=["on", "off"],
                   help="reuse full prompt pages within a tenant (keys salted per tenant; decode never caches)")
    for name, flag in UNSAFE_FLAGS.items():
        p.add_argument(flag, dest=f"unsafe_{name}", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--unsafe-no-all", action="store_true", help=argparse.SUPPRESS)


def core_lock(flag: str, threads: int, device: str = "cpu") -> str | None:
    """Engines on one host that each use every core must take turns (kvseal.engine.cores): two OpenMP teams
    on the same cores run several times slower than one at a time. By default they find each other through
    one lock file per user; an engine given its own threads (--threads), or one whose model runs on a GPU (its
    cores only launch work), is left alone."""
    if flag == "none" or (flag == "auto" and (threads or device != "cpu")):
        return None
    if flag == "auto":
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return os.path.join(root, f"kvseal-cores-{os.getuid()}.lock")
    return flag


def worker_spec(a: argparse.Namespace) -> WorkerSpec:
    return WorkerSpec(model=a.model, dtype=a.dtype, kv_pool_tokens=a.kv_pool_tokens, kv_memory_gib=a.kv_memory,
                      page_size=a.page_size, context=a.context, allow_pool_below_context=a.allow_pool_below_context,
                      max_running=a.max_running, step_token_budget=a.step_token_budget, weights=a.weights,
                      threads=a.threads, share_cores=core_lock(a.share_cores, a.threads, a.device),
                      scrub_on_free=a.scrub_on_free, prefix_cache=a.prefix_cache == "on",
                      protections=Protections.from_args(a), tokenizer=a.tokenizer, load_format=a.load_format,
                      shared_weights=getattr(a, "shared_weights", None), device=a.device)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                   help="the cluster's shared secret (mode 600): every internal request is signed with a key "
                        "derived from it")
    p.add_argument("--previous-cluster-secret-file", default=None, metavar="FILE",
                   help="the secret before a rotation, still accepted")
    p.add_argument("--insecure-no-auth", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ssl-certfile", default=None, help="serve this process's HTTP over TLS with this certificate")
    p.add_argument("--ssl-keyfile", default=None, help="the private key of --ssl-certfile")
    p.add_argument("--ssl-ca", default=None, metavar="FILE",
                   help="CA that signs the other nodes' certificates (worker URLs are then https://)")


def version() -> str:
    from kvseal import __version__

    return __version__


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvseal")
    ap.add_argument("--version", action="version", version=f"kvseal {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="router + prefill + decode on this host (or --colocated)")
    add_worker_args(s)
    s.add_argument("--colocated", action="store_true", help="one process does prefill and decode")
    s.add_argument("--host", default="127.0.0.1", help="address the front door listens on")
    s.add_argument("--port", type=PORT, default=8000,
                   help="the front door's port (workers: the next two when free)")
    s.add_argument("--api-key", action="append", default=[], metavar="KEY=TENANT",
                   help="a client key and its tenant (repeatable); none: single-tenant")
    s.add_argument("--api-keys", default=None, metavar="FILE", help="KEY=TENANT lines (keeps keys out of ps)")
    s.add_argument("--transport", default="shm", choices=["shm", "mooncake"],
                   help="how prefill writes pages into decode's pool")
    s.add_argument("--insecure-no-auth", action="store_true", help=argparse.SUPPRESS)
    add_front_args(s)
    for role in ("prefill", "decode"):
        w = sub.add_parser(role, help=f"a {role} worker")
        add_worker_args(w)
        add_cluster_args(w)
        w.add_argument("--host", default="127.0.0.1", help="address this worker listens on (and Mooncake binds)")
        w.add_argument("--port", type=PORT, required=True, help="this worker's port")
        w.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # serve's bound socket
        w.add_argument("--transport", default="shm", choices=["shm", "mooncake"],
                       help="how page bytes move between prefill and decode (both workers alike)")
        w.add_argument("--shared-weights", default=None, metavar="FILE",
                       help="share one copy of the packed weights with the other workers of this host through FILE "
                            "(kvseal serve does this itself)")
        w.add_argument("--mooncake-protocol", default="tcp", choices=["tcp", "rdma"],
                       help="Mooncake's transport protocol")
        w.add_argument("--mooncake-devices", default="", metavar="NIC[,NIC]", help="RDMA devices, e.g. mlx5_0")
        if role == "decode":
            w.add_argument("--lease-ttl", type=_bounded(float, 0, "0 (never) or more seconds", 1e9), default=120.0,
                           help="seconds before a never-committed lease is revoked and freed (0: never)")
            w.add_argument("--reserve-wait", type=SECONDS, default=20.0,
                           help="seconds a reservation waits for room in a full KV pool before it is answered 503 "
                                "(a request whose own other choices or prompts hold the pool is retried by the router)")
    r = sub.add_parser("router", help="OpenAI front door over remote workers")
    add_cluster_args(r)
    r.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill worker (repeatable)")
    r.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode worker (repeatable)")
    r.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    r.add_argument("--port", type=PORT, default=8000, help="the router's port")
    r.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # serve's bound socket
    r.add_argument("--api-key", action="append", default=[], metavar="KEY=TENANT",
                   help="a client key and its tenant (repeatable); none: single-tenant")
    r.add_argument("--api-keys", default=None, metavar="FILE", help="KEY=TENANT lines (keeps keys out of ps)")
    r.add_argument("--model", default=None, help="the checkpoint the workers serve: its name, tokenizer, "
                   "generation config (default: SmolLM2-135M-Instruct)")
    r.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer other than the checkpoint's")
    add_front_args(r)
    r.add_argument("--timeout", type=SECONDS, default=30.0, help="seconds before a silent worker is failed")
    r.add_argument("--probe-timeout", type=SECONDS, default=5.0,
                   help="health-probe timeout; a worker that answered real work recently stays in service")
    r.add_argument("--queue-timeout", type=SECONDS, default=120.0,
                   help="seconds a request may wait for prefill (queue included) before it fails with 503")
    r.add_argument("--max-inflight", type=COUNT, default=256,
                   help="requests in flight per worker; past it new requests are answered 429 at once")
    for name, flag in UNSAFE_FLAGS.items():
        r.add_argument(flag, dest=f"unsafe_{name}", action="store_true", help=argparse.SUPPRESS)
    r.add_argument("--unsafe-no-all", action="store_true", help=argparse.SUPPRESS)
    pf = sub.add_parser("preflight", help="print the pool sizing table without serving")
    pf.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    pf.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="the KV pool's dtype")
    pf.add_argument("--memory", type=GIB, required=True, help="pool memory in GiB")
    pf.add_argument("--context", "--max-model-len", dest="context", type=COUNT, default=None,
                    help="served context (default: the model's)")
    pf.add_argument("--page-size", type=COUNT, default=16, help="tokens per KV page")
    b = sub.add_parser("bench", help="load benchmark against an OpenAI-compatible server")
    from kvseal.bench import add_args

    add_args(b)
    ev = sub.add_parser("env", help="this machine: CPU, features, the kernel level and dtype kvseal picks, versions")
    from kvseal import machine

    machine.add_args(ev)
    pr = sub.add_parser("probe", help="isolation check against any OpenAI-compatible server (two tenants' keys)")
    from kvseal import probe

    probe.add_args(pr)
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    try:
        check(a)
    except (LevelError, ValueError) as e:  # a forced kernel level this CPU cannot run, flags that cannot go together
        sys.exit(f"kvseal {a.cmd}: {e}")
    try:
        _start(a)
    except ConfigError as e:  # found only while loading (a GGUF file's keys): still one line, no traceback
        sys.exit(f"kvseal {a.cmd}: {e}")


def check(a: argparse.Namespace) -> None:
    """What can be refused before anything starts: the kernel level (KVSEAL_ISA) and the dtype/weights pair."""
    if a.cmd in ("serve", "prefill", "decode", "preflight", "env"):
        choice()
    if a.cmd in ("serve", "router"):
        from kvseal.server.served import check_front

        check_front(a)
    if a.cmd in ("serve", "prefill", "decode"):
        resolve(worker_spec(a))
        p = Path(a.model) if a.model else None
        if p is not None and p.is_file():  # read as it loads, after PyTorch: its first bytes are checked now
            if p.suffix != ".gguf":
                raise ConfigError(f"{p}: expected a .gguf file or a directory with config.json")
            with open(p, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise ConfigError(f"{p}: not a GGUF file (it does not begin with the GGUF magic bytes)")
        if p is not None and (p.is_dir() or not p.exists()):  # a GGUF file is checked as it loads
            from kvseal.model.loader import inspect  # PyTorch (meta tensors): never for `serve` of a GGUF file

            inspect(p, a.load_format == "dummy", a.tokenizer)  # a checkpoint kvseal cannot serve exactly: refused before any process starts


def _start(a: argparse.Namespace) -> None:
    if a.cmd == "serve" and a.colocated:
        from kvseal.server.colocated import serve

        serve(worker_spec(a), a.host, a.port, a.api_key, a.api_keys, front_args=a)
    elif a.cmd == "serve":
        from kvseal.server.launch import serve_disaggregated

        serve_disaggregated(a, worker_spec(a))
    elif a.cmd in ("prefill", "decode"):
        from kvseal.server.worker import serve_worker
        from kvseal.transfer.auth import cluster_auth
        from kvseal.transfer.mooncake import MooncakeConfig

        auth = cluster_auth(a, a.cmd, f"{a.cmd}@{a.host}:{a.port}")
        serve_worker(a.cmd, worker_spec(a), a.host, a.port, a.transport, getattr(a, "lease_ttl", 0.0),
                     getattr(a, "reserve_wait", 20.0),
                     MooncakeConfig(a.mooncake_protocol, a.mooncake_devices), auth=auth,
                     tls=(a.ssl_certfile, a.ssl_keyfile), listen_fd=a.listen_fd)
    elif a.cmd == "router":
        from kvseal.server.worker import serve_router

        serve_router(a)
    elif a.cmd == "preflight":
        run_preflight(a)
    elif a.cmd == "bench":
        from kvseal.bench import run

        run(a)
    elif a.cmd == "probe":
        from kvseal.probe import run

        sys.exit(run(a))
    elif a.cmd == "env":
        from kvseal.machine import run

        run(a)


def run_preflight(a: argparse.Namespace) -> None:
    import gguf

    from kvseal.config import torch_dtype
    from kvseal.kv.preflight import pool_tokens_for, preflight
    from kvseal.model.loader import default_model_path, gguf_config, inspect

    path = a.model or str(default_model_path())
    cfg = inspect(path) or gguf_config(gguf.GGUFReader(path))  # an HF directory, or a GGUF file
    from kvseal.model.cpu import resolve_dtype

    dtype = torch_dtype(resolve_dtype(a.dtype)[0])
    tokens = pool_tokens_for(cfg, dtype, int(a.memory * 2**30), a.page_size)
    print(preflight(cfg, dtype, tokens, a.context, allow_below=True).table())
    if tokens < (a.context or cfg.max_context):
        print("\nWARNING: pool below context; a worker refuses to start without --allow-pool-below-context")
        sys.exit(1)


if __name__ == "__main__":
    main()
