"""API key → tenant id. With no keys configured every caller is tenant ``default`` (like vLLM without
``--api-key``); with keys, a missing or unknown key is a 401. The tenant is set by the server, never by the
client, and travels with the request to every worker: the prefix cache salts its keys with it, and shared
pages are tagged with the tenant's cache namespace.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from kvseal.errors import BadRequest


class Unauthorized(BadRequest):
    status = 401
    code = "invalid_api_key"


class Forbidden(BadRequest):
    status = 403
    code = "forbidden"


class NotFound(BadRequest):
    status = 404
    code = "not_found"


class Tenants:
    def __init__(self, keys: dict[str, str] | None = None, admin: str | None = None) -> None:
        self.keys = dict(keys or {})
        self.admin = admin  # the operator's key (--admin-key): the dashboard, tenant names

    def authenticate_admin(self, authorization: str | None) -> None:
        """The admin key, or 404 (no admin key configured), 403 (a tenant's key) or 401 (anything else)."""
        if not self.admin:
            raise NotFound("the dashboard needs --admin-key")
        token = (authorization or "").removeprefix("Bearer ").strip().encode()
        if hmac.compare_digest(self.admin.encode(), token):
            return
        if any(hmac.compare_digest(k.encode(), token) for k in self.keys):
            raise Forbidden("this key is a tenant's, not the admin's")
        raise Unauthorized("invalid or missing admin key")

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

    @classmethod
    def load(cls, specs: list[str], path: str | None = None, admin: str | None = None) -> Tenants:
        """``--api-key`` pairs plus a file of ``KEY=TENANT`` lines (``#`` comments): keys out of ``ps``."""
        lines = Path(path).read_text().splitlines() if path else []
        t = cls.parse([*specs, *(ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))])
        if admin is not None and admin in t.keys:
            raise ValueError("--admin-key must differ from every tenant's key")
        t.admin = admin
        return t

    def describe(self) -> str:
        """The line a server prints at start."""
        if not self.keys:
            return "tenants: single-tenant (no API keys: every caller is tenant 'default' and shares its cache)"
        return f"tenants: {len(set(self.keys.values()))} tenant(s), {len(self.keys)} API key(s)"

    def authenticate(self, authorization: str | None) -> str:
        if not self.keys:
            return "default"
        token = (authorization or "").removeprefix("Bearer ").strip().encode()
        tenant = None
        for key, t in self.keys.items():  # every key compared, in constant time: no timing oracle on keys
            if hmac.compare_digest(key.encode(), token):
                tenant = t
        if tenant is None:
            raise Unauthorized("invalid or missing API key")
        return tenant
