"""Entry points for the worker processes (``kvseal prefill`` / ``kvseal decode``) and the router."""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
from contextlib import asynccontextmanager

from fastapi import Request
from fastapi.responses import JSONResponse

from kvseal.config import Protections, WorkerSpec
from kvseal.faults import Faults
from kvseal.server import listen
from kvseal.server.guard import FRONT_MAX_BODY, Guard
from kvseal.server.metrics import Metrics, ScrapeDoor
from kvseal.transfer.auth import cluster_auth


def serve_worker(role: str, spec: WorkerSpec, host: str, port: int, transport: str, lease_ttl: float = 0.0,
                 reserve_wait: float = 20.0, mooncake: object = None, auth: tuple = (None, {}),
                 tls: tuple = (None, None), listen_fd: int | None = None) -> None:
    from kvseal.engine.build import build_engine  # PyTorch: a worker's, never the router's

    verifier, http = auth
    scheme = "https" if tls[0] else "http"
    metrics = Metrics()
    faults = Faults.from_env()
    if role == "decode":
        from kvseal.server.decode import DecodeService, decode_app

        pool = _decode_pool(transport, host, port, mooncake)
        engine, lm, sizing = build_engine(spec, role="decode", storage=pool.create, metrics=metrics)
        target = str(pool.path) if transport == "shm" else pool.target
        # the decode id names this incarnation: a capability granted before a restart is told from a forgery
        incarnation = f"{host}:{port}#{secrets.token_hex(4)}"
        app = decode_app(DecodeService(engine, lm.model.cfg.eos_token_ids, target, incarnation,
                                       faults, lease_ttl, reserve_wait, http=http,
                                       exposure=pool if transport == "mooncake" else None))
        # uvicorn re-raises SIGTERM after its shutdown, so a ``finally`` after ``run`` never runs: the pool file
        # goes in the app's own shutdown (a SIGKILL still leaves it; the next decode's sweep removes it)
        app.router.add_event_handler("shutdown", pool.close)
    else:
        from kvseal.server.prefill import PrefillService, prefill_app

        engine, lm, sizing = build_engine(spec, role="prefill", metrics=metrics)
        app = prefill_app(PrefillService(engine, _writer(transport, host, mooncake), f"{scheme}://{host}:{port}",
                                         faults, http=http))
    fault_route(app, faults)
    print(f"{role} worker on {host}:{port}{'' if verifier else ' (INSECURE: no request signing)'}\n"
          f"{sizing.table()}", flush=True)
    try:
        # a router's token stream never ends by itself: bound the graceful shutdown so SIGTERM ends the worker
        listen.run(ScrapeDoor(Guard(app, verifier), metrics), host, port, listen_fd, log_level="warning",
                   ssl_certfile=tls[0], ssl_keyfile=tls[1], timeout_graceful_shutdown=3)
    finally:
        if role == "decode":
            pool.close()


def fault_route(app: object, faults: Faults) -> None:
    """``POST /faults {"faults": "name,…", "seed": n, "delay": s}``: set this worker's fault points (router role,
    signed; 404 unless the worker started with ``KVSEAL_FAULTS=armable``, kvseal.faults)."""
    @app.post("/faults")
    async def arm(request: Request) -> JSONResponse:
        if not faults.armable:
            return JSONResponse({"error": {"message": "Not Found", "code": "not_found"}}, status_code=404)
        try:
            body = await request.json()
            faults.arm(str(body.get("faults", "")), int(body.get("seed", 0)), float(body.get("delay", 2.0)))
        except (ValueError, TypeError, AttributeError) as e:  # not JSON, not an object, an unknown point
            return JSONResponse({"error": {"message": str(e), "code": "bad_request"}}, status_code=400)
        return JSONResponse({"faults": faults.probs, "delay": faults.delay})


def _decode_pool(transport: str, host: str, port: int, mooncake: object) -> object:
    if transport == "mooncake":
        from kvseal.transfer.mooncake import MooncakePool

        return MooncakePool(host, mooncake)
    from kvseal.transfer.shm import ShmPool

    return ShmPool(f"kvseal-decode-{port}-{os.getpid()}-{secrets.token_hex(8)}")


def _writer(transport: str, host: str, mooncake: object) -> object:
    if transport == "mooncake":
        from kvseal.transfer.mooncake import MooncakeWriter

        return MooncakeWriter(host, mooncake)
    from kvseal.transfer.shm import ShmWriter

    return ShmWriter()


def serve_router(a: argparse.Namespace) -> None:
    from kvseal.server.served import front, front_tokenizer_source, load_front_tokenizer

    # The front door runs no model, so PyTorch stays out of it: ~1 s of every start and a few hundred MB of
    # memory. transformers imports it whenever it is installed, even to build a tokenizer; marked absent here,
    # transformers tokenizes without it (tests/test_packaging.py starts a router and checks). Not for a GGUF
    # file's tokenizer (no load cache yet: a fresh host, KVSEAL_CACHE=off): transformers reads GGUF through it.
    if front_tokenizer_source(a).is_dir():
        sys.modules.setdefault("torch", None)
    from kvseal.server.api import create_app
    from kvseal.server.router import DisaggBackend
    from kvseal.server.tenants import Tenants

    tokenizer = load_front_tokenizer(a)
    served = front(a, tokenizer)
    _, http = cluster_auth(a, "router", f"router@{a.host}:{a.port}")
    backend = DisaggBackend(a.prefill, a.decode, served.names[0], timeout=a.timeout,
                            protections=Protections.from_args(a), faults=Faults.from_env(),
                            probe_timeout=a.probe_timeout, max_inflight=a.max_inflight,
                            queue_timeout=a.queue_timeout, http=http)
    metrics = Metrics(per_tenant=a.per_tenant_metrics)
    metrics.add_source(backend.metric_rows)
    app = create_app(backend, tokenizer, metrics, Tenants.load(a.api_key, a.api_keys, a.admin_key), served)

    @asynccontextmanager
    async def lifespan(_app):
        await backend.refresh()
        task = asyncio.create_task(backend.health_loop())
        yield
        task.cancel()

    app.router.lifespan_context = lifespan
    listen.run(ScrapeDoor(Guard(app, None, FRONT_MAX_BODY), metrics), a.host, a.port, a.listen_fd,
               log_level="warning", ssl_certfile=a.ssl_certfile, ssl_keyfile=a.ssl_keyfile)
