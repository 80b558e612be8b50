"""How long `kvseal serve` takes to answer, and what its processes cost getting there. Writes
bench/out/startup.json.

Each run starts ``kvseal serve ARGS`` on a free port, times it until the router answers ``/v1/models``, reads
the CPU seconds its process tree has spent (``/proc/PID/stat``), sends two short greedy completions, reads each
process's proportional memory (PSS, ``/proc/PID/smaps_rollup``) and stops it with SIGTERM.

    python bench/startup.py --runs 3
    python bench/startup.py --runs 3 -- --colocated
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvseal.model.cpu import cpu_flags, cpu_model

OUT = Path(__file__).resolve().parent / "out"


def tree(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid, *(p for k in kids for p in tree(int(k)))]


def cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one(args: list[str]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: the four processes' logs never fill it and block them
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "kvseal.cli", "serve", "--port", str(port), *args],
                         stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if p.poll() is not None:
                log.seek(0)
                raise SystemExit(f"kvseal serve exited: {log.read()[-2000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 600:
                raise SystemExit("kvseal serve did not answer in 600 s")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        pids = tree(p.pid)
        cpu = sum(cpu_s(q) for q in pids)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "The capital of France is",
                                                          "max_tokens": 8, "temperature": 0}, timeout=120)
            r.raise_for_status()
        procs = {f"{Path(f'/proc/{q}/comm').read_text().strip()}:{q}": round(pss_mib(q), 1) for q in tree(p.pid)}
        return {"ready_s": round(ready, 2), "tree_cpu_s": round(cpu, 2), "processes": len(pids),
                "pss_mib": procs, "pss_total_mib": round(sum(procs.values()), 1)}
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(OUT / "startup.json"))
    ap.add_argument("serve_args", nargs="*", help="after --: flags for kvseal serve")
    a = ap.parse_args()
    args = a.serve_args or ["--kv-pool-tokens", "8192"]
    runs = [one(args) for _ in range(a.runs)]
    res = {"cpu": cpu_model(), "avx512": any(f.startswith("avx512") for f in cpu_flags()), "serve_args": args,
           "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
