"""Signed requests between router, prefill and decode: who may call which door, and no replays.

Every node reads one cluster secret from a file that only its user can read (``--cluster-secret-file``;
``kvseal serve`` makes one for its own processes). Each node derives its signing key from it with HKDF
(RFC 5869) over ``cluster | role | node``, so a key names its role and node. A request carries

    x-kvseal-key        secret-id/role/node     (the secret id is a hash of the secret: rotation)
    x-kvseal-created    unix seconds
    x-kvseal-nonce      128 random bits
    x-kvseal-signature  HMAC-SHA256(key, method \\n path?query \\n created \\n nonce \\n cluster \\n sha256(body))

and the receiver recomputes it (it holds the secret, so it can derive any node's key) in constant time.
Answers: no or bad signature, unknown or retired secret id, a timestamp outside ±30 s, a nonce already seen:
401. A valid key whose role may not use this route: 403. A receiver accepts the current secret and the one
before it (``--previous-cluster-secret-file``), so a cluster rotates without a flag day.

What this does not stop: a peer that holds the secret can sign as any role. Per-lease capabilities
(``kvseal.server.decode``) bound what even a signed writer can touch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import ssl
import stat
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvseal.errors import EngineError

ROLES = ("router", "prefill", "decode")
WINDOW = 30.0  # seconds a signature stays valid either side of now
MAX_NODE = 128  # characters of a node name
H_KEY, H_CREATED, H_NONCE, H_SIG = "x-kvseal-key", "x-kvseal-created", "x-kvseal-nonce", "x-kvseal-signature"

# Who may call what: the route table of the cluster. /health answers anyone, with details only to the signed;
# /metrics answers anyone (Prometheus does not sign): a worker's metrics name no tenant.
ROUTES: dict[str, frozenset[str]] = {
    "/kv/reserve": frozenset({"router"}),
    "/kv/abort": frozenset({"router"}),
    "/kv/fence": frozenset({"router"}),
    "/kv/commit": frozenset({"prefill"}),
    "/kv/writer_done": frozenset({"prefill"}),
    "/prefill": frozenset({"router"}),
    "/kv/forget": frozenset({"router", "decode"}),
    "/streams/": frozenset({"router"}),  # a prefix: /streams/{name}
    "/health": frozenset(ROLES),
    "/metrics": frozenset(ROLES),
    "/pages": frozenset({"router"}),  # every page's state and tenant tag: the admin's dashboard
    "/faults": frozenset({"router"}),  # fault injection, only in a worker started with KVSEAL_FAULTS=armable
}
OPEN = frozenset({"/health", "/metrics"})


class Unauthenticated(EngineError):
    status = 401
    code = "unauthenticated"
    type = "authentication_error"


class Forbidden(EngineError):
    status = 403
    code = "forbidden"
    type = "permission_error"


@dataclass(frozen=True)
class Peer:
    role: str
    node: str


def hkdf(secret: bytes, info: bytes) -> bytes:
    prk = hmac.new(b"kvseal-cluster-v1", secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


class ClusterSecret:
    def __init__(self, secret: bytes, cluster: str = "kvseal") -> None:
        if len(secret) < 32:
            raise ValueError("a cluster secret needs at least 32 bytes")
        self._secret = secret
        self.cluster = cluster
        self.id = hashlib.sha256(b"kvseal-secret-id|" + secret).hexdigest()[:16]

    def key(self, role: str, node: str) -> bytes:
        return hkdf(self._secret, f"{self.cluster}|{role}|{node}".encode())

    @classmethod
    def from_file(cls, path: str | os.PathLike, cluster: str = "kvseal") -> ClusterSecret:
        p = Path(path)
        mode = p.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"{p}: the cluster secret must not be readable by group or others (chmod 600)")
        return cls(p.read_bytes().strip(), cluster)


def write_secret_file(path: str | os.PathLike) -> Path:
    """A fresh 256-bit secret, hex, in a file only this user can read."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return p


def _message(method: str, target: str, created: str, nonce: str, cluster: str, body: bytes) -> bytes:
    return "\n".join([method.upper(), target, created, nonce, cluster, hashlib.sha256(body).hexdigest()]).encode()


class Signer:
    def __init__(self, secret: ClusterSecret, role: str, node: str) -> None:
        if role not in ROLES or not 0 < len(node) <= MAX_NODE or "/" in node:
            raise ValueError(f"bad signer identity {role}/{node}")
        self.secret, self.role, self.node = secret, role, node
        self._key = secret.key(role, node)

    def headers(self, method: str, target: str, body: bytes, now: float | None = None,
                nonce: str | None = None) -> dict[str, str]:
        created = str(int(now if now is not None else time.time()))
        nonce = nonce or secrets.token_hex(16)
        sig = hmac.new(self._key, _message(method, target, created, nonce, self.secret.cluster, body),
                       hashlib.sha256).hexdigest()
        return {H_KEY: f"{self.secret.id}/{self.role}/{self.node}", H_CREATED: created, H_NONCE: nonce, H_SIG: sig}


class SignedAuth(httpx.Auth):
    """httpx hook: every request this client sends is signed."""

    requires_request_body = True

    def __init__(self, signer: Signer) -> None:
        self.signer = signer

    def auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        request.headers.update(self.signer.headers(request.method, request.url.raw_path.decode(), request.content))
        yield request


def roles_for(path: str) -> frozenset[str] | None:
    if path in ROUTES:
        return ROUTES[path]
    for prefix, roles in ROUTES.items():
        if prefix.endswith("/") and path.startswith(prefix):
            return roles
    return None


class Verifier:
    """Checks a request's signature against the current and previous secret; remembers nonces for the window."""

    def __init__(self, current: ClusterSecret, previous: ClusterSecret | None = None,
                 max_nonces: int = 200_000) -> None:
        self.secrets = {s.id: s for s in (current, previous) if s is not None}
        self.seen: OrderedDict[str, float] = OrderedDict()  # nonce → expiry, oldest first
        self.max_nonces = max_nonces

    def check(self, method: str, path: str, target: str, headers: dict[str, str], body: bytes,
              now: float | None = None) -> Peer:
        now = time.time() if now is None else now
        try:
            kid, role, node = headers[H_KEY].split("/", 2)
            created, nonce, sig = headers[H_CREATED], headers[H_NONCE], headers[H_SIG]
        except (KeyError, ValueError):
            raise Unauthenticated(f"{method} {path}: request is not signed") from None
        secret = self.secrets.get(kid)
        if secret is None:
            raise Unauthenticated(f"{method} {path}: unknown or retired key id {kid[:16]!r}")
        if role not in ROLES or not 0 < len(node) <= MAX_NODE or not 16 <= len(nonce) <= 64:
            raise Unauthenticated(f"{method} {path}: malformed key")
        want = hmac.new(secret.key(role, node), _message(method, target, created, nonce, secret.cluster, body),
                        hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, sig):
            raise Unauthenticated(f"{method} {path}: bad signature")
        if not created.isdigit() or abs(now - int(created)) > WINDOW:
            raise Unauthenticated(f"{method} {path}: signature outside the ±{WINDOW:g} s window")
        self._remember(nonce, now)
        allowed = roles_for(path)
        if allowed is None or role not in allowed:
            raise Forbidden(f"{method} {path}: not allowed for role {role}")
        return Peer(role, node)

    def _remember(self, nonce: str, now: float) -> None:
        while self.seen and next(iter(self.seen.values())) < now:
            self.seen.popitem(last=False)
        if nonce in self.seen:
            raise Unauthenticated("replayed request (nonce already seen)")
        if len(self.seen) >= self.max_nonces:  # only holders of the secret get here: refuse, never forget
            raise Unauthenticated("too many signed requests in the replay window")
        self.seen[nonce] = now + 2 * WINDOW


def cluster_auth(a: object, role: str, node: str) -> tuple[Verifier | None, dict]:
    """A process's verifier (for its own door) and the httpx client settings for the doors it calls (signing,
    and the cluster CA with ``--ssl-ca``), from its flags. No secret is a refusal to start;
    ``--insecure-no-auth`` (tests and the signing-cost benchmark) needs KVSEAL_UNSAFE=1."""
    http: dict = {}
    if getattr(a, "ssl_ca", None):
        http["verify"] = ssl.create_default_context(cafile=a.ssl_ca)
    if getattr(a, "insecure_no_auth", False):
        if os.environ.get("KVSEAL_UNSAFE") != "1":
            raise SystemExit("refusing --insecure-no-auth: set KVSEAL_UNSAFE=1 (tests only)")
        return None, http
    if not a.cluster_secret_file:
        raise SystemExit(f"kvseal {role}: --cluster-secret-file is required (a file of mode 600 holding the "
                         "cluster's secret, e.g. `openssl rand -hex 32 > secret && chmod 600 secret`)")
    current = ClusterSecret.from_file(a.cluster_secret_file)
    previous = ClusterSecret.from_file(a.previous_cluster_secret_file) if a.previous_cluster_secret_file else None
    return Verifier(current, previous), http | {"auth": SignedAuth(Signer(current, role, node))}
