"""Mooncake's protocol is selectable; RDMA on a host without an RDMA device is a clear error at start."""

import subprocess
import sys

import pytest
from conftest import cluster_secret

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
                        "--mooncake-protocol", "rdma", "--kv-pool-tokens", "8192",
                        "--cluster-secret-file", cluster_secret()],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no RDMA device" in r.stderr + r.stdout


def test_tcp_engine_starts(tmp_path):
    assert _engine("127.0.0.1", MooncakeConfig("tcp")) is not None


def test_a_mooncake_write_outside_registered_memory_is_refused():
    """The data plane's own fence (Mooncake#2313/#2314): a peer can write only into memory the receiver
    registered. Within it (the whole decode pool) a peer holding the cluster's access can still write anywhere;
    checksums and tags catch that (tests/test_auth.py), they cannot prevent it."""
    import torch

    dec, pre = _engine("127.0.0.1"), _engine("127.0.0.1")
    pool, other = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
    src = torch.full((4096,), 7, dtype=torch.uint8)
    assert dec.register_memory(pool.data_ptr(), pool.nbytes) == 0 and pre.register_memory(src.data_ptr(), 4096) == 0
    session = f"127.0.0.1:{dec.get_rpc_port()}"
    assert pre.transfer_sync_write(session, src.data_ptr(), pool.data_ptr() + 100, 64) == 0 and pool[100] == 7
    assert pre.transfer_sync_write(session, src.data_ptr(), other.data_ptr() + 100, 64) != 0 and other[100] == 0
    assert pre.transfer_sync_write(session, src.data_ptr(), pool.data_ptr() + pool.nbytes - 32, 64) != 0
