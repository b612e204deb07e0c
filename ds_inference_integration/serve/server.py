"""The front process's state: the replicas, the queue, the batches they run, and what the HTTP routes wait on.

Everything here runs on the event loop's thread (the replica reader threads hand their messages over with
`call_soon_threadsafe`), so no lock is needed. States: loading (until every replica's leader says ready),
ready, draining (after SIGTERM, SIGINT or SIGHUP: new requests 503, open ones finish, then exit 0), broken (a rank
died or stopped answering, or a second signal: every open request 503, every rank ended, exit non-zero). A batch that
failed on every rank alike is its requests' failure: each runs again alone, so that only the one that fails alone is
answered with the error (`Queue.retry_alone`)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import sys
import time

from .batching import Batch, Job, Queue
from .metrics import Metrics
from .protocol import Row, ServeError
from .replicas import Replica, Replicas
from .wire import Admit, BatchKey, Cancel, Failed, Finished, Ready, Tokens

logger = logging.getLogger("ds_inference_integration.serve")

EXIT_BROKEN = 3  # a rank died or stopped answering once serving: the supervisor restarts the server
EXIT_LOAD_FAILED = 2  # a replica did not come up (its rank printed why)
WATCH_SECONDS = 0.25


class Server:
    def __init__(self, replicas_factory, queue: Queue, tokenizer, inference_timeout: float, drain_timeout: float,
                 encoder_decoder: bool):
        self.queue, self.tokenizer = queue, tokenizer
        self.inference_timeout, self.drain_timeout = inference_timeout, drain_timeout
        self.encoder_decoder = encoder_decoder
        self.state, self.why, self.signal = "loading", "", "SIGTERM"
        self.exit_code = 0
        self.metrics = Metrics()
        self._replicas_factory = replicas_factory
        self.replicas: Replicas | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wakeup: asyncio.Event | None = None
        self.open_jobs: set[Job] = set()
        self.rows: dict[int, tuple[Job, int]] = {}  # the id of every row a replica holds -> its job and place there
        self._row_ids = itertools.count(1)
        self.on_exit = None  # set by the app: ends uvicorn
        self._tasks: list[asyncio.Task] = []

    # ----- life cycle
    async def start(self) -> None:
        # everything the front made to start (torch, transformers, the tokenizer: some 240k objects) out of the
        # cyclic collector's walks: a full one took 0.10 s of the event loop, now microseconds
        gc.freeze()
        # a worker thread decoding a big body hands Python's lock back to the event loop every millisecond, not every
        # 5 (the default): /live is answered between its slices
        sys.setswitchinterval(0.001)
        self.loop = asyncio.get_running_loop()
        self.wakeup = asyncio.Event()
        self.replicas = self._replicas_factory(self._from_thread(self._on_message), self._from_thread(self._on_lost))
        self.replicas.start()
        self._tasks = [asyncio.create_task(self._dispatch()), asyncio.create_task(self._watch())]

    def _from_thread(self, fn):
        return lambda *args: self.loop.call_soon_threadsafe(fn, *args)

    def admit(self) -> None:
        """Raise the 503 a request gets when the server cannot take it now."""
        if self.state == "loading":
            raise ServeError(503, "the model is still loading; retry when GET /health answers 200")
        if self.state == "draining":
            raise ServeError(503, f"the server is shutting down ({self.signal}); send the request to another replica")
        if self.state == "broken":
            raise ServeError(503, f"the server is broken and exiting: {self.why}", retry=False)

    def drain(self, signal: str = "SIGTERM") -> None:
        """SIGTERM, SIGINT or SIGHUP: stop taking requests, finish the open ones, then end the replicas and exit 0."""
        if self.state in ("draining", "broken"):
            return
        print(f"ds-inference serve: {signal}, draining {len(self.open_jobs)} open request(s) (up to --drain_timeout "
              f"{self.drain_timeout:g} s; {signal} again ends the server now)", flush=True)
        self.state, self.signal = "draining", signal
        asyncio.ensure_future(self._drain())

    def interrupt(self, signal: str, code: int) -> None:
        """A second signal while draining: every open request 503, every rank ended, exit `code` now."""
        if self.state == "broken":
            return
        self.state, self.why = "broken", f"{signal} again while draining"
        error = ServeError(503, f"the server was stopped ({signal} twice) before this request finished; send it to "
                                "another replica")
        for job in list(self.open_jobs):
            self._fail_job(job, error)
        self.queue.waiting.clear()
        self.exit_code = code
        self.loop.call_later(0.1, self._end)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.open_jobs and time.monotonic() < deadline and self.state == "draining":
            await asyncio.sleep(0.05)
        if self.state != "draining":
            return
        for job in list(self.open_jobs):
            self._fail_job(job, ServeError(503, f"the server shut down before this request finished "
                                                f"(--drain_timeout {self.drain_timeout:g} s)"))
        self.replicas.stop()
        self.exit_code = 0
        self.on_exit()

    def break_down(self, why: str) -> None:
        if self.state == "broken":
            return
        loading = self.state == "loading"
        self.state, self.why = "broken", why
        print(f"error: {why}; every open request answered 503, every rank ended", flush=True)
        error = ServeError(503, f"the server is broken and exiting: {why}", retry=False)
        for job in list(self.open_jobs):
            self._fail_job(job, error)
        self.queue.waiting.clear()
        self.exit_code = EXIT_LOAD_FAILED if loading else EXIT_BROKEN
        self.loop.call_later(0.1, self._end)  # the 503s go out first; ending the ranks can take their 2 s grace

    def _end(self) -> None:
        self.replicas.kill()
        self.on_exit()

    # ----- requests
    def submit(self, key: BatchKey, rows: list[Row]) -> Job:
        self.admit()
        if self.queue.full():
            self.metrics.rejected()
            raise ServeError(429, f"the queue is full ({self.queue.max_queue} requests waiting, --max_queue); "
                                  "retry later")
        job = Job(key=key, rows=rows, done=self.loop.create_future(), events=asyncio.Queue())
        self.queue.add(job)
        self.open_jobs.add(job)
        self.metrics.queue_depth(len(self.queue))
        self.wakeup.set()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: out of the queue if it is still there; a running job's rows end at its replica's
        next decoding step."""
        if job.done.done():
            return
        job.cancelled = True
        self.queue.remove(job)
        self.open_jobs.discard(job)
        job.done.set_result(None)
        self._end_rows(job)
        self.metrics.queue_depth(len(self.queue))

    def _end_rows(self, job: Job) -> None:
        """A running job's rows, ended at its replica's next step (the leader passes the word to its peers)."""
        for replica in self.replicas.replicas if self.replicas is not None else ():
            held = [i for i in job.row_ids if i in replica.rows]
            if held:
                try:
                    replica.send(Cancel(tuple(held)))
                except OSError:
                    pass  # the replica is gone: the watch sees it

    def _fail_job(self, job: Job, error: ServeError) -> None:
        self.open_jobs.discard(job)
        self.queue.remove(job)
        if not job.done.done():
            job.done.set_result(error)
        job.events.put_nowait(("error", error, None))
        if not job.cancelled:
            job.cancelled = True  # nothing more of it is sent; its other rows end at the next step
            if self.state != "broken":  # (a broken server's replicas are being ended, not told)
                self._end_rows(job)

    def _finish_job(self, job: Job) -> None:
        self.open_jobs.discard(job)
        self.queue.remove(job)
        if not job.done.done():
            job.done.set_result(None)
        self.metrics.finished(job)

    # ----- replicas
    async def _dispatch(self) -> None:
        while True:
            # the replica with the most room first (rows spread over replicas that take them while others run),
            # then the one free the longest; the next one only where the first has no room for the oldest job's
            # tokens under --max_batch_tokens (where it waits for company, the first one's rule decides)
            free = sorted((r for r in self.replicas.replicas if r.free()), key=lambda r: (-r.free(), r.free_since))
            if free and self.state in ("ready", "draining"):
                sent = False
                for replica in free:
                    tokens_room = replica.tokens_room(self.queue.max_batch_tokens)
                    batch = self.queue.take(idle_since=replica.free_since, room=replica.free(),
                                            wait=replica.waits_for_company(), tokens_room=tokens_room)
                    if batch is not None:
                        self._send(replica, batch)
                        sent = True
                        break
                    if not self.queue.waits_for_tokens(tokens_room):
                        break
                if sent:
                    continue
            deadline = self.queue.next_deadline(free[0].free_since) if free else None
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _send(self, replica: Replica, batch: Batch) -> None:
        """A batch's rows to a replica, each under a new id (a job run again alone gets new ones)."""
        batch.jobs = [j for j in batch.jobs if not j.cancelled]
        if not batch.jobs:
            return
        specs = []
        for job in batch.jobs:
            job.row_ids = [next(self._row_ids) for _ in job.rows]
            for ri, (row, row_id) in enumerate(zip(job.rows, job.row_ids)):
                self.rows[row_id] = (job, ri)
                specs.append(row.spec(row_id))
                replica.rows[row_id] = row.slot_tokens()
        batch.started = time.monotonic()
        self.metrics.batch(len(specs), len(self.queue), replica.index)
        try:
            replica.send(Admit(group=batch.id, key=batch.key, rows=tuple(specs), alone=batch.jobs[0].alone))
        except OSError as e:
            self.break_down(f"replica {replica.index}: sending a batch failed: {e}")

    def _answered(self, replica: Replica, row_id: int) -> tuple[Job, int, Row] | None:
        """A row the replica no longer holds: its job, place and row (None for one the front forgot)."""
        had_room = replica.free() > 0
        replica.rows.pop(row_id, None)
        if (replica.free() and not had_room) or (replica.joins_running and not replica.rows):
            replica.free_since = time.monotonic()  # free again, or (rows joining running ones) idle since now
            self.wakeup.set()
        elif replica.tokens_room(self.queue.max_batch_tokens) is not None:
            self.wakeup.set()  # its tokens back under --max_batch_tokens: the oldest waiting job may fit now
        found = self.rows.pop(row_id, None)
        return None if found is None else (found[0], found[1], found[0].rows[found[1]])

    def _on_message(self, replica: Replica, message) -> None:
        replica.last_heard = time.monotonic()
        if isinstance(message, Ready):
            replica.state, replica.free_since = "ready", time.monotonic()
            replica.capacity, replica.joins_running = message.capacity, message.joins_running
            logger.info("replica %d ready: %s", replica.index, message.report)
            if self.state == "loading" and all(r.state != "loading" for r in self.replicas.replicas):
                self.state = "ready"
                print("ds-inference serve: ready", flush=True)
            self.wakeup.set()
        elif isinstance(message, Tokens):
            now = time.monotonic()
            self.metrics.step_rows.observe(len(message.rows))
            for row_id, out in message.rows.items():
                found = self.rows.get(row_id)
                if found is None:
                    continue
                job, ri = found
                row = job.rows[ri]
                if len(row.tokens) >= out.count:
                    continue  # a job run again alone (its batch failed): these tokens were sent the first time
                token = out.token
                row.tokens.append(token)
                if out.logprobs is not None:
                    row.token_logprobs.append(out.logprobs)
                if out.prompt_logprobs is not None:
                    row.prompt_token_logprobs = out.prompt_logprobs
                if not job.cancelled:
                    if job.first_token_at is None:
                        job.first_token_at = now
                    # the row's last token, where the engine says so: its stream's chunk carries the end
                    job.events.put_nowait(("token", ri, out.ends))
        elif isinstance(message, Finished):
            found = self._answered(replica, message.row)
            if found is not None and message.reasons != ["cancelled"]:
                job, ri, row = found
                if row.finish is None and not job.cancelled:
                    row.sequences = message.sequences
                    if job.first_token_at is None:
                        job.first_token_at = time.monotonic()
                    self._row_finished(job, ri, message.reasons)
        elif isinstance(message, Failed):
            found = [f for f in (self._answered(replica, row_id) for row_id in message.rows) if f is not None]
            jobs = list(dict.fromkeys(job for job, _, _ in found if not job.done.done()))
            if message.together and len(jobs) > 1:  # which request made it fail is not known: each runs again alone
                logger.warning("a batch of %d requests failed (%s); each runs again in a batch of its own",
                               len(jobs), message.message)
                self.queue.retry_alone(jobs)
                self.wakeup.set()
                return
            for job, _, row in found:
                if not job.done.done():
                    why = message.message if message.together else f"prompt {row.prompt_index}: {message.message}"
                    self._fail_job(job, ServeError(message.status, why, retry=False))

    def _row_finished(self, job: Job, ri: int, reasons: list[str]) -> None:
        row = job.rows[ri]
        if row.finish is not None:
            return  # a job run again alone: this row had finished the first time
        row.finish = reasons
        job.finished_rows += 1
        if not job.cancelled:
            job.events.put_nowait(("finish", ri, None))
            if job.finished_rows == len(job.rows):
                self._finish_job(job)

    def _on_lost(self, replica: Replica, why: str) -> None:
        if self.state not in ("broken",) and not (self.state == "draining" and not self.open_jobs):
            self.break_down(replica.exited() or why)

    async def _watch(self) -> None:
        """A rank that exits, a batch past --inference_timeout, a leader silent for that long: broken."""
        while self.state != "broken":
            await asyncio.sleep(WATCH_SECONDS)
            if self.state == "draining" and not self.open_jobs:
                continue  # the replicas are being stopped on purpose
            now = time.monotonic()
            for replica in self.replicas.replicas:
                why = replica.exited()
                if why is None and replica.state != "loading" and now - replica.last_heard > self.inference_timeout:
                    doing = "while generating" if replica.rows else "while idle"
                    why = (f"replica {replica.index}'s leader said nothing {doing} for --inference_timeout "
                           f"{self.inference_timeout:g} s (a stopped rank, or one decoding step that long)")
                if why:
                    self.break_down(why)
                    return
