"""OpenAI's Responses API (``POST /v1/responses``, the ``openai`` client's ``responses.create``), as vLLM serves it.

A Responses request is a chat request in other words: ``instructions`` is a system message, ``input`` the
conversation (a string, or items: messages with text parts, earlier ``function_call`` items and their
``function_call_output`` answers), ``max_output_tokens`` the output's bound, ``text.format`` the output's form
(as ``response_format``), and function ``tools`` flattened. ``to_chat`` turns it into a ``ChatRequest``, so it is
admitted, templated, sampled, isolated and metered exactly as ``/v1/chat/completions`` is; only the answer's
shape differs (``Answer``): one ``Response`` object, or its stream of typed events (``response.created`` …
``response.output_text.delta`` … ``response.completed``).

Nothing is stored. ``store`` is accepted and answered ``false``; ``previous_response_id``, ``conversation``,
``background`` and item references, which need a stored response, are a 400, and ``GET /v1/responses/{id}`` a
404. A stored response would be a second place where one tenant's text waits for a reader; kvseal keeps none.
Tool calls stream whole: their items come when the output has ended (the text that holds them is read as
``/v1/chat/completions`` reads it).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from kvseal.engine.request import SEED_MAX, SEED_MIN
from kvseal.errors import BadRequest, EngineError
from kvseal.server.reply import Formatter, Piece, Reply, close_all, error_response, served
from kvseal.server.schema import ChatRequest, Strict
from kvseal.server.tools import answer

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` entry served: the output text's logprobs


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for reasoning models: nothing to do here


class ResponsesRequest(Strict):
    """The fields served; any other is a 400 that names it (as the other endpoints answer)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # OpenAI's include_obfuscation: padding kvseal never sends
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint: kvseal's cache is the tenant's, whatever the key
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" drops turns: not served
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    # vLLM's extensions (top_k, logit_bias, skip_special_tokens, cache_salt) and chat's (min_p, seed,
    # repetition_penalty)
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)


NOT_STORED = "this server stores no responses (store is answered false)"


class ResponseNotFound(BadRequest):
    status = 404
    code = "not_found"


# the chat request's fields as the Responses request names them
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text.format", "logprobs": "include"}


@contextmanager
def responses_params() -> Iterator[None]:
    """An error raised on the chat path names the field the client sent: ``input``, not ``messages``."""
    try:
        yield
    except EngineError as e:
        if e.param is not None:
            head, _, rest = e.param.partition(".")
            e.param = PARAMS.get(head, head) + (f".{rest}" if rest else "")
            if head == "tools":  # tools.N.function.name: the Responses tool is flat
                e.param = e.param.replace(".function.", ".")
        raise


def to_chat(req: ResponsesRequest) -> ChatRequest:
    """The same request as ``/v1/chat/completions`` takes it; a 400 naming the field for what is not served."""
    if req.previous_response_id is not None:
        raise BadRequest(f"previous_response_id needs a stored response: {NOT_STORED}; send the conversation "
                         "in input", param="previous_response_id")
    if req.conversation is not None:
        raise BadRequest(f"conversation needs stored items: {NOT_STORED}; send the conversation in input",
                         param="conversation")
    if req.background:
        raise BadRequest(f"background needs a stored response to poll: {NOT_STORED}", param="background")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise BadRequest("reasoning: this model does not reason (no reasoning parser is served)", param="reasoning")
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")
    unknown = sorted(set(req.include or ()) - {LOGPROBS})
    if unknown:
        raise BadRequest(f"include: {unknown[0]!r} is not served (only {LOGPROBS!r})", param="include")
    chat: dict[str, Any] = {"model": req.model, "messages": messages(req), "stream": req.stream,
                            "parallel_tool_calls": req.parallel_tool_calls}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("top_k", "top_k"), ("min_p", "min_p"), ("seed", "seed"),
                     ("repetition_penalty", "repetition_penalty"), ("user", "user"), ("logit_bias", "logit_bias"),
                     ("skip_special_tokens", "skip_special_tokens"), ("cache_salt", "cache_salt")):
        if getattr(req, src) is not None:
            chat[dst] = getattr(req, src)
    if LOGPROBS in (req.include or ()):
        chat["logprobs"] = True
        chat["top_logprobs"] = req.top_logprobs or 0
    if req.tools:
        chat["tools"] = [tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = tool_choice(req.tool_choice)
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise BadRequest("text.format json_schema needs a schema", param="text.format.schema")
        schema = {"name": fmt.name or "response", "schema": fmt.schema_} if fmt.type == "json_schema" else None
        chat["response_format"] = {"type": fmt.type} | ({"json_schema": schema} if schema else {})
    try:
        out = ChatRequest.model_validate(chat)
    except ValidationError as e:  # what the chat request refuses beyond these bounds (a tool's name, say)
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise BadRequest(f"{param}: {err['msg']}", param=param) from None
    out.unsupported()
    return out


def _text(content: object, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content as text: a string, or text parts (``input_text``, ``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content is a string or a list of text parts", param=where)
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in kinds or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise BadRequest(f"{where}.{j}: only text parts ({', '.join(kinds)}) are served, not {kind!r}",
                             param=f"{where}.{j}")
        parts.append(p["text"])
    return "".join(parts)


def messages(req: ResponsesRequest) -> list[dict]:
    """``instructions`` and ``input`` as chat messages. Consecutive ``function_call`` items are one assistant
    turn's calls; a ``function_call_output`` is the ``tool`` message answering one."""
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    if not req.input:
        raise BadRequest("input must not be empty", param="input")
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role: one of user, system, developer, assistant", param=f"{where}.role")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text(item.get("content"), f"{where}.content", kinds + ("text",))
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and out[-1]["content"] is None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output", ("input_text",))
            out.append({"role": "tool", "content": text, "tool_call_id": _field(item, "call_id", where)})
        elif kind == "item_reference":
            raise BadRequest(f"{where}: an item reference needs a stored response: {NOT_STORED}", param=where)
        else:
            raise BadRequest(f"{where}: items of type {kind!r} are not served (messages, function_call and "
                             "function_call_output are)", param=f"{where}.type")
    return out


def _field(item: dict, name: str, where: str) -> str:
    v = item.get(name)
    if not isinstance(v, str):
        raise BadRequest(f"{where}.{name}: a string is required", param=f"{where}.{name}")
    return v


def tool(t: dict, i: int) -> dict:
    """A Responses function tool (flat: ``name``, ``parameters`` beside ``type``) as a chat tool."""
    if t.get("type") != "function":
        raise BadRequest(f"tools.{i}: only function tools are served, not {t.get('type')!r}", param=f"tools.{i}.type")
    unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise BadRequest(f"tools.{i}.{unknown[0]}: unsupported parameter", param=f"tools.{i}.{unknown[0]}")
    return {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}


def tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or set(choice) != {"type", "name"}:
        raise BadRequest('tool_choice: "none", "auto", "required" or {"type": "function", "name": ...}',
                         param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


class Answer:
    """The answer's shape: the ``Response`` object, its output items, and its stream of typed events."""

    def __init__(self, req: ResponsesRequest, chat: ChatRequest, fmt: Formatter) -> None:
        self.req, self.chat, self.fmt, self.tool_mode = req, chat, fmt, fmt.tool_mode
        self.id = "resp_" + secrets.token_hex(24)
        self.created = int(time.time())
        self.seq = 0

    def response(self, status: str, output: list[dict], reply: Reply | None = None,
                 error: EngineError | None = None) -> dict:
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": {"code": error.code, "message": str(error)} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": self.chat.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
            "tools": req.tools or [], "top_p": self.chat.top_p, "top_logprobs": req.top_logprobs,
            "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user,
            "usage": self.usage(reply) if reply is not None else None,
        }

    def usage(self, r: Reply) -> dict:
        u = self.fmt.usage([r])
        return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": r.cached_tokens},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    def logprobs(self, r: Reply, lps: tuple) -> list[dict]:
        return self.fmt.logprobs(r, lps)["content"] if self.chat.logprobs and lps else []

    def items(self, r: Reply, text: str, lps: list[dict]) -> list[dict]:
        """The output items of a finished reply: a message with its text, and/or the function calls it made."""
        content, calls = (text, None) if self.tool_mode is None else answer(self.tool_mode, text)
        status = self.status(r)
        out = []
        if content is not None:
            out.append(self.message("msg_" + secrets.token_hex(24), status, content, lps))
        for c in calls or ():
            out.append({"type": "function_call", "id": "fc_" + secrets.token_hex(24), "call_id": c["id"],
                        "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": status})
        return out

    @staticmethod
    def message(ident: str, status: str, text: str | None, lps: list[dict]) -> dict:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": lps}]
        return {"type": "message", "id": ident, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def status(r: Reply) -> str:
        return "incomplete" if r.finish == "length" else "completed"

    def event(self, kind: str, **fields: object) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, allow_nan=False)}\n\n".encode()

    @staticmethod
    async def _rest(r: Reply, first: Piece) -> tuple[str, tuple]:
        """The reply to its end: its whole text and logprobs."""
        parts, lps = [first.text], list(first.logprobs)
        while (pc := await r.next()) is not None:
            parts.append(pc.text)
            lps.extend(pc.logprobs)
        return "".join(parts), tuple(lps)

    async def whole(self, r: Reply, first: Piece) -> Response:
        try:
            text, lps = await self._rest(r, first)
        except EngineError as e:
            r.metrics.finished(e.status, r.tenant)
            return error_response(e)
        finally:
            await close_all([r], [])
        served([r])
        out = self.items(r, text, self.logprobs(r, lps))
        return JSONResponse(self.response(self.status(r), out, r))

    async def stream(self, r: Reply, first: Piece) -> AsyncIterator[bytes]:
        """``response.created``, ``response.in_progress``, then the output items as they form, then
        ``response.completed`` (``response.incomplete`` at ``max_output_tokens``). An error after the stream began
        is an ``error`` event and ``response.failed``: never a quiet end."""
        try:
            yield self.event("response.created", response=self.response("in_progress", []))
            yield self.event("response.in_progress", response=self.response("in_progress", []))
            if self.tool_mode is not None:  # the calls are read out of the whole text: their items come at its end
                text, lps = await self._rest(r, first)
                output = self.items(r, text, self.logprobs(r, lps))
                for i, item in enumerate(output):
                    async for ev in self._item(i, item):
                        yield ev
            else:
                output = []
                async for ev in self._text(r, first, output):
                    yield ev
            served([r])
            final = self.status(r)
            yield self.event(f"response.{final}", response=self.response(final, output, r))
        except EngineError as e:
            r.metrics.finished(e.status, r.tenant)
            yield self.event("error", code=e.code, message=str(e), param=e.param)
            yield self.event("response.failed", response=self.response("failed", [], error=e))
        except Exception as e:  # noqa: BLE001 - a bug: said in-band, as the other streams say it
            err = EngineError(f"internal error ({type(e).__name__})")
            r.metrics.finished(err.status, r.tenant)
            yield self.event("error", code=err.code, message=str(err), param=None)
            yield self.event("response.failed", response=self.response("failed", [], error=err))
        finally:
            await close_all([r], [])

    async def _text(self, r: Reply, first: Piece, output: list[dict]) -> AsyncIterator[bytes]:
        ident = "msg_" + secrets.token_hex(24)
        where = {"item_id": ident, "output_index": 0, "content_index": 0}
        yield self.event("response.output_item.added", output_index=0,
                         item=self.message(ident, "in_progress", None, []))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield self.event("response.content_part.added", item_id=ident, output_index=0, content_index=0, part=part)
        parts, lps, pc = [], [], first
        while pc is not None:
            if pc.text or pc.logprobs and self.chat.logprobs:
                lp = self.logprobs(r, pc.logprobs)
                parts.append(pc.text)
                lps += lp
                yield self.event("response.output_text.delta", **where, delta=pc.text, logprobs=lp)
            pc = await r.next()
        text = "".join(parts)
        yield self.event("response.output_text.done", **where, text=text, logprobs=lps)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}
        yield self.event("response.content_part.done", item_id=ident, output_index=0, content_index=0, part=part)
        item = self.message(ident, self.status(r), text, lps)
        output.append(item)
        yield self.event("response.output_item.done", output_index=0, item=item)

    async def _item(self, i: int, item: dict) -> AsyncIterator[bytes]:
        """A finished item's events, as a stream would have sent them (its text or arguments in one delta)."""
        if item["type"] == "function_call":
            yield self.event("response.output_item.added", output_index=i,
                             item=item | {"arguments": "", "status": "in_progress"})
            where = {"item_id": item["id"], "output_index": i}
            yield self.event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield self.event("response.function_call_arguments.done", **where, arguments=item["arguments"],
                             name=item["name"])
        else:
            part = item["content"][0]
            yield self.event("response.output_item.added", output_index=i,
                             item=self.message(item["id"], "in_progress", None, []))
            where = {"item_id": item["id"], "output_index": i, "content_index": 0}
            yield self.event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                             part=part | {"text": "", "logprobs": []})
            yield self.event("response.output_text.delta", **where, delta=part["text"], logprobs=part["logprobs"])
            yield self.event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
            yield self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                             part=part)
        yield self.event("response.output_item.done", output_index=i, item=item)
