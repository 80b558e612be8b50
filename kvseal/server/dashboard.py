"""A live view of the pools: ``/dashboard`` on the front door (router or colocated server).

Every page of every pool is one cell, coloured by state (free, reserved, owned, quarantined, shared; a shared
page the prefix cache holds is "cached") or, with "by tenant", owned and shared pages coloured by the tenant
whose request took them. Beside it: leases in flight by state and the transfers decode refused, by reason,
with the latest refusals.

Who sees it: only the admin key (``--admin-key``). The HTML page itself holds nothing; its script reads the key
from the URL's fragment (``/dashboard#key=…``, which a browser never sends to a server or writes to a log) and
asks ``/dashboard/data`` with it as a bearer token: no key 401, a tenant's key 403. Without ``--admin-key`` the
dashboard is off (404). Tenant names appear only here, to the admin.

Data: a worker's signed ``/pages`` (router only) or the colocated engine's pool, read on the engine thread so
one snapshot is consistent: the page states as bytes and each page's tenant tag.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

from kvseal.kv.tags import PageState

PAGE = Path(__file__).with_name("dashboard.html")


async def pool_snapshot(engine: object) -> dict:
    """One pool, consistent: states, tenant tags, which shared pages the prefix cache holds."""
    import torch  # a colocated engine's pool; the router, which never loads PyTorch, asks its workers instead

    def take() -> dict:
        pool = engine.pool
        state = pool.state.clone()
        cached = pool.cached & (state == PageState.SHARED)
        state[cached] = len(PageState)  # "cached": a shared page the prefix cache holds
        return {"role": engine.role, "page_size": pool.cfg.page_size,
                "state": base64.b64encode(state.to(torch.uint8).numpy().tobytes()).decode(),
                "tenant": base64.b64encode(pool.tenant.to(torch.int32).numpy().tobytes()).decode()}

    return await asyncio.wait_for(asyncio.wrap_future(engine.call(take)), timeout=10)


STATES = [s.name.lower() for s in PageState] + ["cached"]
