"""Batching across requests: the queue, and when a batch leaves it.

A request joins the queue as one Job (its rows). A batch is the oldest job plus the next jobs with the same
BatchKey (what rows of one batch must share), in arrival order, and it leaves when it holds `max_batch_size`
rows, when the next job would take it past the padded-token budget (`max_batch_tokens`: rows x (longest
prompt + most new tokens), the cost of a padded batch, as TGI counts it; for rows that join running ones, the
budget is what the replica's running rows leave of it, each row counted unpadded: `Row.slot_tokens`), when its
oldest job has waited `max_wait_ms`, or (`--adaptive_wait`, the default) when it holds every request the clients
are likely to send now; and only to an idle replica (while every replica is busy it keeps filling).

The wait counts from when a replica was free to take the batch: requests that queued while every replica was busy
have waited, but not for a batch to fill. Counted from their arrival instead, they left the moment a batch ended,
before the clients of that batch came back, and 16 clients settled into batches of 8 and 8 for good (T5, mean
batch 9.1 and 18.4 req/s, against 16.0 and 37.1 for GPT-2, whose clients happened to start together;
`ds-inference bench serve`, 2026-12-04).

The adaptive rule is ours too: waiting helps only while more requests are coming. The guess: the most requests
open at once (waiting or running) over the last 30 seconds, less those running now. One client alone
(concurrency 1) then never waits: with the `max_wait_ms` rule alone its latency was 31 ms above
one-request-at-a-time's (p50 367 against 336 ms, 20 ms of it the wait; `ds-inference bench serve --models gpt2
--concurrency 1`, 2026-12-04). A load that grows makes batches grow: requests that arrive while a batch runs
wait for the next one.

The queue feeds both engines: the batch engine takes a batch only when idle, and its batch waits as above; the step
engine (`--scheduler continuous`, `serve/steps.py`) takes rows up to its free slots at any step, and while it runs
rows nothing waits for company (`take(wait=False)`: a row admitted now decodes at the next step beside the running
rows; the engine's own admission rule may group them); idle, its first admission waits as a batch does
(`Replica.waits_for_company`). The jobs of a batch that failed come back first, each to run alone (`retry_alone`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass, field

from .protocol import Row
from .wire import BatchKey

_ids = itertools.count(1)
# How far back the adaptive wait looks for the most requests open at once. With 5 s, each point of `bench serve`
# (64 requests from 16 clients, after the other server's point) began with a batch of 1, then 15, then 16s: mean
# batch 12.8 and 28 req/s, against 16.0 and 37 when the clients' first burst was waited for (2026-12-04). The cost
# of a longer memory: a lone client, for that long after a burst, waits up to --max_wait_ms per request.
PEAK_SECONDS = 30.0


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
    alone: bool = False  # its batch failed: it runs in a batch of its own, so a failure is its own
    row_ids: list[int] = field(default_factory=list)  # its rows' ids while a replica holds them (Server._send)


    def width(self) -> int:
        return max(len(r.prompt_ids) for r in self.rows)

    def new_tokens(self) -> int:
        return max(r.max_new_tokens for r in self.rows)

    def slot_tokens(self) -> int:
        """The tokens its rows hold in a replica whose rows join running ones (`Row.slot_tokens`)."""
        return sum(r.slot_tokens() for r in self.rows)


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
        self.running: set[Job] = set()  # taken, not finished
        self._open: collections.deque = collections.deque()  # (time, requests open then), the last PEAK_SECONDS
        self._batch_ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self.waiting)

    def full(self) -> bool:
        return len(self.waiting) >= self.max_queue

    def add(self, job: Job) -> None:
        self.waiting.append(job)
        self._open.append((job.arrived, len(self.waiting) + len(self.running)))

    def retry_alone(self, jobs: list[Job]) -> None:
        """Jobs of a batch that failed, back at the head of the queue in their order, each to run in a batch of its
        own: the job that made the batch fail then fails alone, and the others are answered."""
        for job in jobs:
            job.alone = True
            self.running.discard(job)
        self.waiting[:0] = jobs

    def remove(self, job: Job) -> bool:
        """A job that ended (answered, failed, or its client went away): out of the queue or of the running set."""
        self.running.discard(job)
        if job in self.waiting:
            self.waiting.remove(job)
            return True
        return False

    def expected(self, now: float) -> int:
        """How many requests a batch that leaves now should hold: the most open at once lately, less those running."""
        while self._open and self._open[0][0] < now - PEAK_SECONDS:
            self._open.popleft()
        peak = max((n for _, n in self._open), default=1)
        return max(1, peak - len(self.running))

    def _fill(self, room: int, tokens_room: int | None = None) -> tuple[list[Job], bool]:
        """The next batch's jobs (`room` rows at most, and the oldest job whatever its size), and whether it is full
        (no more rows or tokens fit). `tokens_room`: see `take`."""
        first = self.waiting[0]
        jobs, rows = [first], len(first.rows)
        width, new, held = first.width(), first.new_tokens(), first.slot_tokens()
        room = min(room, self.max_batch_size)
        full = rows >= room or first.alone
        for job in self.waiting[1:]:
            if full:
                break
            if job.key != first.key or job.alone:
                continue
            n = rows + len(job.rows)
            w, m = max(width, job.width()), max(new, job.new_tokens())
            over = held + job.slot_tokens() > tokens_room if tokens_room is not None else \
                bool(self.max_batch_tokens and n * (w + m) > self.max_batch_tokens)
            if n > room or over:
                full = True
                break
            jobs.append(job)
            rows, width, new, held = n, w, m, held + job.slot_tokens()
            full = rows >= room
        return jobs, full

    def take(self, now: float | None = None, idle_since: float = 0.0, room: int | None = None,
             wait: bool = True, tokens_room: int | None = None) -> Batch | None:
        """The batch that leaves now to a replica free since `idle_since` with `room` rows (default
        `max_batch_size`): a full one, one holding the requests expected, or one whose oldest job has waited
        `max_wait_ms` since that replica was free; or None. Without `wait` (a replica whose rows join a running
        batch at the next step: nothing is gained by waiting) what is waiting leaves at once. `tokens_room` (rows
        that join running ones, under --max_batch_tokens): the tokens the replica's running rows leave of the
        budget; the jobs taken hold at most that many (`Job.slot_tokens`), and while the oldest does not fit
        nothing leaves (`waits_for_tokens`)."""
        if not self.waiting:
            return None
        now = time.monotonic() if now is None else now
        if self.waits_for_tokens(tokens_room):
            return None
        jobs, full = self._fill(self.max_batch_size if room is None else room, tokens_room)
        enough = self.adaptive and len(jobs) >= self.expected(now)
        if wait and not full and not enough and now - max(jobs[0].arrived, idle_since) < self.max_wait:
            return None
        for job in jobs:
            self.waiting.remove(job)
        self.running.update(jobs)
        return Batch(id=next(self._batch_ids), key=jobs[0].key, jobs=jobs)

    def waits_for_tokens(self, tokens_room: int | None) -> bool:
        """Whether the oldest job waits for a replica's running rows to leave it `tokens_room` tokens (see `take`): it
        keeps its place, and the next rows to end make room for it. An idle replica has the whole budget, which every
        request fits: one whose rows alone pad past it is refused when it arrives."""
        return bool(self.waiting and tokens_room is not None and tokens_room < (self.max_batch_tokens or 0)
                    and self.waiting[0].slot_tokens() > tokens_room)

    def next_deadline(self, idle_since: float = 0.0) -> float | None:
        """When the oldest job's wait ends (monotonic seconds), or None with nothing waiting."""
        return max(self.waiting[0].arrived, idle_since) + self.max_wait if self.waiting else None
