"""The door of a worker: every request is size-checked and authenticated before any handler sees it.

A pure ASGI middleware, so nothing (routing, JSON parsing, a handler's state) runs for a request that is too
big (413) or not signed by a node allowed on that route (401/403; ``kvseal.transfer.auth``). It reads the
body once, checks it, and hands the same bytes to the app. Handlers find the signer in
``request.state.peer``: ``None`` on an open route called without a signature (``/health``: liveness only).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from kvseal.errors import EngineError
from kvseal.transfer.auth import H_SIG, OPEN, Peer, Verifier

MAX_BODY = 8 << 20  # a Reserve or Prefill carries a prompt (≤ context tokens) and maybe a grammar
FRONT_MAX_BODY = 16 << 20  # the OpenAI door: a completions batch of long prompts, or a large schema
BODY_TIMEOUT = 30.0  # for a request's body to arrive whole: one trickled in holds its buffer (up to the size
# limit) and its connection for as long as its sender likes otherwise
INSECURE = Peer("*", "insecure")  # auth switched off (tests and the signing-cost benchmark only)
log = logging.getLogger("kvseal.guard")


class PayloadTooLarge(EngineError):
    status = 413
    code = "payload_too_large"
    type = "invalid_request_error"  # the sender's to fix, as every 4xx but 429


class RequestTimeout(EngineError):
    status = 408
    code = "request_timeout"
    type = "invalid_request_error"


Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class Guard:
    """``verifier=None``: the size limit only (the OpenAI front door, whose callers hold API keys instead)."""

    def __init__(self, app: Callable, verifier: Verifier | None, max_body: int = MAX_BODY,
                 body_timeout: float = BODY_TIMEOUT) -> None:
        self.app, self.verifier, self.max_body, self.body_timeout = app, verifier, max_body, body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return await reject(send, PayloadTooLarge(f"body over {self.max_body} bytes"))
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return None
                    body += msg.get("body", b"")
                    if len(body) > self.max_body:
                        return await reject(send, PayloadTooLarge(f"body over {self.max_body} bytes"))
                    if not msg.get("more_body"):
                        break
        except TimeoutError:
            late = RequestTimeout(f"the request body was not whole within {self.body_timeout:g} s")
            return await reject(send, late)
        try:
            peer = self.authenticate(scope, headers, bytes(body))
        except EngineError as e:
            return await reject(send, e)
        scope.setdefault("state", {})["peer"] = peer
        return await contained(self.app, scope, replay(bytes(body), receive), send)

    def authenticate(self, scope: Scope, headers: dict[str, str], body: bytes) -> Peer | None:
        if self.verifier is None:
            return INSECURE
        path = scope["path"]
        if path in OPEN and H_SIG not in headers:
            return None
        query = scope.get("query_string", b"").decode("latin-1")
        target = scope.get("raw_path", path.encode()).decode("latin-1") + (f"?{query}" if query else "")
        return self.verifier.check(scope["method"], path, target, headers, body)


async def contained(app: Callable, scope: Scope, receive: Receive, send: Send) -> None:
    """Run ``app`` so that a bug in a handler fails its request and nothing else.

    An exception that leaves an ASGI app makes the server close the connection, even after Starlette has
    answered it with a 500: the client's (or the router's) next request on that kept-alive connection is then
    reset, and a router counts a reset worker as down. So the bug is logged here; a request not yet answered
    gets a JSON 500; one answered whole keeps its connection; only a stream broken midway is cut, since a
    connection closed is all that can tell its client."""
    started = finished = False

    async def watched(msg: dict) -> None:
        nonlocal started, finished
        if msg["type"] == "http.response.start":
            started = True
        elif msg["type"] == "http.response.body" and not msg.get("more_body"):
            finished = True
        await send(msg)

    try:
        return await app(scope, receive, watched)
    except Exception as e:  # noqa: BLE001 - a bug: logged with its traceback, answered 500
        log.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=e)
        if not started:
            return await reject(send, EngineError(f"internal error ({type(e).__name__})"))
        if finished:
            return None
        raise


def peer_of(request: object) -> Peer | None:
    """The authenticated signer of a request (``INSECURE`` where no Guard runs: in-process tests)."""
    return getattr(request.state, "peer", INSECURE)


def replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, once; then the connection's own messages (a disconnect, for streams)."""
    sent = False

    async def again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def reject(send: Send, e: EngineError) -> None:
    body = json.dumps({"error": e.to_dict()}).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
