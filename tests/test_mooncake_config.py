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
    registered."""
    import torch

    dec, pre = _engine("127.0.0.1"), _engine("127.0.0.1")
    pool, other = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
    src = torch.full((4096,), 7, dtype=torch.uint8)
    assert dec.register_memory(pool.data_ptr(), pool.nbytes) == 0 and pre.register_memory(src.data_ptr(), 4096) == 0
    session = f"127.0.0.1:{dec.get_rpc_port()}"
    assert pre.transfer_sync_write(session, src.data_ptr(), pool.data_ptr() + 100, 64) == 0 and pool[100] == 7
    assert pre.transfer_sync_write(session, src.data_ptr(), other.data_ptr() + 100, 64) != 0 and other[100] == 0
    assert pre.transfer_sync_write(session, src.data_ptr(), pool.data_ptr() + pool.nbytes - 32, 64) != 0


def test_decode_registers_only_open_leases():
    """Decode exposes a lease's pages while it takes writes, and withdraws them at commit or abort: a write
    into a page of no open lease (free, or a running request's) is refused by Mooncake itself."""
    from types import SimpleNamespace

    import torch

    from kvseal.config import PoolConfig
    from kvseal.transfer.mooncake import MooncakePool

    pool = MooncakePool("127.0.0.1")
    kv = pool.create(PoolConfig(num_pages=8, page_size=16), SimpleNamespace(num_layers=2, num_kv_heads=1,
                                                                            head_dim=8), torch.float32)
    pre = _engine("127.0.0.1")
    src = torch.full((4096,), 7, dtype=torch.uint8)
    assert pre.register_memory(src.data_ptr(), 4096) == 0
    session, page = f"127.0.0.1:{pool.engine.get_rpc_port()}", kv[0].nbytes

    def write(p: int) -> int:
        return pre.transfer_sync_write(session, src.data_ptr(), kv.data_ptr() + p * page, 64)

    assert write(2) != 0  # nothing leased yet: nothing writable
    pool.expose(1, [2, 3, 6])
    assert write(2) == 0 and write(6) == 0 and write(5) != 0  # the lease's pages only
    pool.conceal(1)  # committed (or aborted): its pages stop taking writes
    assert write(2) != 0 and write(6) != 0
    pool.close()
