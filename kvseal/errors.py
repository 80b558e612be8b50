"""Errors that end a request, each with the HTTP status and OpenAI-style code it maps to.

Status follows the threat model: 400 for requests that can never fit, 429/503 for capacity and faults,
500 for integrity failures. The original error travels unchanged from wherever it was raised.
"""

from __future__ import annotations


class EngineError(Exception):
    status = 500
    code = "internal_error"
    type = "server_error"
    param: str | None = None

    def to_dict(self) -> dict:
        return {"message": str(self), "type": self.type, "param": self.param, "code": self.code}


class BadRequest(EngineError):
    status = 400
    code = "invalid_request"
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code:
            self.code = code


class ContextLengthError(BadRequest):
    """prompt + max_tokens exceeds min(context window, pool capacity): can never be served."""

    def __init__(self, prompt: int, max_tokens: int, context: int, pool: int, param: str = "messages") -> None:
        limit, what = (context, "context window") if context <= pool else (pool, "KV pool capacity")
        super().__init__(
            f"This request needs {prompt + max_tokens} tokens ({prompt} in the prompt + {max_tokens} max_tokens), "
            f"but the {what} is {limit} tokens (context window {context}, KV pool {pool}).",
            param=param, code="context_length_exceeded")
        self.limit = limit


class Overloaded(EngineError):
    status = 503
    code = "service_unavailable"
    type = "server_error"


class PoolFull(Overloaded):
    """Decode's KV pool had no room for a reservation within its wait (``--reserve-wait``)."""
    code = "kv_pool_full"


class Unanswered(Overloaded):
    """A worker never answered (refused, reset, or still busy at the timeout): what it did is unknown."""


class TooManyRequests(EngineError):
    """Shed at the door: more in flight than the workers are allowed to queue. Retry later."""

    status = 429
    code = "too_many_requests"
    type = "server_error"


class KVIntegrityError(EngineError):
    status = 500
    code = "kv_integrity_error"
    type = "server_error"
