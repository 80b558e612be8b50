"""Disaggregated prefill/decode: same tokens as colocated, worker death fails fast, pools conserved."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import MODEL, Server, free_port, wait_pages_back

PROMPTS = ["Write a haiku about the sea.", "List three colors.", "What is the capital of Germany?"]


def chat(url, text, n=24, **kw):
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                                       "max_tokens": n, "temperature": 0, **kw}, timeout=120)
    return r


def test_disaggregated_greedy_equals_colocated(disagg, colocated):
    for p in PROMPTS:  # each asked twice: both servers then answer from the same cached prefix (same numerics)
        chat(disagg.url, p), chat(colocated.url, p)
        a, b = chat(disagg.url, p), chat(colocated.url, p)
        assert a.status_code == b.status_code == 200
        assert a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"]
    wait_pages_back(disagg)


def test_disaggregated_streaming_and_errors_keep_status(disagg):
    with httpx.stream("POST", disagg.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True},
            timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    r = httpx.post(disagg.url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 100, "max_tokens": 8100})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    wait_pages_back(disagg)


def test_client_disconnect_mid_stream_frees_both_pools(disagg):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", disagg.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    wait_pages_back(disagg)


def test_kill_decode_mid_stream_fails_fast_and_other_decode_serves():
    """Router over 1 prefill + 2 decodes; kill -9 the decode serving a stream: error, not a hang."""
    pp, d1, d2 = free_port(), free_port(), free_port()
    workers = [Server(["prefill", "--kv-pool-tokens", "16384"]), Server(["decode", "--kv-pool-tokens", "16384"]),
               Server(["decode", "--kv-pool-tokens", "16384"])]
    del pp, d1, d2
    router = Server(["router", "--prefill", workers[0].url, "--decode", workers[1].url, "--decode", workers[2].url,
                     "--timeout", "10"])
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "ignore_eos": True,
                "temperature": 0}
        t0 = time.time()
        killed = None
        got_error = False
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
                for i, line in enumerate(r.iter_lines()):
                    if i == 4:
                        busy = [w for w in workers[1:] if w.health()["running"] > 0]
                        killed = busy[0]
                        os.killpg(killed.proc.pid, signal.SIGKILL)
                    if '"error"' in line:
                        got_error = True
                        break
        except httpx.HTTPError:
            got_error = True
        assert killed is not None and got_error and time.time() - t0 < 30
        survivor = workers[2] if killed is workers[1] else workers[1]
        time.sleep(2.5)  # a health round marks the dead worker
        ok = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5},
                        timeout=60)
        assert ok.status_code == 200
        wait_pages_back(survivor)
        wait_pages_back(workers[0])
    finally:
        for s in [router, *workers]:
            s.stop()


def test_client_gone_before_first_token_stops_decode(disagg):
    """The client leaves while the prompt is still being prefilled: the transfer finishes, then decode
    stops — it does not generate 1500 tokens for nobody (wait_pages_back would time out)."""
    body = {"model": MODEL, "prompt": "Tell me about the weather. " * 200, "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.stream("POST", disagg.url + "/v1/completions", json=body,
                      timeout=httpx.Timeout(60, read=0.2)) as r:
        for _ in r.iter_lines():
            pass
    time.sleep(1)
    wait_pages_back(disagg, timeout=20)


def _children(pid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_sigterm_to_serve_alone_stops_its_workers():
    """`kill PID` of `kvseal serve` (as a container stop sends it) takes its router and workers down with it:
    none is left orphaned, holding its port and pool."""
    s = Server(["serve", "--kv-pool-tokens", "1024", "--allow-pool-below-context"])
    try:
        kids = _children(s.proc.pid)
        names = set()
        for k in kids:
            with open(f"/proc/{k}/comm") as f:
                names.add(f.read().strip())
        assert names == {"kvseal-prefill", "kvseal-decode", "kvseal-router"}  # forked, each named for its role
        os.kill(s.proc.pid, signal.SIGTERM)  # the launcher only, not its process group
        s.proc.wait(30)
        deadline = time.time() + 20
        while time.time() < deadline and any(os.path.exists(f"/proc/{k}") for k in kids):
            time.sleep(0.2)
        assert not any(os.path.exists(f"/proc/{k}") for k in kids)
    finally:
        s.stop()


def test_a_forked_child_exits_as_the_command_would(capfd):
    """``serve`` forks its workers and router from itself (kvseal/server/launch.py): a child runs the command's
    ``main`` and leaves with its exit status and message, as ``python -m kvseal.cli ARGV`` does, and never
    returns into the code that forked it (that code would go on to stop its siblings)."""
    from kvseal.server.launch import Child

    with socket.socket() as keep, socket.socket() as other:
        bad = Child(["prefill", "--port", "1", "--model", "/nonexistent.gguf"], keep, [other])
        usage = Child(["prefill"], keep, [other])
        assert bad.wait(60) == 1
        assert usage.wait(60) == 2
        assert keep.fileno() >= 0 and other.fileno() >= 0  # the parent's sockets are still its own
    err = capfd.readouterr().err
    assert "kvseal prefill: /nonexistent.gguf: no such file or directory" in err
    assert "the following arguments are required: --port" in err


def test_serve_starts_when_the_next_ports_are_taken_and_refuses_a_taken_front_door():
    """Another socket on port + 1 (a client's outgoing connection draws from the same ephemeral range) once
    killed ``serve`` after its models loaded, with a bind error; now the worker takes another port. A taken front
    door fails at once, with its reason, before any model loads."""
    for _ in range(100):  # a held port whose port - 1 is free (with two test workers, often it is not)
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1] - 1
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
            break
        except OSError:
            held.close()
    else:
        pytest.fail("no free port below a held one in 100 tries")
    s = Server(["serve", "--kv-pool-tokens", "1024", "--allow-pool-below-context"], port=port)
    try:
        r = chat(s.url, "List three colors.", n=4)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        for mode in ([], ["--colocated"]):  # the colocated server binds first too
            t = time.time()
            q = subprocess.run([sys.executable, "-m", "kvseal.cli", "serve", *mode, "--port", str(port)], check=False,
                               capture_output=True, text=True, timeout=60)
            assert q.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in q.stderr and time.time() - t < 20
    finally:
        s.stop()
        held.close()


def test_serve_names_its_workers_by_urls_that_parse_for_ipv6_hosts_too():
    """``kvseal serve --host ::1`` died at start: the router was given http://::1:8001, which no client parses."""
    from kvseal.server.listen import url

    assert httpx.URL(url("::1", 8001)).port == 8001 and httpx.URL(url("::1", 8001)).host == "::1"
    assert url("127.0.0.1", 8002) == "http://127.0.0.1:8002"


def test_input_that_once_broke_a_prefill_worker_is_400_and_every_worker_serves_on(disagg):
    """A seed past 64 bits reached the prefill worker and raised there: a 500, the worker's connection closed,
    the router's next request on it reset, the worker counted down, and every request for a second after
    answered 503 "no healthy prefill worker". Now the door refuses it, and a request after it is served."""
    from test_api import inputs_that_once_broke_a_handler

    inputs_that_once_broke_a_handler(disagg)


def test_every_server_keeps_an_idle_connection_longer_than_its_clients_do(disagg):
    """uvicorn closes an idle connection after 5 s unless told otherwise, and httpx (the router's transport, and
    the openai client's) reuses one for 5 s: a request sent on a connection as its server closes it is reset.
    Under mixed load one in ~600 requests got 503 "prefill worker unreachable: ReadError", and the router took
    the prefill worker for dead. The front door and each worker must still answer on a connection idle past
    5 s, and kvseal's own clients drop an idle connection well before a kvseal server would."""
    import http.client
    from urllib.parse import urlsplit

    from kvseal.server import listen

    assert listen.client_limits().keepalive_expiry < listen.SERVER_KEEP_ALIVE / 2
    urls = [disagg.url] + [p["url"] for p in disagg.health()["pools"]]
    conns = []
    for u in urls:
        c = http.client.HTTPConnection(urlsplit(u).hostname, urlsplit(u).port, timeout=10)
        c.request("GET", "/health")
        assert c.getresponse().read() and c.sock is not None
        conns.append((u, c, c.sock))
    time.sleep(6)
    for u, c, sock in conns:
        c.request("GET", "/health")  # raises (the server closed it) or answers on the same connection
        r = c.getresponse()
        assert r.status == 200 and r.read() and c.sock is sock, u
        c.close()
