"""A short soak in CI (the long one is ``python bench/soak.py``): 8 tenants, seeded transfer faults, client
drops, over-long prompts, a prefill and a decode killed and restarted; 0 leaks, 0 wrong statuses, 0 hung
requests, both pools drained. With unsalted cache keys the same checks see tenants reading each other's
cached prefix."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from soak import soak

pytestmark = pytest.mark.alone  # measures time under load: make test runs it on idle cores


def test_short_soak_finds_nothing(capsys):
    res = soak(seed=7, requests=200, kills=2, log=False)
    assert res["ok"], res["findings"][:20]
    assert res["codes"].get("normal:200", 0) > 100 and res["stats"]["public_hits"] > 0
    assert res["stats"].get("killed_prefill", 0) + res["stats"].get("killed_decode", 0) == 2


def test_short_soak_sees_tenants_share_an_unsalted_cache():
    res = soak(seed=8, requests=80, kills=0, log=False, unsafe=("--unsafe-no-cache-salt",))
    assert any("first public-prompt request read" in f for f in res["findings"]), res["findings"][:20]
