"""Colocated (single-node) serving: one process, one engine doing prefill and decode, no transfer."""

from __future__ import annotations

import argparse

from fastapi import FastAPI

from kvseal.engine.build import WorkerSpec, build_engine
from kvseal.server import listen
from kvseal.server.api import create_app
from kvseal.server.backend import EngineBackend
from kvseal.server.guard import FRONT_MAX_BODY, Guard
from kvseal.server.metrics import Metrics, ScrapeDoor
from kvseal.server.served import front
from kvseal.server.tenants import Tenants


def colocated_app(spec: WorkerSpec, api_keys: list[str] | None = None, keys_file: str | None = None,
                  front_args: argparse.Namespace | None = None) -> tuple[FastAPI, EngineBackend]:
    metrics = Metrics(per_tenant=bool(front_args and front_args.per_tenant_metrics))
    engine, lm, sizing = build_engine(spec, metrics=metrics)
    print(sizing.table(), flush=True)
    served = front(front_args, lm.tokenizer) if front_args is not None else None
    backend = EngineBackend(engine, served.names[0] if served else lm.name, lm.model.cfg.eos_token_ids)
    admin = front_args.admin_key if front_args is not None else None
    return create_app(backend, lm.tokenizer, metrics, Tenants.load(api_keys or [], keys_file, admin), served), backend


def serve(spec: WorkerSpec, host: str, port: int, api_keys: list[str], keys_file: str | None = None,
          front_args: argparse.Namespace | None = None) -> None:
    try:  # before the model loads: a taken port fails now, with its reason (as ``kvseal serve``'s launcher)
        sock = listen.bind(host, port)
    except OSError as e:
        raise SystemExit(f"kvseal: cannot listen on {host}:{port}: {e.strerror}") from None
    app, _ = colocated_app(spec, api_keys, keys_file, front_args)
    listen.run(ScrapeDoor(Guard(app, None, FRONT_MAX_BODY), app.state.metrics), host, port, sock,
               log_level="warning")
