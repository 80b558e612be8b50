"""The OpenAI-compatible HTTP front door: /v1/chat/completions, /v1/completions, /v1/responses (the chat path in
the Responses shape, kvseal/server/responses.py), /v1/models, /tokenize, /detokenize, /health, /version, /metrics.

Admission happens here, once, against min(context window, every pool on the path):
a request that can never fit gets 400 ``context_length_exceeded`` before anything is allocated. A streamed
response sends its HTTP status only after the first token has arrived, which is after prefill, transfer and
verification: an error up to that point is a plain JSON error with its own status, never a 200.

A request becomes one generation per choice: ``n`` for each prompt (a completions batch has several), each
with its own seed offset, so choices differ when sampled and reproduce when seeded.

A client that leaves while its first token is still coming is noticed (polled, as vLLM does) and its
generation cancelled; what a cancel may stop is the backend's business (the router never cuts a transfer in
half). After the first token, leaving ends the stream, which aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import ValidationError

from kvseal import __version__
from kvseal.engine.grammar import compile_response_format, compile_structured
from kvseal.engine.request import SamplingParams, choice_seed
from kvseal.errors import BadRequest, ContextLengthError, EngineError
from kvseal.kv.tags import tenant_tag
from kvseal.server.backend import Backend, GenRequest
from kvseal.server.dashboard import PAGE as DASHBOARD
from kvseal.server.dashboard import STATES
from kvseal.server.metrics import Metrics
from kvseal.server.reply import Formatter, Piece, Reply, close_all, error_response, sse, whole
from kvseal.server.responses import NOT_STORED, Answer, ResponseNotFound, ResponsesRequest, responses_params
from kvseal.server.responses import to_chat
from kvseal.server.schema import ChatRequest, CompletionRequest, DetokenizeRequest, Sampling, TokenizeRequest
from kvseal.server.served import Served
from kvseal.server.tenants import Tenants
from kvseal.server.text import TextStream, TokenStrings
from kvseal.server.tools import grammar as tool_grammar
from kvseal.server.tools import template_messages

log = logging.getLogger("kvseal.api")

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


# a JSON escape of a UTF-16 surrogate; a pair of them decodes to one character, a lone one to no text at all
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")

# the chat template's arguments that the front door or apply_chat_template set (documents: not served), which a
# request's chat_template_kwargs may not replace
TEMPLATE_ARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                           "tokenize", "return_dict", "chat_template", "tokenizer"})


def lone_surrogate(x: object) -> bool:
    """Whether a decoded JSON value holds a string no tokenizer can encode (a lone surrogate escape)."""
    todo = [x]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            todo += v.keys()
            todo += v.values()
        elif isinstance(v, list):
            todo += v
    return False


async def parse(request: Request, model: type[T]) -> T:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON here: nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise BadRequest(f"request body is not valid JSON here: {e.args[0].split(';')[0]}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and lone_surrogate(body):
        raise BadRequest("request body is not valid Unicode: it holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = "unsupported parameter" if err["type"] == "extra_forbidden" else err["msg"]
        raise BadRequest(f"{param}: {msg}", param=param) from None
    if isinstance(req, Sampling):
        req.unsupported()
    return req


def create_app(backend: Backend, tokenizer: object, metrics: Metrics, tenants: Tenants | None = None,
               served: Served | None = None) -> FastAPI:
    app = FastAPI(title="kvseal")
    app.state.metrics = metrics  # the server's ScrapeDoor answers /metrics in front of the app
    tenants = tenants or Tenants()
    served = served or Served([backend.model_name], backend.model_name)
    print(tenants.describe(), flush=True)
    strings = TokenStrings(tokenizer)
    vocab = len(tokenizer)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError) -> JSONResponse:
        tenant = getattr(request.state, "tenant", None)
        metrics.finished(e.status, tenant)
        if e.status >= 500:
            log.warning("request failed: tenant=%s status=%s code=%s: %s", tenant, e.status, e.code, e)
        return error_response(e)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:  # logged where it is contained (guard.py)
        metrics.finished(500, getattr(request.state, "tenant", None))
        return error_response(EngineError(f"internal error ({type(e).__name__})"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:  # no such route: not a request counted
        err = BadRequest(str(e.detail), code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code))
        err.status = e.status_code
        return JSONResponse({"error": err.to_dict()}, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _query(request: Request, e: RequestValidationError) -> JSONResponse:  # a bad query parameter
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return await _engine_error(request, BadRequest(f"{param}: {first['msg']}", param=param))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone) -> Response:
        metrics.finished(499, getattr(request.state, "tenant", None))
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.get("/health")
    async def health(full: bool = False) -> JSONResponse:
        h = await backend.health(full)
        return JSONResponse(h, status_code=200 if h.get("status") == "ok" else 503)

    @app.get("/version")
    async def version() -> JSONResponse:  # as vLLM's: what a client or a fleet script asks first
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prom(request: Request) -> Response:
        if metrics.per_tenant:  # tenant names and their cache hits: the admin's to read (--per-tenant-metrics)
            tenants.authenticate_admin(request.headers.get("authorization"))
        return Response(metrics.page(), media_type="text/plain; version=0.0.4")

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(DASHBOARD.read_text(), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    @app.get("/dashboard/data")
    async def dashboard_data(request: Request) -> JSONResponse:
        tenants.authenticate_admin(request.headers.get("authorization"))
        names = {str(tenant_tag(t)): t for t in {*tenants.keys.values(), "default"}}
        return JSONResponse({"states": STATES, "tenants": names, "pools": await backend.pages()},
                            headers={"Cache-Control": "no-store"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "kvseal", "root": served.root, "parent": None,
            "max_model_len": backend.context_window, "context_length": backend.context_window,
            "kv_pool_tokens": backend.pool_tokens} for name in served.names]}

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str) -> dict:  # the openai client's models.retrieve
        card = next((m for m in (await models())["data"] if m["id"] == model), None)
        if card is None:
            raise ModelNotFound(f"model {model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, served.names))}", param="model")
        return card

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        backend.check_capacity()
        req = await parse(request, ChatRequest)
        last = req.messages[-1]
        echo = [last.text()] if req.echo and last.role == "assistant" else None  # vLLM's: the same role's
        return await serve(request, req, [truncated(req, chat_prompt(req))], chat=True, echo=echo)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API over the chat path (kvseal/server/responses.py)."""
        backend.check_capacity()
        req = await parse(request, ResponsesRequest)
        with responses_params():  # an error names the Responses field (input, max_output_tokens), not chat's
            chat_req = to_chat(req)
            prompt = truncated(chat_req, chat_prompt(chat_req))
            [r], [first], fmt = await start(request, chat_req, [prompt], chat=True)
        out = Answer(req, chat_req, fmt)
        if req.stream:
            return StreamingResponse(out.stream(r, first), media_type="text/event-stream")
        return await unless_gone(request, out.whole(r, first))

    @app.api_route("/v1/responses/{ident}", methods=["GET", "DELETE"])
    @app.post("/v1/responses/{ident}/cancel")
    async def stored_response(request: Request, ident: str) -> Response:
        tenants.authenticate(request.headers.get("authorization"))
        raise ResponseNotFound(f"no response {ident!r}: {NOT_STORED}", param="response_id")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        backend.check_capacity()
        req = await parse(request, CompletionRequest)
        given = [encode(p) for p in req.prompts]
        if any(not p for p in given):
            raise BadRequest("prompt must not be empty", param="prompt")
        prompts = [truncated(req, p) for p in given]
        echo = None
        if req.echo:  # the prompt as the model read it: its text, or what is left of it after truncation
            echo = [p if isinstance(p, str) and len(ids) == len(kept) else tokenizer.decode(kept)
                    for p, ids, kept in zip(req.prompts, given, prompts)]
        return await serve(request, req, prompts, chat=False, echo=echo)

    def truncated(req: Sampling, ids: list[int]) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: as many as the context holds)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        window = backend.context_window
        if k == -1:
            k = window
        if k > window:  # vLLM's answer too: a truncation the context could never hold
            raise BadRequest(f"truncate_prompt_tokens ({k}) is greater than the context window ({window})",
                             param="truncate_prompt_tokens")
        return ids[-k:]

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        tenants.authenticate(request.headers.get("authorization"))
        req = await parse(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = chat_prompt(req)
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": backend.context_window, "tokens": ids,
                "token_strs": [strings.text(t) for t in ids]}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        tenants.authenticate(request.headers.get("authorization"))
        req = await parse(request, DetokenizeRequest)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise BadRequest(f"token ids must be in 0..{vocab - 1}", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    def chat_prompt(req: ChatRequest | TokenizeRequest) -> list[int]:
        """The messages through the chat template, as vLLM renders them: ``tools=`` when given, vLLM's
        ``add_generation_prompt``, ``continue_final_message`` (the last message left open, to be continued) and
        ``chat_template_kwargs`` (more variables for the template). A template that refuses the messages
        (``raise_exception``, as many do for roles out of order) is a 400, as in vLLM."""
        import jinja2

        extra = dict(req.chat_template_kwargs or {})
        if reserved := sorted(TEMPLATE_ARGS & extra.keys()):
            raise BadRequest(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        if req.continue_final_message and req.add_generation_prompt:  # vLLM's answer too
            raise BadRequest("continue_final_message and add_generation_prompt cannot both be true",
                             param="continue_final_message")
        msgs = template_messages(req.messages, str(getattr(tokenizer, "chat_template", None) or ""))
        if req.tools:
            extra["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            return list(tokenizer.apply_chat_template(
                msgs, add_generation_prompt=req.add_generation_prompt, tokenize=True, return_dict=False,
                continue_final_message=req.continue_final_message, **extra))
        except jinja2.TemplateError as e:
            raise BadRequest(f"the chat template refused the messages: {e}", param="messages") from None
        except ValueError as e:  # continue_final_message with a last message the template does not show whole
            if not req.continue_final_message:
                raise
            raise BadRequest(f"continue_final_message: {e}", param="continue_final_message") from None

    def encode(p: str | list[int]) -> list[int]:
        if isinstance(p, str):
            return tokenizer.encode(p, add_special_tokens=False)
        if any(not 0 <= t < vocab for t in p):
            raise BadRequest(f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        return list(p)

    async def serve(request: Request, req: Sampling, prompts: list[list[int]], chat: bool,
                    echo: list[str] | None = None) -> Response:
        replies, firsts, fmt = await start(request, req, prompts, chat, echo)
        want = req.top_logprobs_k is not None
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = usage and req.stream_options.continuous_usage_stats
            return StreamingResponse(sse(replies, firsts, fmt, want, usage, continuous),
                                     media_type="text/event-stream")
        return await unless_gone(request, whole(replies, firsts, fmt, want))

    async def start(request: Request, req: Sampling, prompts: list[list[int]], chat: bool,
                    echo: list[str] | None = None) -> tuple[list[Reply], list[Piece], Formatter]:
        """Admit and start every choice; once each has its first piece (or the request its error, raised before
        any status goes out), the replies and the formatter of their answer."""
        tenant = request.state.tenant = tenants.authenticate(request.headers.get("authorization"))
        if req.model not in served.names:
            raise ModelNotFound(f"model {req.model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, served.names))}", param="model")
        with_defaults(req, served.defaults)
        grammar = compile_response_format(req.response_format.spec()) if req.response_format else None
        if req.structured_outputs is not None:  # never beside response_format (Sampling.unsupported)
            grammar = compile_structured(*req.structured_outputs.form())
        tool_mode = req.tool_mode(served.tool_parser) if chat else None
        if tool_mode is not None and tool_mode != "auto":
            grammar = tool_grammar(tool_mode, req.tools, req.parallel_tool_calls)
        common = {"temperature": req.temperature, "top_p": req.top_p, "top_k": max(req.top_k, 0),
                  "min_p": req.min_p, "stop": tuple(req.stop), "stop_token_ids": tuple(req.stop_token_ids or ()),
                  "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens, "logprobs": req.top_logprobs_k,
                  "prompt_logprobs": req.prompt_logprobs_k,
                  "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
                  "repetition_penalty": req.repetition_penalty, "logit_bias": req.bias(vocab), "grammar": grammar}
        plans = [(prompt, admit(req, prompt, chat)) for prompt in prompts]  # all admitted before any generates
        stop_ids = frozenset(req.stop_token_ids or ())
        started = time.monotonic()
        replies: list[Reply] = []
        batch = secrets.randbits(62) if len(plans) * req.n > 1 else None
        for prompt, max_new in plans:
            metrics.prompt_tokens.inc(len(prompt))
            group = secrets.randbits(62) if req.n > 1 else None
            for c in range(req.n):
                seed = None if req.seed is None else choice_seed(req.seed, c)
                params = SamplingParams(max_tokens=max_new, seed=seed, **common)
                rid = group if c == 0 and group is not None else secrets.randbits(62)
                gen = GenRequest(rid, tenant, prompt, params, group, batch, req.cache_salt or "")
                events = backend.generate(gen)
                text = TextStream(tokenizer, req.stop, req.min_tokens, stop_ids, req.include_stop_str_in_output,
                                  req.skip_special_tokens)
                replies.append(Reply(len(replies), events, text, metrics, started, silent=req.score_only))
                replies[-1].tenant = tenant
        firsts = await unless_gone(request, first_pieces(replies))  # raises the request's error before any status
        if echo:
            for r, f in zip(replies, firsts):
                f.text = echo[r.index // req.n] + f.text
        if req.prompt_logprobs_k is not None:
            for r in replies:
                prompt = plans[r.index // req.n][0]
                if len(r.prompt_lps) != len(prompt) - 1:  # a bug: never an answer that misses some
                    await close_all(replies, [])
                    raise EngineError(f"prompt logprobs: {len(r.prompt_lps)} for a prompt of {len(prompt)} tokens")
                r.echo_ids = prompt if req.echo_logprobs else None
        leaders = replies[::req.n]  # each prompt's first choice: the others share its pages, not the cache's
        for (prompt, _), r in zip(plans, leaders):
            metrics.cache_lookup(tenant, len(prompt), r.cached_tokens)
        fmt = Formatter(("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), req.model, chat, strings,
                        sum(len(p) for p in prompts), sum(r.cached_tokens for r in leaders), tool_mode,
                        echo_k=req.top_logprobs_k, prompt_k=req.prompt_logprobs)
        return replies, firsts, fmt

    def admit(req: Sampling, prompt: list[int], chat: bool) -> int:
        """max_tokens for this prompt, or 400 if prompt + max_tokens can never fit (naming ``messages`` or
        ``prompt``, the field the client sent)."""
        max_new = 1 if req.score_only else req.max_new  # one token, generated and dropped, as vLLM does
        if max_new is None:  # as vLLM: whatever the context leaves
            max_new = backend.context_window - len(prompt)
        too_long = len(prompt) + max_new > min(backend.context_window, backend.pool_tokens)
        if max_new < 1 or (too_long and backend.prot.admission):
            raise ContextLengthError(len(prompt), max(max_new, 1), backend.context_window, backend.pool_tokens,
                                     "messages" if chat else "prompt")
        return max_new

    return app


def with_defaults(req: Sampling, defaults: dict) -> None:
    """The generation config's sampling defaults, for the fields the request did not set."""
    given = req.model_fields_set
    for k, v in defaults.items():
        if k == "max_tokens":
            if not {"max_tokens", "max_completion_tokens"} & given:
                req.max_tokens = int(v)
        elif k not in given:
            setattr(req, k, v)


async def first_pieces(replies: list[Reply]) -> list[Piece]:
    """Every choice's first piece; if one fails (or the client leaves), every choice is stopped."""
    tasks = [asyncio.ensure_future(r.first()) for r in replies]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await close_all(replies, tasks)
        raise

