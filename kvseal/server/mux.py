"""The router's end of a decode worker's token stream: one connection per decode, demultiplexed by request.

A request registers its queue before it reserves, so no event of its can arrive unclaimed; events of
requests no longer registered (their client left) are dropped. Decode sends a heartbeat line when idle, so
a stream that breaks, ends, or stays silent past the router's timeout means the worker is dead or hung:
every registered request then gets an error at once. A dead decode fails its requests fast, never hangs them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import msgspec

from kvseal.errors import Overloaded
from kvseal.transfer import messages as P

LINE = msgspec.json.Decoder(list[P.TokenEvent])


class TokenMux:
    def __init__(self, client: httpx.AsyncClient, url: str, subscriber: str, timeout: float,
                 on_dead: Callable[[], None]) -> None:
        self.client = client
        self.url = url
        self.subscriber = subscriber
        self.timeout = timeout
        self.on_dead = on_dead
        self.queues: dict[int, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None

    def register(self, rid: int) -> asyncio.Queue:
        """A queue of ``P.TokenEvent`` (or one ``Overloaded`` if the stream dies) for request ``rid``."""
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        q = self.queues[rid] = asyncio.Queue()
        return q

    def unregister(self, rid: int) -> None:
        self.queues.pop(rid, None)

    async def _run(self) -> None:
        try:
            await self._read()
            why = "stream ended"
        except Exception as e:  # noqa: BLE001 - any failure of the stream fails its requests the same way
            why = type(e).__name__
        self.on_dead()
        err = Overloaded(f"decode worker {self.url} failed mid-stream: {why}")
        for q in self.queues.values():
            q.put_nowait(err)

    async def _read(self) -> None:
        timeout = httpx.Timeout(None, connect=2.0, read=self.timeout)
        async with self.client.stream("GET", f"{self.url}/streams/{self.subscriber}", timeout=timeout) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                for ev in LINE.decode(line):
                    q = self.queues.get(ev.rid)
                    if q is not None:
                        q.put_nowait(ev)
