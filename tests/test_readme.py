"""The README's operator tour, run as written: serve with a tenant's key and the admin's, ask through the
openai client, read the pools the dashboard draws, and have Prometheus scrape every process. Only the ports
change (free ones here), and the background steps are started and stopped by the test."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port, prometheus_jobs

ROOT = Path(__file__).resolve().parent.parent


def tour() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text[text.index("<!-- tour -->"): text.index("<!-- /tour -->")]
    lines = block.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    return [re.sub(r"\s+#.*$", "", ln) for ln in lines]


def _three_free_ports() -> int:
    """A port whose next two are free too, as the scrape config expects (serve moves a worker off a taken one)."""
    while True:
        port = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port + 1))
                b.bind(("127.0.0.1", port + 2))
            return port
        except OSError:
            continue


def test_the_readme_tour_runs_as_written(tmp_path):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (make setup installs Debian's)")
    serve, ask, pools, scrape = tour()
    port, web = _three_free_ports(), free_port()  # the scrape config names + 1 and + 2
    cfg = (ROOT / "deploy/prometheus.yml").read_text()
    for old, new in ((8002, port + 2), (8001, port + 1), (8000, port)):
        cfg = cfg.replace(str(old), str(new))
    cfg = cfg.replace("scrape_interval: 5s", "scrape_interval: 1s")
    (tmp_path / "prometheus.yml").write_text(cfg)

    def local(cmd: str) -> str:
        cmd = cmd.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("deploy/prometheus.yml", str(tmp_path / "prometheus.yml"))
        cmd = cmd.replace("/tmp/kvseal-prometheus", str(tmp_path / "db")).replace(".venv/bin/python", sys.executable)
        return cmd.rstrip("& ")

    env = {**os.environ, "PATH": f"{ROOT / '.venv/bin'}:{os.environ['PATH']}"}
    procs = [subprocess.Popen(local(serve) + f" --port {port}", shell=True, cwd=ROOT, env=env,
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        answer = subprocess.run(local(ask), shell=True, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=120, check=True).stdout
        assert "Berlin" in answer, answer
        shown = subprocess.run(local(pools).replace("| head -c 300", ""), shell=True, cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=60, check=True).stdout
        data = json.loads(shown)
        assert len(data["pools"]) == 2 and "alice" in data["tenants"].values()
        procs.append(subprocess.Popen(local(scrape) + f" --web.listen-address=127.0.0.1:{web}", shell=True, cwd=ROOT,
                                      env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        jobs = prometheus_jobs(web, "kvseal:kv_cache_usage_perc")
        assert jobs == {"kvseal-router", "kvseal-prefill", "kvseal-decode"}, jobs
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)
