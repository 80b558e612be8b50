"""Two hosts: prefill and decode in separate network namespaces joined by a veth pair, KV over Mooncake TCP.

The test creates the namespaces and addresses itself (10.213.7.0/24, only inside them) and removes them.
The router runs beside prefill in namespace A; requests are sent from inside A.
"""

import json
import secrets
import subprocess
import sys
import time

import pytest
from conftest import MODEL, cluster_secret

A_IP, B_IP = "10.213.7.1", "10.213.7.2"
MC_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=4096 MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER=4096"


def sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def hosts():
    tag = secrets.token_hex(2)
    a, b = f"kvsA{tag}", f"kvsB{tag}"
    if sh(f"ip netns add {a}", check=False).returncode != 0:
        pytest.skip("this machine forbids creating network namespaces (needs root / CAP_SYS_ADMIN)")
    try:
        for cmd in (f"ip netns add {b}", f"ip link add va{tag} type veth peer name vb{tag}",
                    f"ip link set va{tag} netns {a}", f"ip link set vb{tag} netns {b}",
                    f"ip -n {a} addr add {A_IP}/24 dev va{tag}", f"ip -n {b} addr add {B_IP}/24 dev vb{tag}",
                    f"ip -n {a} link set va{tag} up", f"ip -n {b} link set vb{tag} up",
                    f"ip -n {a} link set lo up", f"ip -n {b} link set lo up"):
            sh(cmd)
        yield a, b
    finally:
        sh(f"ip netns del {a}", check=False)
        sh(f"ip netns del {b}", check=False)


def spawn(ns: str, args: str) -> subprocess.Popen:
    return subprocess.Popen(f"exec ip netns exec {ns} env {MC_ENV} {sys.executable} -m kvseal.cli {args}",
                            shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def curl(ns: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = f"-H 'content-type: application/json' -d '{json.dumps(body)}'" if body else ""
    r = sh(f"ip netns exec {ns} curl -s -m 120 -w '\\n%{{http_code}}' {data} {url}", check=False)
    text, _, code = r.stdout.rpartition("\n")
    return int(code or 0), text


def wait(ns: str, url: str, procs: list, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            assert p.poll() is None, p.stdout.read()
        if curl(ns, url + "/health")[0] == 200:
            return
        time.sleep(1)
    raise TimeoutError(url)


def test_prefill_and_decode_on_two_hosts_over_mooncake(hosts, colocated):
    a, b = hosts
    common = f"--kv-pool-tokens 16384 --transport mooncake --cluster-secret-file {cluster_secret()}"
    dec = spawn(b, f"decode --host {B_IP} --port 9102 {common}")
    pre = spawn(a, f"prefill --host {A_IP} --port 9101 {common}")
    procs = [dec, pre]
    try:
        wait(b, f"http://{B_IP}:9102", procs)
        wait(a, f"http://{A_IP}:9101", procs)
        procs.append(spawn(a, f"router --host {A_IP} --port 9100 --prefill http://{A_IP}:9101 "
                              f"--decode http://{B_IP}:9102 --cluster-secret-file {cluster_secret()}"))
        wait(a, f"http://{A_IP}:9100", procs)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "List three colors."}], "max_tokens": 24,
                "temperature": 0}
        import httpx

        for _ in range(2):  # the second answers of both start from the same cached prefix: same numerics
            code, text = curl(a, f"http://{A_IP}:9100/v1/chat/completions", body)
            assert code == 200, text
            ref = httpx.post(colocated.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert json.loads(text)["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        time.sleep(2.5)  # the router's signed probes see both pools drained
        pools = json.loads(curl(a, f"http://{A_IP}:9100/health")[1])["pools"]
        assert len(pools) == 2 and all(h["free_pages"] == h["total_pages"] for h in pools), pools
        for ns, url in ((a, f"http://{A_IP}:9101"), (b, f"http://{B_IP}:9102")):
            assert json.loads(curl(ns, url + "/health")[1]) == {"status": "ok"}  # unsigned: no pool details
    finally:
        for p in procs:
            p.kill()
            p.wait()
