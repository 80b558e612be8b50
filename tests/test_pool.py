"""The page pool: check-then-commit allocation, tags, generations, conservation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.config import PoolConfig
from kvseal.engine.runner import NO_GROUP
from kvseal.kv.pool import PagePool, PageState, PoolExhausted
from kvseal.kv.tags import tenant_tag


def small_pool(pages: int = 8) -> PagePool:
    return PagePool(PoolConfig(num_pages=pages, page_size=4), 2, 1, 8, torch.float32)


def table_ok(pool: PagePool, run, owner: int) -> bool:
    t = torch.tensor([run.pages])
    return bool(pool.check_tables(t, torch.tensor([run.generations]), torch.tensor([owner]),
                                  torch.ones_like(t, dtype=torch.bool))[0])


def test_allocate_free_conserves_and_bumps_generation():
    pool = small_pool()
    a = pool.allocate(1, 3)
    assert pool.num_free == 5 and pool.owned_by(1) == 3
    pool.check_integrity()
    pool.free(a)
    assert pool.num_free == 8
    assert all(pool.generation[p] == 1 for p in a.pages)
    pool.check_integrity()


def test_cannot_allocate_past_capacity():
    pool = small_pool()
    pool.allocate(1, 8)
    assert not pool.can_allocate(1)
    with pytest.raises(PoolExhausted):
        pool.allocate(2, 1)


def test_double_free_is_refused():
    pool = small_pool()
    a = pool.allocate(1, 2)
    pool.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)


def test_stale_page_table_fails_tag_check():
    """A page freed and handed to another request no longer matches the first owner's table."""
    pool = small_pool(2)
    a = pool.allocate(1, 2)
    assert table_ok(pool, a, 1)
    pool.free(a)
    b = pool.allocate(2, 2)
    assert table_ok(pool, b, 2)
    assert not table_ok(pool, a, 1)  # same page ids, old generation, other owner
    assert not table_ok(pool, b, 1)  # right generation, wrong owner


def test_a_page_tagged_for_another_tenant_fails_the_tag_check():
    """Owner and generation right, tenant wrong (e.g. a request id reused across tenants): refused."""
    pool = small_pool(2)
    a = pool.allocate(1, 2, tenant=tenant_tag("acme"))
    table = torch.tensor([a.pages]), torch.tensor([a.generations]), torch.tensor([1]), torch.ones(1, 2, dtype=torch.bool)
    assert pool.check_tables(*table, tenants=torch.tensor([tenant_tag("acme")], dtype=torch.int32)).item()
    assert not pool.check_tables(*table, tenants=torch.tensor([tenant_tag("globex")], dtype=torch.int32)).item()
    assert pool.run_ok(a, 1, PageState.OWNED, tenant_tag("acme"))
    assert not pool.run_ok(a, 1, PageState.OWNED, tenant_tag("globex"))


def test_a_run_from_before_its_pages_were_freed_fails_the_check():
    """The same request id holds the same pages again (a reused id): owner, state and tenant match, only the
    generation tells the old run from the new one, in the commit-side check (run_ok) and the read-side one."""
    pool = small_pool(2)
    old = pool.allocate(1, 2, PageState.RESERVED)
    pool.free(old)
    new = pool.allocate(1, 2, PageState.RESERVED)
    assert sorted(new.pages) == sorted(old.pages)
    assert pool.run_ok(new, 1, PageState.RESERVED)
    assert not pool.run_ok(old, 1, PageState.RESERVED)
    pool.free(new)
    # the same for the step's read-side check (check_tables): an OWNED table kept from before the free
    old = pool.allocate(1, 2)
    pool.free(old)
    new = pool.allocate(1, 2)
    assert sorted(new.pages) == sorted(old.pages)
    assert table_ok(pool, new, 1)
    assert not table_ok(pool, old, 1)


def test_reserved_and_quarantined_pages_are_not_readable():
    pool = small_pool()
    a = pool.allocate(1, 2, PageState.RESERVED)
    assert not table_ok(pool, a, 1)
    pool.set_state(a, PageState.OWNED)
    assert table_ok(pool, a, 1)
    pool.quarantine(a)
    assert not table_ok(pool, a, 1)
    assert pool.counts()["quarantined"] == 2
    pool.check_integrity()


def test_integrity_check_catches_corruption():
    pool = small_pool()
    pool.allocate(1, 2)
    pool.owner[0] = -1  # a used page that lost its owner
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_a_pool_that_passed_its_check_is_checked_again_once_its_tags_change():
    """The check skips tags it has passed before (the simulator's speed): a change after a pass is seen."""
    pool = small_pool()
    pages = pool.allocate(1, 2)
    pool.check_integrity()
    pool.check_integrity()  # the same tags: passed again
    pool.owner[pages.pages[0]] = -1
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool.owner[pages.pages[0]] = 1
    pool.check_integrity()
    pool._free.append(pages.pages[1])  # the free list changes, not the tags: a used page handed out twice
    with pytest.raises(AssertionError):
        pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_random_alloc_free_conserves(ops):
    pool = small_pool(16)
    live = []
    for alloc, n in ops:
        if alloc and pool.can_allocate(n):
            live.append(pool.allocate(len(live) + 1, n))
        elif live:
            pool.free(live.pop(0))
        pool.check_integrity()
    assert pool.num_free + sum(len(r.pages) for r in live) == 16


# -- shared pages (n > 1: a request's choices share their prompt's pages) --------------------------------
def group_ok(pool: PagePool, run, owner: int, group: int | None) -> bool:
    t = torch.tensor([run.pages])
    g = torch.tensor([-2 if group is None else group])
    return bool(pool.check_tables(t, torch.tensor([run.generations]), torch.tensor([owner]),
                                  torch.ones_like(t, dtype=torch.bool), g)[0])


def test_shared_pages_are_freed_by_their_last_holder_only():
    pool = small_pool()
    a = pool.allocate(7, 3)
    pool.share(a.pages[:2], 7, holders=3)
    assert pool.counts()["shared"] == 2
    pool.check_integrity()
    pool.free(a)  # the leader ends: its private page goes, the shared ones stay for the other two
    assert pool.num_free == 6 and pool.counts()["shared"] == 2
    pool.free(type(a)(a.pages[:2], a.generations[:2]))
    assert pool.num_free == 6
    q = pool.quarantine(type(a)(a.pages[:2], a.generations[:2]))  # an error ending: shared pages just let go
    assert q.pages == () and pool.num_free == 8
    assert all(pool.generation[p] == 1 for p in a.pages)
    pool.check_integrity()


def test_a_shared_page_reads_only_for_its_group():
    pool = small_pool()
    a = pool.allocate(7, 2)
    pool.share(a.pages, 7, holders=2)
    assert group_ok(pool, a, owner=7, group=7) and group_ok(pool, a, owner=8, group=7)
    assert not group_ok(pool, a, owner=8, group=None)  # another request: not its page
    assert not group_ok(pool, a, owner=8, group=9)
    assert not table_ok(pool, a, 7)  # without the group, even the leader's own table no longer passes
    pool.free(a)
    pool.free(a)
    assert not group_ok(pool, a, owner=7, group=7)  # freed by both holders: the generation moved on


def test_a_cached_page_reads_only_for_its_namespace():
    """The prefix cache's pages are SHARED with a tenant's cache namespace as owner: a request of that
    namespace reads them; one of another namespace, or of none, is refused (the tenant tag aside)."""
    pool = small_pool()
    a = pool.allocate(1000, 2)  # the namespace's id is the owner, as kvseal.kv.prefix keeps them
    pool.share(a.pages, 1000, holders=1)
    t = torch.tensor([a.pages])
    args = (t, torch.tensor([a.generations]), torch.tensor([8]), torch.ones_like(t, dtype=torch.bool),
            torch.tensor([NO_GROUP]))

    def reads(space: int) -> bool:
        return bool(pool.check_tables(*args, torch.tensor([space]))[0])

    assert reads(1000)
    assert not reads(2000) and not reads(NO_GROUP)


def test_a_dead_decode_workers_pool_file_is_swept(tmp_path):
    import os
    import subprocess

    from kvseal.transfer.shm import sweep_orphans

    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"kvseal-decode-9000-{dead.pid}-00ff00ff00ff00ff"
    alive = tmp_path / f"kvseal-decode-9001-{os.getpid()}-00ff00ff00ff00ff"
    orphan.write_bytes(b"x")
    alive.write_bytes(b"x")
    assert sweep_orphans(tmp_path) == [orphan]
    assert alive.exists() and not orphan.exists()


def test_the_pool_is_faulted_in_at_startup_and_populate_keeps_contents():
    """A new pool's memory is faulted in when it is made, so writing all of it afterwards takes (almost) no page
    faults; populating memory that already holds data leaves the data as it is."""
    import resource

    from kvseal.memory import populate
    t = torch.arange(1 << 20, dtype=torch.int32)
    if not populate(t):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14+")
    assert torch.equal(t, torch.arange(1 << 20, dtype=torch.int32))
    pool = PagePool(PoolConfig(num_pages=256), 30, 3, 64, torch.bfloat16)  # 90 MB, ~23k pages of 4 KB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    pool.kv.fill_(1)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 1000
