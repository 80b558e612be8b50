"""The operator's live view of the pools (``/dashboard``): the admin key only, and a picture that shows every
page in its state. Headless Chromium (Debian's) renders the page against a live disaggregated cluster while
four long requests decode; the screenshot's cells, counted by colour, lie between the pool's counts read just
before and just after it (decode's owned pages only grow while the requests run, its free pages only shrink)."""

import base64
import shutil
import subprocess
import threading
from collections import Counter

import httpx
import pytest
from conftest import MODEL, Server

ADMIN = "admin-key-1"
CELL, COLS, TITLE = 8, 64, 16  # dashboard.html's grid
COLOURS = {"free": (0xD9, 0xD9, 0xD9), "owned": (0x2E, 0x9D, 0x4A), "cached": (0x94, 0x67, 0xBD)}


def data(url: str, key: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url + "/dashboard/data", headers=headers, timeout=10)


def counts(d: dict) -> list[Counter]:
    return [Counter(d["states"][s] for s in base64.b64decode(p["state"])) for p in d["pools"]]


def test_only_the_admin_key_sees_the_pools(colocated):
    assert httpx.get(colocated.url + "/dashboard/data").status_code == 404  # no --admin-key: off
    s = Server(["serve", "--colocated", "--kv-pool-tokens", "8192", "--api-key", "key-a=tenant-a",
                "--admin-key", ADMIN])
    try:
        assert data(s.url, None).status_code == 401
        assert data(s.url, "key-a").status_code == 403
        r = data(s.url)
        assert r.status_code == 200 and "tenant-a" in r.json()["tenants"].values()
        assert "tenant-a" not in httpx.get(s.url + "/dashboard").text, "the page itself holds nothing"
    finally:
        s.stop()


def test_the_picture_shows_each_page_in_its_state(tmp_path):
    from PIL import Image

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (make setup installs Debian's)")
    s = Server(["serve", "--kv-pool-tokens", "8192", "--api-key", "key-a=tenant-a", "--admin-key", ADMIN])
    stop = threading.Event()
    started = threading.Barrier(5)

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Tell me a long story about the sea, the harbor and the ships. " * 4,
                "max_tokens": 2000,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer key-a"}) as r:
            lines = r.iter_lines()
            next(lines)
            started.wait(60)
            for _ in lines:
                if stop.is_set():
                    return

    threads = [threading.Thread(target=stream) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        started.wait(60)  # every request is decoding
        before = counts(data(s.url).json())
        png = tmp_path / "dashboard.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--force-device-scale-factor=1",
                        "--force-color-profile=srgb", "--hide-scrollbars", "--window-size=700,900",
                        "--virtual-time-budget=3000", f"--screenshot={png}", f"{s.url}/dashboard#key={ADMIN}"],
                       capture_output=True, timeout=120, check=True)
        after = counts(data(s.url).json())
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        s.stop()
    img = Image.open(png).convert("RGB")
    y = 0
    seen = []
    for pool in before:
        rows = -(-sum(pool.values()) // COLS)
        region = img.crop((0, y + TITLE, COLS * CELL, y + TITLE + rows * CELL))
        pixels = Counter(region.get_flattened_data() if hasattr(region, "get_flattened_data") else region.getdata())
        seen.append({k: pixels[c] / (CELL - 1) ** 2 for k, c in COLOURS.items()})
        y += TITLE + rows * CELL
    prefill, decode = seen
    b, a = before[1], after[1]
    assert b["owned"] > 0, "four requests are decoding"
    assert b["owned"] <= decode["owned"] <= a["owned"], (before, decode, after)
    assert b["free"] >= decode["free"] >= a["free"], (before, decode, after)
    assert decode["owned"] == int(decode["owned"]) and decode["free"] == int(decode["free"]), "whole cells"
    assert before[0]["cached"] > 0, "prefill's cache holds the prompt's full pages"
    assert prefill["cached"] == before[0]["cached"] == after[0]["cached"], (before, prefill, after)
    print("decode pool before / picture / after:", b["owned"], decode["owned"], a["owned"], "owned;",
          b["free"], decode["free"], a["free"], "free")
