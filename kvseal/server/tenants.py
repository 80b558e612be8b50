"""API key → tenant id. With no keys configured every caller is tenant ``default`` (like vLLM without
``--api-key``); with keys, a missing or unknown key is a 401. The tenant is set by the server, never by the
client, and travels with the request to every worker (a future prefix cache would salt its keys with it).
"""

from __future__ import annotations

from kvseal.engine.errors import BadRequest


class Unauthorized(BadRequest):
    status = 401
    code = "invalid_api_key"


class Tenants:
    def __init__(self, keys: dict[str, str] | None = None) -> None:
        self.keys = dict(keys or {})

    @classmethod
    def parse(cls, specs: list[str]) -> Tenants:
        """``KEY=TENANT`` pairs, as given on the command line."""
        keys = {}
        for spec in specs:
            key, sep, tenant = spec.partition("=")
            if not sep or not key or not tenant:
                raise ValueError(f"--api-key takes KEY=TENANT, not {spec!r}")
            keys[key] = tenant
        return cls(keys)

    def authenticate(self, authorization: str | None) -> str:
        if not self.keys:
            return "default"
        token = (authorization or "").removeprefix("Bearer ").strip()
        if token not in self.keys:
            raise Unauthorized("invalid or missing API key")
        return self.keys[token]
