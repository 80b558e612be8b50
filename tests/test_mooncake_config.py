"""Mooncake's protocol is selectable; RDMA on a host without an RDMA device is a clear error at start."""

import subprocess
import sys

import pytest

from kvseal.transfer.mooncake import MooncakeConfig, _engine, rdma_devices


def test_protocol_is_validated():
    with pytest.raises(ValueError, match="tcp or rdma"):
        MooncakeConfig("ib")


@pytest.mark.skipif(bool(rdma_devices()), reason="this host has RDMA devices")
def test_rdma_without_a_device_is_refused_by_name():
    with pytest.raises(RuntimeError, match="no RDMA device .*--mooncake-protocol tcp"):
        _engine("127.0.0.1", MooncakeConfig("rdma", "mlx5_0"))


@pytest.mark.skipif(bool(rdma_devices()), reason="this host has RDMA devices")
def test_a_decode_worker_asked_for_rdma_here_does_not_start():
    r = subprocess.run([sys.executable, "-m", "kvseal.cli", "decode", "--port", "1", "--transport", "mooncake",
                        "--mooncake-protocol", "rdma", "--kv-pool-tokens", "8192"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no RDMA device" in r.stderr + r.stdout


def test_tcp_engine_starts(tmp_path):
    assert _engine("127.0.0.1", MooncakeConfig("tcp")) is not None
