"""A bug met by one request fails that request and nothing else: not the connection, not the worker's health
in the router's eyes, not the protocol state of other requests (``kvseal.server.guard.contained``)."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_auth import services

from kvseal.errors import BadRequest, EngineError
from kvseal.server.guard import contained
from kvseal.server.reply import Piece
from kvseal.transfer import messages as P


async def run(app) -> tuple[list[dict], BaseException | None]:
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    try:
        await contained(app, {"type": "http", "method": "POST", "path": "/x"}, receive, send)
    except Exception as e:  # noqa: BLE001 - what the server would see
        return sent, e
    return sent, None


async def raises_at_once(scope, receive, send):
    raise ValueError("a bug")


async def answers_then_raises(scope, receive, send):  # what Starlette does with an unhandled exception
    await send({"type": "http.response.start", "status": 500, "headers": []})
    await send({"type": "http.response.body", "body": b"Internal Server Error"})
    raise ValueError("a bug")


async def breaks_a_stream(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    raise ValueError("a bug")


def test_a_bug_before_the_answer_is_a_json_500_and_the_server_sees_no_exception():
    sent, escaped = asyncio.run(run(raises_at_once))
    assert escaped is None and sent[0]["status"] == 500
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == "internal_error" and "ValueError" in err["message"]


def test_a_bug_after_a_whole_answer_leaves_the_connection_open():
    """An exception that reaches uvicorn closes the connection: the next request on it would be reset."""
    sent, escaped = asyncio.run(run(answers_then_raises))
    assert escaped is None and [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_a_stream_broken_midway_is_still_cut():
    """Its client can learn of the break only from the connection closing."""
    _, escaped = asyncio.run(run(breaks_a_stream))
    assert isinstance(escaped, ValueError)


def test_sampling_parameters_prefill_cannot_take_end_the_transfer_they_opened():
    """A router that sends what the door would have refused (a peer's bug: here a parameter no engine knows) must
    not leave prefill holding the request's transfer open (COMPUTING): a retry of the same Prefill would wait
    for an answer never coming."""
    dec, pre = services()
    lease = P.Lease(rid=7, nonce=77, pages=[0], generations=[1], n_prompt=3, decode_id="d", target="t",
                    layout=[], cap=None)
    msg = P.Prefill(rid=7, tenant="t", prompt=[1, 2, 3], max_new=2, sampling={"temperature": 1.0, "beam": 4},
                    lease=lease, decode_url="http://d")

    async def go() -> None:
        with pytest.raises(BadRequest, match="malformed sampling"):
            await asyncio.wait_for(pre.prefill(msg), 5)
        with pytest.raises(EngineError, match="withdrawn, or already written"):  # the copy: refused, not parked
            await asyncio.wait_for(pre.prefill(msg), 5)

    try:
        asyncio.run(go())
        assert pre.core.transfers == {} and pre.pending == {}
    finally:
        dec.engine.stop()
        pre.engine.stop()


class Broken:
    """A choice whose event stream breaks with a bug after its first piece."""

    tenant = None

    class metrics:  # noqa: N801 - stands in for an instance
        finished = staticmethod(lambda status, tenant: None)

    async def next(self):
        raise ValueError("a bug")

    async def close(self) -> None:
        pass


class Chunks:
    ident = "cmpl-test"

    def chunk(self, choices: list, usage: dict | None = None) -> bytes:
        return f"data: {json.dumps(choices)}\n\n".encode()

    def choice(self, r, text: str, lps, delta: bool, first: bool = False, finish=None) -> dict:
        return {"text": text}


def test_a_stream_whose_choice_meets_a_bug_says_so_and_ends():
    """Before, the choice's pump died with the bug unreported and the stream waited for it for ever."""
    from kvseal.server.reply import sse

    async def drain() -> list[bytes]:
        return [c async for c in sse([Broken()], [Piece("Hi")], Chunks(), False, False)]

    out = asyncio.run(asyncio.wait_for(drain(), 5))
    assert out[-1] == b"data: [DONE]\n\n"
    assert json.loads(out[-2].removeprefix(b"data: "))["error"]["code"] == "internal_error"


class Pieces(Broken):
    """A choice whose pieces come whole: the bug is in formatting them."""

    def __init__(self) -> None:
        self.left = ["lo", None]

    async def next(self):
        text = self.left.pop(0)
        return None if text is None else Piece(text)


class BrokenChunks(Chunks):
    tool_mode = None

    def choice(self, r, text: str, lps, delta: bool, first: bool = False, finish=None) -> dict:
        if not first:
            raise KeyError("delta")  # as a completions choice read as a chat one did (session 36)
        return super().choice(r, text, lps, delta, first, finish)


def test_a_stream_that_meets_a_bug_formatting_a_chunk_says_so_in_band():
    """A bug in the stream's own loop (not in a choice's pump) cut the connection mid-body: the client saw
    "incomplete chunked read" and no error. It is now an in-band error and [DONE], as a pump's bug is."""
    from kvseal.server.reply import sse

    async def drain() -> list[bytes]:
        return [c async for c in sse([Pieces()], [Piece("Hel")], BrokenChunks(), False, False)]

    out = asyncio.run(asyncio.wait_for(drain(), 5))
    assert json.loads(out[0].removeprefix(b"data: ")) == [{"text": "Hel"}]
    assert json.loads(out[-2].removeprefix(b"data: "))["error"]["code"] == "internal_error"
    assert out[-1] == b"data: [DONE]\n\n"


def test_a_router_step_that_meets_a_bug_answers_as_an_unanswered_worker():
    """Each step's answer is what moves the request's machine on: a step that died without one left the
    request waiting for its first token for ever. A bug is answered as a silent worker (what it did is unknown:
    the machine's way for that frees nothing a write may still reach); a forget is answered unconfirmed."""
    from kvseal.engine.request import SamplingParams
    from kvseal.errors import Unanswered
    from kvseal.faults import Faults
    from kvseal.server.backend import GenRequest
    from kvseal.server.router import Flight, HttpPorts

    class Backend:
        subscriber, queue_timeout, faults = "s", 1.0, Faults()

        async def _post(self, *a, **kw):
            raise ValueError("a bug")

        async def _forget(self, *a, **kw):
            raise ValueError("a bug")

        def _spawn(self, coro):
            return asyncio.ensure_future(coro)

    f = Flight(None, type("W", (), {"url": "http://d"})(), type("W", (), {"url": "http://p"})(),
               GenRequest(1, "t", [1, 2], SamplingParams(max_tokens=2)))
    lease = P.Lease(rid=1, nonce=2, pages=[0], generations=[1], n_prompt=2, decode_id="d", target="t", layout=[])
    ports, got = HttpPorts(Backend()), []

    async def go() -> None:
        await ports._reserve(f, got.append)
        await ports._prefill(f, lease, got.append)
        ports.forget(f, 1, 2, got.append)
        await f.step

    asyncio.run(go())
    assert [type(g) for g in got[:2]] == [Unanswered, Unanswered] and got[2] is False


def test_a_body_trickled_in_past_the_limit_is_a_408_and_frees_its_buffer():
    """Without a deadline, a client sending a body a byte at a time (or not at all after its first bytes) held
    the connection and a buffer of up to the size limit for as long as it liked: enough of them fill memory."""
    from kvseal.server.guard import Guard

    reached = []

    async def app(scope, receive, send):  # never reached
        reached.append(scope)

    async def trickle() -> dict:
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b'{"model"', "more_body": True}
        await asyncio.sleep(3600)

    sent: list = []
    out: list[dict] = []

    async def send(msg: dict) -> None:
        out.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"100")]}
    asyncio.run(asyncio.wait_for(Guard(app, None, body_timeout=0.2)(scope, trickle, send), 5))
    assert out[0]["status"] == 408 and not reached
    assert json.loads(out[1]["body"])["error"]["code"] == "request_timeout"
