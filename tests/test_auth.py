"""The cluster's internal doors: signed requests, roles, replays, rotation, size limits, lease capabilities,
bounded state. Each check is shown failing closed, and the doors shown open without it."""

import asyncio
import json
import os
import re
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from conftest import MODEL, Trio, complete, signed, wait_pages_back

from kvseal.config import EngineConfig, PoolConfig
from kvseal.engine.engine import Engine
from kvseal.faults import Faults
from kvseal.server.decode import DecodeService, decode_app
from kvseal.server.guard import Guard
from kvseal.server.prefill import PrefillService, prefill_app
from kvseal.server.worker import fault_route
from kvseal.transfer import messages as P
from kvseal.transfer.auth import ClusterSecret, Signer, Verifier, roles_for, write_secret_file

SECRET = ClusterSecret(b"k" * 64)
ROUTE_CALLS = {  # every internal route: (app, method, path, a role allowed there)
    "reserve": ("decode", "POST", "/kv/reserve", "router"),
    "abort": ("decode", "POST", "/kv/abort", "router"),
    "fence": ("decode", "POST", "/kv/fence", "router"),
    "commit": ("decode", "POST", "/kv/commit", "prefill"),
    "writer_done": ("decode", "POST", "/kv/writer_done", "prefill"),
    "streams": ("decode", "GET", "/streams/abc", "router"),
    "prefill": ("prefill", "POST", "/prefill", "router"),
    "forget": ("prefill", "POST", "/kv/forget", "decode"),
    "pages_decode": ("decode", "GET", "/pages", "router"),  # every page's tenant tag: the admin's dashboard
    "pages_prefill": ("prefill", "GET", "/pages", "router"),
    "faults_decode": ("decode", "POST", "/faults", "router"),  # fault injection (KVSEAL_FAULTS=armable only)
    "faults_prefill": ("prefill", "POST", "/faults", "router"),
}


def worker_app(svc: DecodeService | PrefillService) -> object:
    """The app a worker process serves (``serve_worker``): the service's routes and the fault route."""
    app = decode_app(svc) if isinstance(svc, DecodeService) else prefill_app(svc)
    fault_route(app, svc.faults)
    return app


def services() -> tuple[DecodeService, PrefillService]:
    def engine(role: str) -> Engine:
        cfg = EngineConfig(pool=PoolConfig(num_pages=4, page_size=16), dtype="fp32")
        from kvseal.kv.pool import PagePool

        return Engine(cfg, None, PagePool(cfg.pool, 2, 1, 8, torch.float32), role=role).start()

    return (DecodeService(engine("decode"), (), "unused", "d0"), PrefillService(engine("prefill"), None, "p0"))


class Opened:
    status_code = 200  # a token stream that opened (and would stay open)


async def call(app, method: str, path: str, body: bytes = b"{}", headers: dict | None = None,
               wait: float = 2) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
        try:
            async with asyncio.timeout(wait):
                return await c.request(method, path, content=body, headers=headers or {})
        except TimeoutError:
            return Opened()


def sign(role: str, method: str, path: str, body: bytes, **kw) -> dict:
    return Signer(SECRET, role, "n1").headers(method, path, body, **kw)


async def sweep(verifier: Verifier | None, unsigned_only: bool = False) -> dict[str, dict[str, int]]:
    """Each internal route called unsigned, by the wrong role, tampered, stale, oversized and replayed (or only
    unsigned): the status each got."""
    dec, pre = services()
    apps = {"decode": Guard(worker_app(dec), verifier, max_body=4096),
            "prefill": Guard(worker_app(pre), verifier, max_body=4096)}
    out = {}
    try:
        for name, (app, method, path, role) in ROUTE_CALLS.items():
            a, body = apps[app], b'{"rid": 1}'
            if unsigned_only:  # an open stream costs its whole wait: one call per route, not seven
                out[name] = {"unsigned": (await call(a, method, path, body)).status_code}
                continue
            wrong = next(r for r in ("router", "prefill", "decode") if r not in roles_for(path))
            good = sign(role, method, path, body)
            stale = sign(role, method, path, body, now=time.time() - 60)
            out[name] = {
                "unsigned": (await call(a, method, path, body)).status_code,
                "wrong_role": (await call(a, method, path, body, sign(wrong, method, path, body))).status_code,
                "flipped": (await call(a, method, path, b'{"rid": 2}', good)).status_code,
                "stale": (await call(a, method, path, body, stale)).status_code,
                "too_big": (await call(a, method, path, b" " * 5000, sign(role, method, path, b" " * 5000))).status_code,
            }
            replay = sign(role, method, path, body)
            await call(a, method, path, body, replay)
            out[name]["replay"] = (await call(a, method, path, body, replay)).status_code
        return out
    finally:
        dec.engine.stop()
        pre.engine.stop()


def test_every_internal_route_refuses_unsigned_wrong_role_tampered_replayed_stale_and_oversized():
    res = asyncio.run(sweep(Verifier(SECRET)))
    for name, codes in res.items():
        assert codes == {"unsigned": 401, "wrong_role": 403, "flipped": 401, "stale": 401, "too_big": 413,
                         "replay": 401}, (name, codes)


def test_without_the_verifier_every_door_is_open():
    res = asyncio.run(sweep(None, unsigned_only=True))
    assert all(codes["unsigned"] not in (401, 403) for codes in res.values()), res


def test_faults_are_set_at_run_time_only_in_a_worker_started_armable():
    dec, pre = services()
    try:
        dec.faults = Faults("armable")
        armable, fixed = Guard(worker_app(dec), Verifier(SECRET)), Guard(worker_app(pre), Verifier(SECRET))

        def arm(app, body: bytes) -> httpx.Response:
            return asyncio.run(call(app, "POST", "/faults", body, sign("router", "POST", "/faults", body)))

        assert arm(fixed, b'{"faults": "drop_commit"}').status_code == 404 and not pre.faults.probs
        assert arm(armable, b'{"faults": "no_such_point"}').status_code == 400
        assert arm(armable, b'[1]').status_code == 400
        r = arm(armable, b'{"faults": "delay_reserve", "delay": 0.5}')
        assert r.status_code == 200 and dec.faults.fire("delay_reserve") and dec.faults.delay == 0.5
        assert arm(armable, b'{"faults": ""}').status_code == 200 and not dec.faults.fire("delay_reserve")
    finally:
        dec.engine.stop()
        pre.engine.stop()


def test_rotation_accepts_the_previous_secret_and_refuses_a_retired_one():
    old, new, newer = ClusterSecret(b"o" * 40), ClusterSecret(b"n" * 40), ClusterSecret(b"x" * 40)
    h = Signer(old, "router", "r").headers("POST", "/kv/abort", b"{}")
    assert Verifier(new, previous=old).check("POST", "/kv/abort", "/kv/abort", h, b"{}").role == "router"
    with pytest.raises(Exception, match="retired"):
        Verifier(newer, previous=new).check("POST", "/kv/abort", "/kv/abort",
                                            Signer(old, "router", "r").headers("POST", "/kv/abort", b"{}"), b"{}")


def test_health_is_open_but_says_nothing_without_a_signature():
    dec, pre = services()
    try:
        app = Guard(decode_app(dec), Verifier(SECRET))
        assert asyncio.run(call(app, "GET", "/health")).json() == {"status": "ok"}
        detail = asyncio.run(call(app, "GET", "/health", b"", sign("router", "GET", "/health", b"")))
        assert detail.json()["total_pages"] == 4
    finally:
        dec.engine.stop()
        pre.engine.stop()


# -- lease capabilities ------------------------------------------------------------------------------------
def reserve(rid: int, prompt: int = 20, writer: str = "p0") -> P.Reserve:
    return P.Reserve(rid=rid, tenant="t", prompt=[1] * prompt, max_new=4, sampling={}, prefill_id=writer)


def commit_for(lease: P.Lease, cap: P.Capability | None, pages: list[int] | None = None) -> P.Commit:
    return P.Commit(rid=lease.rid, nonce=lease.nonce, n_tokens=20, first_token=0, pages=pages or lease.pages,
                    generations=lease.generations, checksum="", cap=cap)


async def status_of(coro) -> int:
    try:
        ack = await coro
    except Exception as e:  # noqa: BLE001 - every refusal is an EngineError with its status
        return getattr(e, "status", 500)
    return 200 if not isinstance(ack, P.Ack) or ack.ok else ack.status


async def capability_scenario(check: bool) -> dict:
    dec, _ = services()
    if not check:  # the check switched off: what a signed writer could then do
        dec.core.check_cap = lambda *a, **k: None
    try:
        a, b = await dec.reserve(reserve(1)), await dec.reserve(reserve(2, prompt=16))
        forged = P.Capability(**{**json.loads(P.encode(a.cap)), "pages": a.pages + b.pages})
        out = {"other_lease": await status_of(dec.commit(commit_for(a, b.cap))),
               "no_cap": await status_of(dec.commit(commit_for(a, None))),
               "outside": await status_of(dec.commit(commit_for(b, b.cap, pages=[*b.pages, a.pages[0]]))),
               "forged": await status_of(dec.commit(commit_for(a, forged, pages=a.pages + b.pages))),
               # WriterDone names no pages: only the capability's own lease binds it (else a's writer could
               # release b's pages while b's writer still writes)
               "writer_done_other_lease": await status_of(dec.writer_done(P.WriterDone(rid=2, nonce=b.nonce,
                                                                                       cap=a.cap)))}
        await dec.fence(P.Fence(prefill_id="p0"))
        out["commit_after_fence"] = await status_of(dec.commit(commit_for(a, a.cap)))
        out["writer_done_after_fence"] = await status_of(dec.writer_done(P.WriterDone(rid=1, nonce=a.nonce,
                                                                                    cap=a.cap)))
        return out
    finally:
        dec.engine.stop()


def test_a_commit_must_present_its_own_lease_capability():
    r = asyncio.run(capability_scenario(check=True))
    assert r == {"other_lease": 403, "no_cap": 403, "outside": 403, "forged": 403, "writer_done_other_lease": 403,
                 "commit_after_fence": 410, "writer_done_after_fence": 410}, r


def test_an_expired_capability_is_gone():
    async def run() -> int:
        dec, _ = services()
        dec.lease_ttl = 0.05
        try:
            a = await dec.reserve(reserve(1))
            await asyncio.sleep(0.1)
            return await status_of(dec.commit(commit_for(a, a.cap)))
        finally:
            dec.engine.stop()

    assert asyncio.run(run()) == 410


def test_without_the_capability_check_a_writer_commits_into_another_lease():
    r = asyncio.run(capability_scenario(check=False))
    assert r["other_lease"] != 403 and r["no_cap"] != 403 and r["commit_after_fence"] != 410, r


# -- bounded state -----------------------------------------------------------------------------------------
def test_streams_are_bounded_and_belong_to_their_router():
    dec, _ = services()
    try:
        app = Guard(decode_app(dec), Verifier(SECRET))

        async def open_stream(node: str, name: str) -> int:
            h = Signer(SECRET, "router", node).headers("GET", f"/streams/{name}", b"")
            return (await call(app, "GET", f"/streams/{name}", b"", h, wait=0.2)).status_code  # < the 5 s grace

        async def run() -> list[int]:
            codes = [await open_stream("r1", "mine")]
            codes.append(await open_stream("r2", "mine"))  # another router's stream
            codes += [await open_stream("r1", f"s{i}") for i in range(10)]  # past the per-router bound
            return codes

        codes = asyncio.run(run())
        assert codes[0] == 200 and codes[1] == 403 and 429 in codes[2:], codes
        assert len(dec.outboxes) <= 8
    finally:
        dec.engine.stop()


def test_a_forged_flood_leaves_memory_flat_and_honest_traffic_served():
    with Trio(["--kv-pool-tokens", "8192"]) as t:
        dec = psutil.Process(t.dec.proc.pid)
        assert complete(t.url, "One, two,").status_code == 200
        before = dec.memory_info().rss
        with httpx.Client(timeout=10) as c:
            codes = set()
            for i in range(1500):
                body = P.encode(reserve(10_000 + i))
                codes.add(c.post(t.dec.url + "/kv/reserve", content=body).status_code)
                codes.add(c.post(t.dec.url + "/kv/commit", content=b'{"rid": %d}' % i).status_code)
                codes.add(c.get(t.dec.url + f"/streams/flood{i}").status_code)
                codes.add(c.post(t.dec.url + "/kv/fence", content=b'{"prefill_id": "%s"}' % t.pre.url.encode())
                          .status_code)
        assert codes == {401}, codes
        assert dec.memory_info().rss - before < 32 << 20  # flat: nothing was kept for anyone
        assert complete(t.url, "One, two,").status_code == 200
        h = t.dec.health()
        assert h["leases"] == 0 and h["free_pages"] == h["total_pages"]
        # what runs there (kvseal.machine) for signed callers only; an unsigned probe learns liveness
        assert h["machine"]["kernels_why"] and h["machine"]["dtype"] in ("bf16", "fp32") and h["machine"]["cpu"]
        assert "machine" in t.pre.health() and httpx.get(t.dec.url + "/health").json() == {"status": "ok"}
        for full in ("false", "true"):  # nor through the router's open /health, quick or full
            pools = httpx.get(t.url + "/health", params={"full": full}, timeout=30).json()["pools"]
            assert pools and all(p.get("total_pages") and not {"machine", "incarnation"} & p.keys() for p in pools)
        r = signed("POST", t.dec.url + "/kv/commit", role="prefill", body=b'{"rid": 5, "nonce": 1, "n_tokens": 1, '
                   b'"first_token": 0, "pages": [0], "generations": [0], "checksum": ""}')
        assert r.status_code == 403 and t.dec.health()["leases"] == 0  # signed, but no capability: no state
        wait_pages_back(t.dec)


# -- defaults ----------------------------------------------------------------------------------------------
def test_a_worker_refuses_a_readable_or_missing_secret(tmp_path):
    loose = write_secret_file(tmp_path / "s")
    os.chmod(loose, 0o644)
    for extra in (["--cluster-secret-file", str(loose)], []):
        r = subprocess.run([sys.executable, "-m", "kvseal.cli", "decode", "--port", "1", *extra],
                           check=False, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and re.search(r"chmod 600|cluster-secret-file is required", r.stderr), r.stderr


def test_no_pickle_anywhere_in_the_project():
    root = Path(__file__).resolve().parent.parent
    hits = [str(p) for d in ("kvseal", "bench", "tests") for p in (root / d).rglob("*.py")
            if p.name != "test_auth.py" and re.search(r"\b(c?pickle|dill|marshal)\b", p.read_text())]
    assert not hits, hits


def test_the_shared_memory_pool_is_private(disagg):
    pools = [p for p in Path("/dev/shm").glob("kvseal-decode-*")
             if re.fullmatch(r"kvseal-decode-\d+-\d+-[0-9a-f]{16}", p.name)]  # 64 random bits in the name
    assert pools and all(p.stat().st_mode & 0o077 == 0 for p in pools), pools


# -- TLS ---------------------------------------------------------------------------------------------------
def make_ca(d: Path) -> tuple[str, str, str]:
    """A CA and a certificate for 127.0.0.1 signed by it, made for this test."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("kvseal test CA", ca_key, "kvseal test CA", ca_key, True)
    leaf = cert("127.0.0.1", key, "kvseal test CA", ca_key, False)
    paths = d / "ca.pem", d / "node.pem", d / "node.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(paths[2], 0o600)
    return tuple(map(str, paths))


def test_tls_on_the_front_door_and_between_nodes(tmp_path):
    ca, cert, key = make_ca(tmp_path)
    tls = ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca", ca]
    with Trio(["--kv-pool-tokens", "8192", *tls], router=tls) as t:
        assert t.url.startswith("https://") and t.pre.url.startswith("https://")
        r = httpx.post(t.url + "/v1/completions", verify=ssl.create_default_context(cafile=ca), timeout=60,
                       json={"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the cluster's CA
            httpx.get(t.dec.url + "/health", timeout=10)
        wait_pages_back(t.dec)


# -- data plane ----------------------------------------------------------------------------------------------
async def foreign_write_scenario(checksum: bool) -> P.Ack:
    """A peer with the cluster's transport access writes into *another* lease's pages (the whole decode pool is
    registered with Mooncake; one shm file on one host). The honest writer of that lease then commits."""
    from kvseal.config import Protections
    from kvseal.kv.pool import PagePool

    cfg = EngineConfig(pool=PoolConfig(num_pages=4, page_size=16), dtype="fp32",
                       protections=Protections(checksum=checksum))
    dec = DecodeService(Engine(cfg, None, PagePool(cfg.pool, 2, 1, 8, torch.float32), role="decode").start(), (),
                        "unused", "d0")
    try:
        await dec.reserve(reserve(1))
        b = await dec.reserve(reserve(2))
        kv = dec.pool.kv
        kv[b.pages] = 1.0  # the honest writer's bytes for B...
        digest = P.checksum(kv, b.pages, 20, 2, b.nonce, b.pages, b.generations, 0)
        kv[b.pages[0], 0, 0, 0, 0] = 9.0  # ...and the other peer's write into B's pages
        return await dec.commit(P.Commit(rid=2, nonce=b.nonce, n_tokens=20, first_token=0, pages=b.pages,
                                         generations=b.generations, checksum=digest, cap=b.cap))
    finally:
        dec.engine.stop()


def test_a_write_into_another_lease_is_caught_by_the_checksum_never_served():
    ack = asyncio.run(foreign_write_scenario(checksum=True))
    assert not ack.ok and ack.status == 500 and ack.code == "kv_integrity_error"


def test_without_the_checksum_the_foreign_bytes_are_served():
    assert asyncio.run(foreign_write_scenario(checksum=False)).ok


# -- front door ----------------------------------------------------------------------------------------------
def test_api_keys_from_a_file_and_no_client_chosen_tenant(tmp_path, colocated):
    from kvseal.server.tenants import Tenants, Unauthorized

    f = tmp_path / "keys"
    f.write_text("# operator's keys\nkey-a=tenant-a\n\nkey-b=tenant-b\n")
    t = Tenants.load(["key-c=tenant-c"], str(f))
    assert [t.authenticate(f"Bearer key-{x}") for x in "abc"] == ["tenant-a", "tenant-b", "tenant-c"]
    with pytest.raises(Unauthorized):
        t.authenticate("Bearer key-d")
    r = httpx.post(colocated.url + "/v1/completions", content=b" " * (17 << 20), timeout=60)
    assert r.status_code == 413  # the front door bounds bodies too, as the client's error
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == "payload_too_large"
    for field in ("tenant", "worker"):  # nothing in the body picks a tenant or a worker
        r = httpx.post(colocated.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1, field: "tenant-b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    # vLLM's cache_salt is taken, and only narrows: its keys derive from the tenant's own salt, so naming another
    # tenant reaches nothing of theirs (tests/test_prefix_cache.py: the same salt from another tenant misses)
    r = httpx.post(colocated.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": "tenant-b"})
    assert r.status_code == 200, r.text
