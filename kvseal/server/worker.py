"""Entry points for the worker processes (``kvseal prefill`` / ``kvseal decode``) and the router."""

from __future__ import annotations

import argparse
import asyncio
import os
from contextlib import asynccontextmanager

import uvicorn

from kvseal.engine.build import WorkerSpec, build_engine
from kvseal.server.metrics import Metrics


def serve_worker(role: str, spec: WorkerSpec, host: str, port: int, transport: str) -> None:
    metrics = Metrics()
    if role == "decode":
        from kvseal.server.decode import DecodeService, decode_app
        from kvseal.transfer.shm import ShmPool

        shm = ShmPool(f"kvseal-decode-{port}-{os.getpid()}")
        engine, lm, sizing = build_engine(spec, role="decode", storage=shm.create, metrics=metrics)
        svc = DecodeService(engine, lm.model.cfg.eos_token_ids, str(shm.path), f"{host}:{port}")
        app = decode_app(svc)
    else:
        from kvseal.server.prefill import PrefillService, prefill_app
        from kvseal.transfer.shm import ShmWriter

        engine, lm, sizing = build_engine(spec, role="prefill", metrics=metrics)
        from kvseal.faults import Faults

        app = prefill_app(PrefillService(engine, ShmWriter(), f"http://{host}:{port}", Faults.from_env()))
    print(f"{role} worker on {host}:{port}\n{sizing.table()}", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        if role == "decode":
            shm.close()


def serve_router(a: argparse.Namespace) -> None:
    from kvseal.model.loader import default_model_path, load_tokenizer
    from pathlib import Path

    from kvseal.server.api import create_app
    from kvseal.server.router import DisaggBackend
    from kvseal.server.tenants import Tenants

    path = Path(a.model) if a.model else default_model_path()
    name = path.stem if path.is_file() else path.name
    from kvseal.cli import protections

    backend = DisaggBackend(a.prefill, a.decode, name, timeout=a.timeout, protections=protections(a))
    metrics = Metrics()
    app = create_app(backend, load_tokenizer(path), metrics, Tenants.parse(a.api_key))

    @asynccontextmanager
    async def lifespan(_app):
        await backend.refresh()
        task = asyncio.create_task(backend.health_loop())
        yield
        task.cancel()

    app.router.lifespan_context = lifespan
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
