"""The simulated prefill worker: the shipped ``PrefillHost`` and its core over a simulated pool and network."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvseal.errors import EngineError, Overloaded
from kvseal.kv.pool import PageRun, PageState
from kvseal.protocol import prefill as pc
from kvseal.protocol.prefill_host import PrefillHost
from kvseal.sim.base import PAGE, Node, Request, new_pool, write_pattern
from kvseal.transfer import messages as P


@dataclass
class Job:
    msg: P.Prefill
    serial: int
    req: Request
    reply: Callable[[object], None]
    run: PageRun | None = None
    n: int = 0  # tokens computed (a placeholder computes one)
    answered: bool = False


class PrefillNode(Node):
    """The prefill worker: the shipped ``PrefillHost`` (and its core), with this node as its ``PrefillPorts``."""

    def boot(self) -> None:
        self.inc += 1
        self.up = True
        self.core = pc.PrefillCore(variants=self.w.variants)
        self.host = PrefillHost(self.core, self)
        self.pool = new_pool(self.w.k.prefill_pages, self.w.variants)
        self.jobs: dict[tuple[int, int], Job] = {}

    def prefill(self, msg: P.Prefill, serial: int, req: Request, reply: Callable[[object], None]) -> None:
        if not self.up:
            return
        limit = self.w.k.prefill_pages * PAGE
        fault = self.w.faults_on and self.w.rng.random() < self.w.k.corrupt  # the legacy_placeholder fault
        if fault and len(msg.prompt) + msg.max_new > limit:
            req.corrupted = True
        nonce = msg.lease.nonce
        try:
            acts = self.host.feed(lambda: self.core.prefill(msg.rid, nonce, len(msg.prompt), msg.max_new, limit,
                                                            placeholder_fault=fault))
        except EngineError as e:
            reply(e)
            return
        stand_in = " as a placeholder" if acts and acts[0].placeholder else ""
        self.w.log(f"{self.name} admits rid {msg.rid} serial {serial}{stand_in}")
        if not acts:  # a duplicate of a transfer in progress: the original answers
            return
        job = Job(msg, serial, req, reply)
        self.jobs[(msg.rid, nonce)] = job
        admit = acts[0]
        job.n = 1 if admit.placeholder else len(msg.prompt)
        need = self.pool.cfg.pages_for(job.n)
        if not self.pool.can_allocate(need):
            self.host.carry(self.host.feed(lambda: self.core.failed(msg.rid, nonce, Overloaded("prefill pool full"))),
                            nonce)
            return
        job.run = self.pool.allocate(msg.rid, need, PageState.OWNED)
        write_pattern(self.pool.kv, list(job.run.pages), job.n, serial)
        inc, rng = self.inc, self.w.rng
        busy = rng.random() < 0.15  # queued behind other prompts: past the lease's TTL, perhaps the router's wait
        self.w.at(rng.uniform(4.0, 14.0) if busy else rng.uniform(0.1, 3.0), lambda: self.prefilled(inc, job))

    def prefilled(self, inc: int, job: Job) -> None:
        if not self.up or self.inc != inc:
            return
        nonce = job.msg.lease.nonce
        acts = self.host.feed(lambda: self.core.prefilled(job.msg.rid, nonce))
        if not any(isinstance(a, pc.Write) for a in acts):
            self.host.carry(acts, nonce)
            return
        self.w.at(self.w.rng.uniform(0.0, 2.0), lambda: self.write(inc, job))  # a slow link

    def write(self, inc: int, job: Job) -> None:
        if not self.up or self.inc != inc:
            return
        lease = job.msg.lease
        k = self.pool.cfg.pages_for(job.n)
        corrupt = self.w.faults_on and self.w.rng.random() < self.w.k.corrupt
        if corrupt:
            job.req.corrupted = True
        landed = self.w.decode.land(lease.cap, lease.target, job.serial, lease.pages[:k], job.n, corrupt)
        self.w.log(f"{self.name} writes rid {job.msg.rid} serial {job.serial}: {'landed' if landed else 'refused'}")
        error = None if landed else Overloaded("KV transfer failed")
        self.host.carry(self.host.feed(lambda: self.core.written(job.msg.rid, lease.nonce, error)), lease.nonce)

    # -- PrefillPorts -------------------------------------------------------------------------------------------
    def release(self, rid: int, nonce: int) -> None:
        job = self.jobs.get((rid, nonce))
        if job is not None:
            self.free_job(job)

    stop = release  # stopping the computation frees its pages

    def send_commit(self, rid: int, nonce: int) -> None:
        self.send_commit_of(self.jobs[(rid, nonce)])

    def writer_done(self, rid: int, nonce: int) -> None:
        job = self.jobs.get((rid, nonce))
        if job is not None:
            wd, dec = P.WriterDone(rid=rid, nonce=nonce, cap=job.msg.lease.cap), self.w.decode
            self.w.send(f"writer_done rid {rid}", lambda: dec.writer_done(wd))

    def settle(self, rid: int, nonce: int, result: object) -> None:
        job = self.jobs.pop((rid, nonce), None)
        if job is not None:
            job.answered = True
            job.reply(result)

    def free_job(self, job: Job) -> None:
        if job.run is not None:
            self.pool.free(job.run)
            job.run = None

    def send_commit_of(self, job: Job) -> None:
        lease, n = job.msg.lease, job.n
        k = self.pool.cfg.pages_for(n)
        first = 7
        digest = P.checksum(self.pool.kv, list(job.run.pages[:k]), n, job.msg.rid, lease.nonce, lease.pages[:k],
                            lease.generations[:k], first)
        c = P.Commit(rid=job.msg.rid, nonce=lease.nonce, n_tokens=n, first_token=first, pages=lease.pages[:k],
                     generations=lease.generations[:k], checksum=digest, cap=lease.cap)
        if self.w.faults_on and self.w.rng.random() < self.w.k.corrupt:
            c.first_token = 8  # the message changed on the way; the checksum covers it
            job.req.corrupted = True
        inc, done = self.inc, [False]

        def answer(ack: P.Ack) -> None:
            if self.up and self.inc == inc and not done[0]:
                done[0] = True
                self.host.carry(self.host.feed(lambda: self.core.acked(job.msg.rid, lease.nonce, ack)), lease.nonce)

        dec = self.w.decode
        self.w.send(f"commit rid {c.rid}", lambda: dec.commit(c, lambda ack: self.w.send(
            f"ack rid {c.rid}", lambda: answer(ack))))
        self.w.at(8.0, lambda: answer(P.Ack(ok=False, status=503, code="decode_unreachable")))

    def forget(self, rid: int, nonce: int, answer: Callable[[bool], None]) -> None:
        if not self.up:
            return
        writing, acts = self.host.feed(lambda: self.core.forget(rid, nonce))
        self.host.carry(acts, nonce)
        self.w.send(f"forget answer rid {rid}", lambda: answer(writing))
