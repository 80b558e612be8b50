"""A request's answer: each choice's event stream turned into text pieces, then one JSON body or an SSE stream.

A request has one ``Reply`` per choice (``n`` choices for each prompt of a completions batch), each with its
own index. A streamed answer interleaves the choices' chunks as they come; a whole one waits for all. An
error in any choice before the status went out is that error's JSON body; after it (streaming), an in-band
error event, never a quiet 200.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response

from kvseal.engine.request import Event
from kvseal.errors import EngineError
from kvseal.server.metrics import Metrics
from kvseal.server.text import TextStream, TokenStrings
from kvseal.server.tools import StreamedCalls, answer
from kvseal.transfer.messages import Logprob

log = logging.getLogger("kvseal.api")


def error_response(e: EngineError) -> JSONResponse:
    """OpenAI's error body; capacity answers (429/503) say when to come back, as vLLM and OpenAI do."""
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse({"error": e.to_dict()}, status_code=e.status, headers=headers)


@dataclass
class Piece:
    text: str
    logprobs: tuple[Logprob, ...] = ()
    finish: str | None = None  # the choice's finish reason, if this is its last piece


class Reply:
    """One choice's event stream turned into text pieces, with metrics and the stop-string cut."""

    def __init__(self, index: int, events: AsyncIterator[Event], text: TextStream, metrics: Metrics,
                 started: float, silent: bool = False) -> None:
        self.index = index
        self.silent = silent  # echo with max_tokens 0: the one token generated is dropped, the prompt alone goes out
        self.events = events
        self.text = text
        self.metrics = metrics
        self.started = self.last = started
        self.n_tokens = 0
        self.offset = 0  # characters sent so far (completions' text_offset)
        self.finish: str | None = None
        self.cached_tokens = 0  # of the prompt, read from the prefix cache
        self.tenant: str | None = None
        self.prompt_lps: tuple[Logprob, ...] = ()  # prompt tokens 1.., when asked for (echo with logprobs)
        self.echo_ids: list[int] | None = None  # the prompt, while its logprobs wait to go out before the output's

    async def first(self) -> Piece:
        try:
            return await self.next() or Piece("", finish=self.finish)
        except BaseException:
            await self.close()
            raise

    async def next(self) -> Piece | None:
        """The next piece (its text may be ''); None when finished."""
        if self.finish:
            return None
        ev = await self.events.__anext__()
        if ev.error is not None:
            raise ev.error
        now = time.monotonic()
        if self.silent:
            if ev.token_ids:
                self.cached_tokens, self.prompt_lps = ev.cached_tokens, ev.prompt_logprobs
            if ev.finish_reason and ev.finish_reason not in ("stop", "length"):
                raise EngineError(f"request ended with {ev.finish_reason}")
            self.finish = "length" if ev.finish_reason else None  # no output: max_tokens (0) reached
            return Piece("", (), self.finish)
        if ev.token_ids:
            if self.n_tokens == 0:
                self.cached_tokens, self.prompt_lps = ev.cached_tokens, ev.prompt_logprobs
            (self.metrics.ttft if self.n_tokens == 0 else self.metrics.itl).observe(now - self.last)
            self.last = now
            self.n_tokens += len(ev.token_ids)
            self.metrics.generation_tokens.inc(len(ev.token_ids))
        delta = self.text.push(ev.token_ids, final=ev.finish_reason is not None,
                               stop_token=ev.finish_reason == "stop")
        if self.text.stopped:
            self.finish = "stop"
            await self.close()  # abort the generation: the rest would be thrown away
        elif ev.finish_reason:
            if ev.finish_reason not in ("stop", "length"):
                raise EngineError(f"request ended with {ev.finish_reason}")
            self.finish = ev.finish_reason
        return Piece(delta, ev.logprobs, self.finish)

    async def close(self) -> None:
        await self.events.aclose()


class Formatter:
    """OpenAI's response shapes for chat and completions: choices, logprobs, usage."""

    def __init__(self, ident: str, model: str, chat: bool, strings: TokenStrings, n_prompt: int,
                 cached: int = 0, tool_mode: object = None, echo_k: int | None = None,
                 prompt_k: int | None = None) -> None:
        self.ident, self.model, self.chat, self.strings, self.n_prompt = ident, model, chat, strings, n_prompt
        self.cached = cached
        self.echo_k = echo_k  # completions' logprobs: the echoed prompt's alternatives, as many as the output's
        self.prompt_k = prompt_k  # vLLM's prompt_logprobs: the answer carries them, with this many alternatives
        self.tool_mode = tool_mode  # a Tool, "required" or "auto": the output is or may be tool calls (tools.py)
        self.streamed: dict[int, StreamedCalls] = {}
        self.created = int(time.time())

    def usage(self, replies: list[Reply]) -> dict:
        out = sum(r.n_tokens for r in replies)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": out, "total_tokens": self.n_prompt + out,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def choice(self, r: Reply, text: str, lps: tuple[Logprob, ...] | None, delta: bool, first: bool = False,
               finish: str | None = None) -> dict:
        logprobs = self.logprobs(r, lps) if lps is not None else None
        finish = finish if delta else r.finish
        if not self.chat:
            c = {"index": r.index, "text": text, "finish_reason": finish, "logprobs": logprobs}
            return c | {"prompt_logprobs": self.prompt_logprobs(r)} if self.prompt_k is not None and not delta else c
        if delta:
            if self.tool_mode is not None:
                streamed = self.streamed.setdefault(r.index, StreamedCalls(self.tool_mode))
                d = streamed.delta(text, first, finish)
                finish = streamed.finish_reason(finish)
            else:
                d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": r.index, "delta": d, "finish_reason": finish, "logprobs": logprobs}
        message = {"role": "assistant", "content": text}
        if self.tool_mode is not None:
            content, made = answer(self.tool_mode, text)
            if made:
                message = {"role": "assistant", "content": content, "tool_calls": made}
                finish = "tool_calls" if self.tool_mode == "auto" and finish == "stop" else finish
        return {"index": r.index, "message": message, "finish_reason": finish, "logprobs": logprobs}

    def logprobs(self, r: Reply, lps: tuple[Logprob, ...]) -> dict:
        s = self.strings
        if self.chat:
            def entry(tid: int, lp: float) -> dict:
                return {"token": s.text(tid), "logprob": lp, "bytes": list(s.bytes(tid))}
            return {"content": [entry(x.token, x.logprob) | {"top_logprobs": [entry(t, v) for t, v in x.top]}
                                for x in lps]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if r.echo_ids is not None:  # echoed: the prompt's tokens first, the first with nothing to predict it
            prompt, r.echo_ids = r.echo_ids, None
            out["token_logprobs"] += [None] + [x.logprob for x in r.prompt_lps]
            out["top_logprobs"] += [None] + [{s.text(t): v for t, v in x.top[:self.echo_k]} for x in r.prompt_lps]
            for tid in prompt:
                out["tokens"].append(s.text(tid))
                out["text_offset"].append(r.offset)
                r.offset += len(out["tokens"][-1])
        for x in lps:
            out["tokens"].append(s.text(x.token))
            out["text_offset"].append(r.offset)
            r.offset += len(out["tokens"][-1])
        out["token_logprobs"] += [x.logprob for x in lps]
        out["top_logprobs"] += [{s.text(t): v for t, v in x.top} for x in lps]
        return out

    def prompt_logprobs(self, r: Reply) -> list[dict | None]:
        """vLLM's shape: per prompt token, None for the first, then {token id: {logprob, rank, decoded_token}} for
        the token itself and the ``prompt_k`` most likely."""
        s, out = self.strings, [None]
        for x in r.prompt_lps:
            entry = {str(x.token): {"logprob": x.logprob, "rank": x.rank, "decoded_token": s.text(x.token)}}
            for rank, (t, v) in enumerate(x.top[: self.prompt_k], 1):
                entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": s.text(t)})
            out.append(entry)
        return out

    def chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.ident, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, allow_nan=False)}\n\n".encode()  # strict JSON, as JSONResponse writes

    def body(self, replies: list[Reply], texts: list[str], lps: list[tuple[Logprob, ...] | None]) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        body = {"id": self.ident, "object": obj, "created": self.created, "model": self.model,
                "choices": [self.choice(r, t, lp, delta=False) for r, t, lp in zip(replies, texts, lps)],
                "usage": self.usage(replies)}
        if self.chat and self.prompt_k is not None:  # vLLM: one list for the request's one prompt
            body["prompt_logprobs"] = self.prompt_logprobs(replies[0])
        return body


async def close_all(replies: list[Reply], tasks: list[asyncio.Task]) -> None:
    """Stop the tasks reading the replies (a generator cannot be closed while a task is inside it), then
    close every reply: a choice still generating is aborted."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for r in replies:
        await r.close()


async def whole(replies: list[Reply], firsts: list[Piece], fmt: Formatter, want_logprobs: bool) -> Response:
    """Every choice to its end, then one JSON body."""
    async def collect(r: Reply, first: Piece) -> tuple[str, tuple[Logprob, ...]]:
        parts, lps = [first.text], list(first.logprobs)
        while (pc := await r.next()) is not None:
            parts.append(pc.text)
            lps.extend(pc.logprobs)
        return "".join(parts), tuple(lps)

    tasks = [asyncio.ensure_future(collect(r, f)) for r, f in zip(replies, firsts)]
    try:
        done = await asyncio.gather(*tasks)
    except EngineError as e:
        replies[0].metrics.finished(e.status, replies[0].tenant)
        return error_response(e)
    finally:
        await close_all(replies, tasks)
    served(replies)
    texts = [t for t, _ in done]
    return JSONResponse(fmt.body(replies, texts, [lp if want_logprobs else None for _, lp in done]))


def served(replies: list[Reply]) -> None:
    r = replies[0]
    r.metrics.served(r.tenant, time.monotonic() - r.started, sum(x.n_tokens for x in replies))


async def sse(replies: list[Reply], firsts: list[Piece], fmt: Formatter, want_logprobs: bool,
              include_usage: bool, continuous: bool = False) -> AsyncIterator[bytes]:
    """The choices' chunks interleaved as they come, then usage (if asked) and ``[DONE]``. ``continuous``
    (vLLM's ``continuous_usage_stats``): every chunk also carries the usage so far."""
    def so_far() -> dict | None:
        return fmt.usage(replies) if continuous else None

    q: asyncio.Queue = asyncio.Queue()

    async def pump(r: Reply) -> None:
        try:
            while (pc := await r.next()) is not None:
                await q.put((r, pc))
        except EngineError as e:
            await q.put((r, e))
        except Exception as e:  # noqa: BLE001 - a bug: the stream says so and ends; it must not wait for ever
            log.error("unhandled error in a stream of %s", fmt.ident, exc_info=e)
            await q.put((r, EngineError(f"internal error ({type(e).__name__})")))
        await q.put((r, None))

    def lp(pc: Piece) -> tuple[Logprob, ...] | None:
        return pc.logprobs if want_logprobs else None

    tasks: list[asyncio.Task] = []
    try:
        for r, f in zip(replies, firsts):
            yield fmt.chunk([fmt.choice(r, f.text, lp(f), delta=True, first=True, finish=f.finish)], so_far())
        tasks = [asyncio.ensure_future(pump(r)) for r in replies]
        live = len(replies)
        while live:
            r, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, EngineError):  # the status is sent already: say so in-band
                r.metrics.finished(item.status, r.tenant)
                log.warning("request %s failed mid-stream: tenant=%s status=%s %s", fmt.ident, r.tenant, item.status,
                            item)
                yield f"data: {json.dumps({'error': item.to_dict()})}\n\n".encode()
                yield b"data: [DONE]\n\n"
                return
            elif item.text or item.finish or item.logprobs and want_logprobs:
                c = fmt.choice(r, item.text, lp(item), delta=True, finish=item.finish)
                # a "required" tool call's text waits for its end: nothing to send until then
                if fmt.tool_mode is None or c["delta"] or c["finish_reason"] or c["logprobs"]:
                    yield fmt.chunk([c], so_far())
        served(replies)
        if include_usage:
            yield fmt.chunk([], fmt.usage(replies))
        yield b"data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - a bug here, as one in a pump: said in-band, never a cut connection
        log.error("unhandled error in a stream of %s", fmt.ident, exc_info=e)
        err = EngineError(f"internal error ({type(e).__name__})")
        replies[0].metrics.finished(err.status, replies[0].tenant)
        yield f"data: {json.dumps({'error': err.to_dict()})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        await close_all(replies, tasks)
