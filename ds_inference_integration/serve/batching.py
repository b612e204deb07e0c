"""Batching across requests: the queue, and when a batch leaves it.

A request joins the queue as one Job (its rows). A batch is the oldest job plus the next jobs with the same
BatchKey (what rows of one batch must share), in arrival order, and it leaves when it holds `max_batch_size`
rows, when the next job would take it past the padded-token budget (`max_batch_tokens`: rows x (longest
prompt + most new tokens), the cost of a padded batch, as TGI counts it), when its oldest job has waited
`max_wait_ms`, or (`--adaptive_wait`, the default) when it holds as many requests as the batch before it did;
and only to an idle replica (while every replica is busy it keeps filling).

The last rule is ours: waiting helps only while more requests are coming, and the batch before is the best
guess of how many. One client alone (concurrency 1) then never waits: with the `max_wait_ms` rule alone its
latency was 31 ms above one-request-at-a-time's (p50 367 against 336 ms, 20 ms of it the wait; `ds-inference
bench serve --models gpt2 --concurrency 1`, 2026-12-04). Clients that come back together after their batch
(concurrency 4, 16) are waited for, up to `max_wait_ms`, and a load that grows makes the batches grow, since
requests that arrive while a batch runs wait for the next one.

Why not continuous batching (rows joining and leaving a running batch at every step, as vLLM and TGI do): it
needs a decode loop of our own with a per-row KV cache (paged attention), written for every architecture and
for beam search and encoder-decoders, which transformers' `generate` is not; transformers' own continuous
batching is decoder-only, without beams, and its TP does not recognise a DeepSpeed-sharded model. Here rows
that finish early are answered as they finish (the leader reports them), but their slots stay in the batch
until its longest row ends.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from .protocol import BatchKey, Row

_ids = itertools.count(1)


@dataclass(eq=False)  # a job is itself (a set member, a queue entry), not its values
class Job:
    """One request's rows on their way through the queue and a replica."""

    key: BatchKey
    rows: list[Row]
    arrived: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=lambda: next(_ids))
    done: asyncio.Future | None = None  # result: None, or the exception to raise
    events: asyncio.Queue | None = None  # (row index, new token) and (row index, None) when a row finishes
    cancelled: bool = False
    first_token_at: float | None = None
    finished_rows: int = 0

    def width(self) -> int:
        return max(len(r.prompt_ids) for r in self.rows)

    def new_tokens(self) -> int:
        return max(r.max_new_tokens for r in self.rows)


@dataclass
class Batch:
    id: int
    key: BatchKey
    jobs: list[Job]
    started: float = field(default_factory=time.monotonic)

    @property
    def rows(self) -> list[Row]:
        return [r for j in self.jobs for r in j.rows]


class Queue:
    """The waiting jobs and the batching rule (no I/O: the server's dispatcher calls `take` when a replica is idle)."""

    def __init__(self, max_batch_size: int, max_batch_tokens: int | None, max_wait_ms: float, max_queue: int,
                 adaptive_wait: bool = True):
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.max_wait, self.max_queue = max_wait_ms / 1000.0, max_queue
        self.waiting: list[Job] = []
        self.adaptive = adaptive_wait
        self.expect = 1  # requests in the last batch taken: how many to wait for (with adaptive_wait)
        self._batch_ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self.waiting)

    def full(self) -> bool:
        return len(self.waiting) >= self.max_queue

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def remove(self, job: Job) -> bool:
        if job in self.waiting:
            self.waiting.remove(job)
            return True
        return False

    def _fill(self) -> tuple[list[Job], bool]:
        """The next batch's jobs, and whether it is full (no more rows or tokens fit)."""
        first = self.waiting[0]
        jobs, rows = [first], len(first.rows)
        width, new = first.width(), first.new_tokens()
        full = rows >= self.max_batch_size
        for job in self.waiting[1:]:
            if full:
                break
            if job.key != first.key:
                continue
            n = rows + len(job.rows)
            w, m = max(width, job.width()), max(new, job.new_tokens())
            if n > self.max_batch_size or (self.max_batch_tokens and n * (w + m) > self.max_batch_tokens):
                full = True
                break
            jobs.append(job)
            rows, width, new = n, w, m
            full = rows >= self.max_batch_size
        return jobs, full

    def take(self, now: float | None = None) -> Batch | None:
        """The batch that leaves now (a full one, one with as many requests as the last, or one whose oldest job
        has waited `max_wait_ms`), or None."""
        if not self.waiting:
            return None
        now = time.monotonic() if now is None else now
        jobs, full = self._fill()
        enough = self.adaptive and len(jobs) >= self.expect
        if not full and not enough and now - jobs[0].arrived < self.max_wait:
            return None
        for job in jobs:
            self.waiting.remove(job)
        self.expect = len(jobs)
        return Batch(id=next(self._batch_ids), key=jobs[0].key, jobs=jobs)

    def next_deadline(self) -> float | None:
        """When the oldest job's wait ends (monotonic seconds), or None with nothing waiting."""
        return self.waiting[0].arrived + self.max_wait if self.waiting else None
