"""OpenAI request bodies, strict: an unknown or unsupported parameter is a 400 that names it.

Besides OpenAI's parameters, the vLLM extensions its users rely on are accepted (``top_k``, ``min_p``,
``min_tokens``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``prompt_logprobs``,
``structured_outputs``, ``include_stop_str_in_output``, ``truncate_prompt_tokens``, ``skip_special_tokens``,
``cache_salt``,
and for chat the template's ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``).
Everything else is rejected by ``extra="forbid"``; combinations kvseal does not serve are rejected in
``unsupported``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvseal.engine.request import SEED_MAX, SEED_MIN
from kvseal.errors import BadRequest

MAX_N = 32  # choices per request (n, or prompts × n in a completions batch)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one of them

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise BadRequest("only text content parts are supported", param="messages")
            parts.append(p["text"])
        return "".join(parts)


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def spec(self) -> dict:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise BadRequest("response_format json_schema needs json_schema.schema", param="response_format")
        schema = self.json_schema.schema_ if self.json_schema else None
        return {"type": self.type, "json_schema": {"schema": schema}}


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs`` (its ``guided_json`` … fields before v0.12): exactly one form the output
    must take, enforced by the same llguidance grammar as ``response_format`` (``kvseal.engine.grammar``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None  # Lark, or GBNF as llama.cpp writes it
    json_object: bool | None = None

    def form(self) -> tuple[str, Any]:
        given = [(k, v) for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                     ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if v is not None]
        if len(given) != 1:
            raise BadRequest("structured_outputs takes exactly one of json, regex, choice, grammar and json_object",
                             param="structured_outputs")
        return given[0]


class Sampling(Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM: 0 or -1 = off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False  # vLLM-style extension, used by benchmarks
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's extension: the answer's prompt_logprobs
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: the output's form
    include_stop_str_in_output: bool = False  # vLLM's: keep the matched stop string (or stop token's text)
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last k tokens; -1: the context's worth
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text (not the one that ends it)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # vLLM's: a prefix-cache salt

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for tok, b in (v or {}).items():
            if not tok.isdigit() or not -100 <= b <= 100:
                raise ValueError("logit_bias maps token ids to values in [-100, 100]")
        return v

    def unsupported(self) -> None:
        if self.min_tokens and self.max_new is not None and self.min_tokens > self.max_new:
            raise BadRequest("min_tokens must not exceed max_tokens", param="min_tokens")
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer it
            raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM answers it
            raise BadRequest("prompt_logprobs is not available with stream: true", param="prompt_logprobs")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1 \
                and self.truncate_prompt_tokens < 1:
            raise BadRequest("truncate_prompt_tokens is -1 (the context's worth) or a positive count",
                             param="truncate_prompt_tokens")
        if self.structured_outputs is not None:
            self.structured_outputs.form()
            if self.response_format is not None and self.response_format.type != "text":
                raise BadRequest("response_format and structured_outputs both set the output's form: give one",
                                 param="structured_outputs")

    def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        pairs = tuple((int(t), b) for t, b in (self.logit_bias or {}).items())
        bad = [t for t, _ in pairs + tuple((t, 0) for t in self.stop_token_ids or ()) if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                             param="logit_bias" if self.logit_bias else "stop_token_ids")
        return pairs

    @property
    def top_logprobs_k(self) -> int | None:
        return None

    @property
    def prompt_logprobs_k(self) -> int | None:
        """How many alternatives each prompt token's logprob comes with, if they are asked for (None: not)."""
        return self.prompt_logprobs

    @property
    def score_only(self) -> bool:
        return False

    @property
    def echo_logprobs(self) -> bool:
        return False

    @property
    def max_new(self) -> int | None:
        return self.max_tokens


class ChatRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, min_length=1)  # OpenAI: [] is too short
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM's extensions: how the chat template renders the messages
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM's: the answer starts with the last message's content when it is the assistant's

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        if not self.messages:
            raise BadRequest("messages must not be empty", param="messages")
        if self.echo and self.tools and self.tool_choice != "none":
            raise BadRequest("echo gives text: not with tool calls", param="echo")
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise BadRequest(f"messages.{i}.content: only an assistant message with tool_calls may leave "
                                 "it out", param=f"messages.{i}.content")
            if (m.role == "tool") != (m.tool_call_id is not None):
                raise BadRequest(f"messages.{i}: a tool message, and only one, names its tool_call_id",
                                 param=f"messages.{i}.tool_call_id")
            if m.tool_calls and m.role != "assistant":
                raise BadRequest(f"messages.{i}: only an assistant message has tool_calls",
                                 param=f"messages.{i}.tool_calls")
        check_tools(self)

    def tool_mode(self, parser: str | None) -> Tool | Literal["required", "auto"] | None:
        """What the output is: one call of the named tool, one or more calls ("required"), text that may hold
        calls in the model's own format ("auto", read by ``parser``), or text."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return next(t for t in self.tools or () if t.function.name == self.tool_choice.function.name)
        if not self.tools or self.tool_choice in ("none", "required"):
            return self.tool_choice if self.tool_choice == "required" else None
        if parser is None:  # "auto", or no choice: OpenAI's default with tools
            raise BadRequest('tool_choice "auto" (the default when tools are given) reads calls out of the model\'s '
                             "text: this server was not started with --enable-auto-tool-choice and a "
                             '--tool-call-parser; ask for "required" or a named function (the output then follows '
                             'the tools\' schemas) or "none"', param="tool_choice")
        return "auto"

    @property
    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def check_tools(req: ChatRequest) -> None:
    """The tool choices kvseal serves: a named function and "required" (constrained to the tools' schemas, as
    vLLM serves them on any model), "none", and "auto" where the server reads calls out of the model's text
    (``ChatRequest.tool_mode``)."""
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) < len(names):
        raise BadRequest("tools: two tools share a name", param="tools")
    choice = req.tool_choice
    if not names:
        if choice is not None and choice != "none":
            raise BadRequest("tool_choice is only allowed when tools are given", param="tool_choice")
        return
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                         param="tool_choice")
    if choice != "none" and req.response_format is not None and req.response_format.type != "text":
        raise BadRequest("response_format and a tool choice both set the output's form: give one",
                         param="response_format")
    if choice != "none" and req.structured_outputs is not None:
        raise BadRequest("structured_outputs and a tool choice both set the output's form: give one",
                         param="structured_outputs")


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions; 0 only with echo
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def unsupported(self) -> None:
        super().unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens: 0 asks for no output: only with echo (to score the prompt)",
                             param="max_tokens")
        if not self.prompt or any(not p for p in self.prompts):
            raise BadRequest("prompt must not be empty", param="prompt")
        if len(self.prompts) * self.n > MAX_N:
            raise BadRequest(f"at most {MAX_N} choices per request (prompts × n)", param="n")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_k(self) -> int | None:
        """echo with logprobs: the prompt's tokens come back with their logprobs too, as OpenAI's legacy
        completions give them (what lm-evaluation-harness scores with)."""
        ks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(ks) if ks else None

    @property
    def echo_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None

    @property
    def score_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone comes back (vLLM generates one token and drops it)."""
        return self.echo and self.max_tokens == 0


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
