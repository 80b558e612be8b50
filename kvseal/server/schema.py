"""OpenAI request bodies, strict: an unknown or unsupported parameter is a 400 that names it.

Parameters accepted with only their neutral value (``n=1``, penalties 0, ``logprobs`` false) are checked in
``unsupported``; everything else OpenAI defines but kvseal does not implement is rejected by ``extra="forbid"``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvseal.engine.errors import BadRequest


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise BadRequest("only text content parts are supported", param="messages")
            parts.append(p["text"])
        return "".join(parts)


class Sampling(Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # vLLM-style extension; 0 = off
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False  # vLLM-style extension, used by benchmarks

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def unsupported(self) -> None:
        if self.n != 1:
            raise BadRequest("n > 1 is not supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported (only 0)", param=name)


class ChatRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False

    def unsupported(self) -> None:
        super().unsupported()
        if self.logprobs:
            raise BadRequest("logprobs is not supported", param="logprobs")
        if not self.messages:
            raise BadRequest("messages must not be empty", param="messages")

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise BadRequest("echo is not supported", param="echo")
        if self.logprobs:
            raise BadRequest("logprobs is not supported", param="logprobs")
        batch = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str)
        if batch and len(self.prompt) != 1:
            raise BadRequest("a batch of prompts is not supported; send one prompt", param="prompt")
        if not self.prompt:
            raise BadRequest("prompt must not be empty", param="prompt")

    @property
    def max_new(self) -> int | None:
        return self.max_tokens
