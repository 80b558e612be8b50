"""Listening sockets that ``kvseal serve`` binds before any process loads a model, and hands to its processes.

``serve`` used to tell its workers to listen on the front door's port + 1 and + 2 and let each bind it later.
Any other socket on this host (a client's outgoing connection takes an ephemeral port from the same range) could
hold one of them by then, and the worker died after loading the model. Now ``serve`` binds all three first: the
front door's port must be free (a clear error at once, as vLLM does); a worker's port is + 1 / + 2 when free and one
the kernel picks otherwise. The child inherits the bound socket (``--listen-fd``) and serves on it, so nothing can
take the port between the choice and the listen.
"""

from __future__ import annotations

import errno
import socket

import httpx
import uvicorn

# Keep-alive, on both sides of every hop. uvicorn closes an idle connection after 5 s by default, and httpx (the
# router's transport, and the openai client's) reuses one for 5 s: a server that closes a connection as its
# client reuses it resets that request (ReadError), and the router took a worker that did so for dead. So every
# kvseal server keeps an idle connection longer than its clients keep one: longer than httpx's 5 s, a common
# load balancer's 60 s, and the CLIENT_KEEP_ALIVE of kvseal's own clients.
SERVER_KEEP_ALIVE = 75
CLIENT_KEEP_ALIVE = 10.0


def client_limits(max_connections: int = 100, max_keepalive: int = 20) -> httpx.Limits:
    """A kvseal client's connection pool (by default httpx's, but for the keep-alive)."""
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive,
                        keepalive_expiry=CLIENT_KEEP_ALIVE)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; OSError when the port is taken or out of range
    (getaddrinfo would wrap 65537 to port 1)."""
    if not 0 <= port <= 65535:
        raise OSError(errno.EINVAL, f"port {port} is out of range (0-65535)")
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart while TIME_WAIT lingers
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def bind_preferring(host: str, port: int) -> socket.socket:
    """``port`` when it is free, else one the kernel picks."""
    try:
        return bind(host, port)
    except OSError:
        return bind(host, 0)


def url(host: str, port: int, scheme: str = "http") -> str:
    """A URL for (host, port): an IPv6 literal in brackets (``--host ::1``)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def run(app: object, host: str, port: int, bound: int | socket.socket | None = None, **kw: object) -> None:
    """uvicorn on (host, port), or on a socket bound already: this process's own, or the descriptor of the one
    ``kvseal serve`` bound for it (``--listen-fd``)."""
    kw.setdefault("timeout_keep_alive", SERVER_KEEP_ALIVE)
    if bound is None:
        uvicorn.run(app, host=host, port=port, **kw)
        return
    sock = bound if isinstance(bound, socket.socket) else socket.socket(fileno=bound)  # family read from the fd
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, **kw)).run(sockets=[sock])
