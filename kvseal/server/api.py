"""The OpenAI-compatible HTTP front door: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

Admission happens here, once, against min(context window, every pool on the path):
a request that can never fit gets 400 ``context_length_exceeded`` before anything is allocated. A streamed
response sends its HTTP status only after the first token has arrived, which is after prefill, transfer and
verification: an error up to that point is a plain JSON error with its own status, never a 200.

A client that leaves while its first token is still coming is noticed (polled, as vLLM does) and its
generation cancelled; what a cancel may stop is the backend's business (the router never cuts a transfer in
half). After the first token, leaving ends the stream, which aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvseal.engine.errors import BadRequest, ContextLengthError, EngineError
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Event
from kvseal.server.backend import Backend, GenRequest
from kvseal.server.metrics import Metrics
from kvseal.server.schema import ChatRequest, CompletionRequest, Sampling
from kvseal.server.tenants import Tenants
from kvseal.server.text import TextStream


class ModelNotFound(BadRequest):
    status = 404
    code = "model_not_found"


class ClientGone(Exception):
    """The client disconnected before its response started: nobody is left to answer."""


T = TypeVar("T")


async def unless_gone(request: Request, aw: Awaitable[T], poll: float = 0.25) -> T:
    """Await ``aw``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(aw)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})
                raise ClientGone()
    except asyncio.CancelledError:
        task.cancel()
        raise
    return task.result()


def error_response(e: EngineError) -> JSONResponse:
    """OpenAI's error body; capacity answers (429/503) say when to come back, as vLLM and OpenAI do."""
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse({"error": e.to_dict()}, status_code=e.status, headers=headers)


async def parse(request: Request, model: type[Sampling]) -> Sampling:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = "unsupported parameter" if err["type"] == "extra_forbidden" else err["msg"]
        raise BadRequest(f"{param}: {msg}", param=param) from None
    req.unsupported()
    return req


def create_app(backend: Backend, tokenizer: object, metrics: Metrics, tenants: Tenants | None = None) -> FastAPI:
    app = FastAPI(title="kvseal")
    tenants = tenants or Tenants()

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, e: EngineError) -> JSONResponse:
        metrics.requests.labels(str(e.status)).inc()
        return error_response(e)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone) -> Response:
        metrics.requests.labels("499").inc()
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.get("/health")
    async def health() -> JSONResponse:
        h = await backend.health()
        return JSONResponse(h, status_code=200 if h.get("status") == "ok" else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": backend.model_name, "object": "model", "created": 0, "owned_by": "kvseal",
            "max_model_len": backend.context_window, "context_length": backend.context_window,
            "kv_pool_tokens": backend.pool_tokens}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await parse(request, ChatRequest)
        msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages]
        prompt = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
        return await serve(request, req, prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        p = req.prompt
        if isinstance(p, list) and isinstance(p[0], str):
            p = p[0]
        prompt = tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
        if not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        return await serve(request, req, prompt, chat=False)

    async def serve(request: Request, req: Sampling, prompt: list[int], chat: bool) -> Response:
        tenant = tenants.authenticate(request.headers.get("authorization"))
        if req.model != backend.model_name:
            raise ModelNotFound(f"model {req.model!r} does not exist; this server serves {backend.model_name!r}",
                                param="model")
        max_new = req.max_new
        if max_new is None:  # as vLLM: whatever the context leaves
            max_new = backend.context_window - len(prompt)
        too_long = len(prompt) + max_new > min(backend.context_window, backend.pool_tokens)
        if max_new < 1 or (too_long and backend.prot.admission):
            raise ContextLengthError(len(prompt), max(max_new, 1), backend.context_window, backend.pool_tokens)
        params = SamplingParams(max_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
                                top_k=req.top_k, seed=req.seed, stop=tuple(req.stop), ignore_eos=req.ignore_eos)
        rid = secrets.randbits(62)
        metrics.prompt_tokens.inc(len(prompt))
        started = time.monotonic()
        stream = Reply(backend.generate(GenRequest(rid, tenant, prompt, params)), TextStream(tokenizer, req.stop),
                       metrics, started)
        first = await unless_gone(request, stream.first())  # raises the request's error before any status
        ident = ("chatcmpl-" if chat else "cmpl-") + f"{rid:x}"
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(sse(stream, first, ident, req.model, chat, len(prompt), usage),
                                     media_type="text/event-stream")
        return await whole(request, stream, first, ident, req.model, chat, len(prompt))

    return app


class Reply:
    """One request's event stream turned into text deltas, with metrics and the stop-string cut."""

    def __init__(self, events: AsyncIterator[Event], text: TextStream, metrics: Metrics, started: float) -> None:
        self.events = events
        self.text = text
        self.metrics = metrics
        self.started = started
        self.last = started
        self.n_tokens = 0
        self.finish: str | None = None

    async def first(self) -> str:
        try:
            return await self.next() or ""
        except BaseException:
            await self.close()
            raise

    async def next(self) -> str | None:
        """Next text delta ('' allowed); None when finished."""
        if self.finish:
            return None
        ev = await self.events.__anext__()
        if ev.error is not None:
            raise ev.error
        now = time.monotonic()
        if ev.token_ids:
            (self.metrics.ttft if self.n_tokens == 0 else self.metrics.itl).observe(now - self.last)
            self.last = now
            self.n_tokens += len(ev.token_ids)
            self.metrics.generation_tokens.inc(len(ev.token_ids))
        delta = self.text.push(ev.token_ids, final=ev.finish_reason is not None)
        if self.text.stopped:
            self.finish = "stop"
            await self.close()  # abort the generation: the rest would be thrown away
        elif ev.finish_reason:
            if ev.finish_reason not in ("stop", "length"):
                raise EngineError(f"request ended with {ev.finish_reason}")
            self.finish = ev.finish_reason
        if self.finish:
            self.metrics.requests.labels("200").inc()
        return delta

    async def close(self) -> None:
        await self.events.aclose()


def _usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _choice(chat: bool, text: str, finish: str | None, delta: bool, first: bool = False) -> dict:
    if not chat:
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if delta:
        d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": None}


async def whole(request: Request, stream: Reply, first: str, ident: str, model: str, chat: bool,
                n_prompt: int) -> Response:
    parts = [first]
    try:
        while (d := await stream.next()) is not None:
            parts.append(d)
            if await request.is_disconnected():
                await stream.close()
                return Response(status_code=499)
    except EngineError as e:
        stream.metrics.requests.labels(str(e.status)).inc()
        return error_response(e)
    obj = "chat.completion" if chat else "text_completion"
    return JSONResponse({"id": ident, "object": obj, "created": int(time.time()), "model": model,
                         "choices": [_choice(chat, "".join(parts), stream.finish, delta=False)],
                         "usage": _usage(n_prompt, stream.n_tokens)})


async def sse(stream: Reply, first: str, ident: str, model: str, chat: bool, n_prompt: int,
              include_usage: bool) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(choices: list, usage: dict | None = None) -> bytes:
        body = {"id": ident, "object": obj, "created": created, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n".encode()

    try:
        yield chunk([_choice(chat, first, stream.finish, delta=True, first=True)])
        while (d := await stream.next()) is not None:
            if d or stream.finish:
                yield chunk([_choice(chat, d, stream.finish, delta=True)])
        if include_usage:
            yield chunk([], _usage(n_prompt, stream.n_tokens))
        yield b"data: [DONE]\n\n"
    except EngineError as e:  # the status is sent already: say so in-band, never pretend success
        stream.metrics.requests.labels(str(e.status)).inc()
        yield f"data: {json.dumps({'error': e.to_dict()})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        await stream.close()
