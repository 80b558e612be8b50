"""What a page's tag is made of, apart from the pool: its states and a tenant's tag. Plain Python, so the
router (dashboard, tenant names) uses them without loading the pool, or PyTorch."""

from __future__ import annotations

from enum import IntEnum

import xxhash


class PageState(IntEnum):
    FREE = 0
    RESERVED = 1  # leased to a remote writer, awaiting commit
    OWNED = 2  # verified, readable by its owner
    QUARANTINED = 3  # released, but a remote writer may still target it
    SHARED = 4  # read-only, reference counted, readable by its group (the owner field holds the group)


def tenant_tag(tenant: str) -> int:
    """A tenant's tag on its pages: a 31-bit hash of its name, the same on every node and thread."""
    return xxhash.xxh32_intdigest(tenant.encode()) & 0x7FFFFFFF
