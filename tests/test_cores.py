"""The core-sharing lock: exclusive across processes, and released by the kernel when its holder dies."""

import os
import subprocess
import sys
import threading

from kvseal.engine.cores import CoreLock

HOLD = "import sys, time; from kvseal.engine.cores import CoreLock; l = CoreLock(sys.argv[1]); l.__enter__(); print('held', flush=True); time.sleep(60)"


def test_lock_is_exclusive_and_a_dead_holder_releases_it(tmp_path):
    path = str(tmp_path / "cores.lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, path], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        got = threading.Event()

        def take() -> None:
            with CoreLock(path):
                got.set()

        t = threading.Thread(target=take, daemon=True)
        t.start()
        assert not got.wait(1.0), "the lock was taken while another process held it"
        holder.kill()  # like kill -9 of a worker mid-forward
        assert got.wait(10), "a dead holder still blocks the lock"
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_is_tried_through_libc_and_sees_another_holder(tmp_path):
    """Each step takes the lock: fcntl.flock lets the event-loop thread take the GIL, 0.2 ms a step to get it
    back. The non-blocking try through libc keeps it, and says when another process holds the lock."""
    import fcntl

    from kvseal.engine import cores

    assert cores._flock is not None, "no libc flock to call with the GIL held"
    path = str(tmp_path / "cores.lock")
    mine = CoreLock(path)
    assert cores._try(mine.fd, fcntl.LOCK_EX)
    other = CoreLock(path)  # another open file: to flock, another holder
    assert not cores._try(other.fd, fcntl.LOCK_EX)
    assert cores._try(mine.fd, fcntl.LOCK_UN)
    assert cores._try(other.fd, fcntl.LOCK_EX)
    assert cores._try(other.fd, fcntl.LOCK_UN)
    os.close(mine.fd)
    os.close(other.fd)
