"""The front process's state: the replicas, the queue, the batches they run, and what the HTTP routes wait on.

Everything here runs on the event loop's thread (the replica reader threads hand their messages over with
`call_soon_threadsafe`), so no lock is needed. States: loading (until every replica's leader says ready),
ready, draining (after SIGTERM: new requests 503, open ones finish, then exit 0), broken (a rank died or stopped
answering: every open request 503, every rank ended, exit non-zero)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from .batching import Batch, Job, Queue
from .metrics import Metrics
from .protocol import BatchKey, Row, ServeError
from .replicas import Replica, Replicas

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
        self.state, self.why = "loading", ""
        self.exit_code = 0
        self.metrics = Metrics()
        self._replicas_factory = replicas_factory
        self.replicas: Replicas | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wakeup: asyncio.Event | None = None
        self.open_jobs: set[Job] = set()
        self.on_exit = None  # set by the app: ends uvicorn
        self._tasks: list[asyncio.Task] = []

    # ----- life cycle
    async def start(self) -> None:
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
            raise ServeError(503, "the server is shutting down (SIGTERM); send the request to another replica")
        if self.state == "broken":
            raise ServeError(503, f"the server is broken and exiting: {self.why}", retry=False)

    def drain(self) -> None:
        """SIGTERM: stop taking requests, finish the open ones, then end the replicas and exit 0."""
        if self.state in ("draining", "broken"):
            return
        logger.warning("ds-inference serve: SIGTERM, draining %d open request(s)", len(self.open_jobs))
        self.state = "draining"
        asyncio.ensure_future(self._drain())

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
        """The client went away: out of the queue if it is still there; a running job's rows are discarded."""
        if job.done.done():
            return
        job.cancelled = True
        self.queue.remove(job)
        self.open_jobs.discard(job)
        job.done.set_result(None)
        self.metrics.queue_depth(len(self.queue))

    def _fail_job(self, job: Job, error: ServeError) -> None:
        self.open_jobs.discard(job)
        self.queue.remove(job)
        if not job.done.done():
            job.done.set_result(error)
        job.events.put_nowait(("error", error, None))

    def _finish_job(self, job: Job) -> None:
        self.open_jobs.discard(job)
        self.queue.remove(job)
        if not job.done.done():
            job.done.set_result(None)
        self.metrics.finished(job)

    # ----- replicas
    async def _dispatch(self) -> None:
        while True:
            idle = sorted((r for r in self.replicas.replicas if r.state == "idle"), key=lambda r: r.idle_since)
            if idle and self.state in ("ready", "draining"):
                batch = self.queue.take(idle_since=idle[0].idle_since)
                if batch is not None:
                    self._send(idle[0], batch)
                    continue
            deadline = self.queue.next_deadline(idle[0].idle_since) if idle else None
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _send(self, replica: Replica, batch: Batch) -> None:
        live = [j for j in batch.jobs if not j.cancelled]
        if not live:
            return
        batch.jobs = live
        rows = batch.rows
        width = max(len(r.prompt_ids) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids, mask = [], []
        for r in rows:
            padding = [pad] * (width - len(r.prompt_ids))
            ones, zeros = [1] * len(r.prompt_ids), [0] * len(padding)
            if self.encoder_decoder:  # the encoder reads right-padded sources, as the seq2seq collator pads them
                input_ids.append(r.prompt_ids + padding)
                mask.append(ones + zeros)
            else:  # decoder-only: new tokens follow every prompt directly
                input_ids.append(padding + r.prompt_ids)
                mask.append(zeros + ones)
        key = batch.key
        shared = {"num_beams": key.num_beams, "num_return_sequences": key.num_return_sequences,
                  "max_new_tokens": key.max_new_tokens or max(r.max_new_tokens for r in rows),
                  "stop": list(key.stop), "min_tokens": key.min_tokens,
                  "repetition_penalty": key.repetition_penalty, "length_penalty": key.length_penalty,
                  "generate": {k: json.loads(v) for k, v in key.generate}}
        replica.state, replica.batch = "busy", batch
        batch.started = time.monotonic()
        self.metrics.batch(len(rows), len(self.queue), replica.index)
        try:
            replica.send({"op": "batch", "id": batch.id, "input_ids": input_ids, "attention_mask": mask,
                          "rows": [r.wire() for r in rows], "shared": shared})
        except OSError as e:
            self.break_down(f"replica {replica.index}: sending a batch failed: {e}")

    def _row(self, batch: Batch, index: int) -> tuple[Job, int, Row]:
        for job in batch.jobs:
            if index < len(job.rows):
                return job, index, job.rows[index]
            index -= len(job.rows)
        raise IndexError(index)

    def _on_message(self, replica: Replica, message: dict) -> None:
        replica.last_heard = time.monotonic()
        op = message["op"]
        if op == "ready":
            replica.state, replica.idle_since = "idle", time.monotonic()
            logger.info("replica %d ready: %s", replica.index, message.get("report", ""))
            if self.state == "loading" and all(r.state != "loading" for r in self.replicas.replicas):
                self.state = "ready"
                print("ds-inference serve: ready", flush=True)
            self.wakeup.set()
            return
        batch = replica.batch
        if op in ("tokens", "done", "failed") and (batch is None or batch.id != message["id"]):
            return
        if op == "tokens":
            now = time.monotonic()
            for i, token in message["tokens"].items():
                job, ri, row = self._row(batch, i)
                row.tokens.append(token)
                if not job.cancelled:
                    if job.first_token_at is None:
                        job.first_token_at = now
                    job.events.put_nowait(("token", ri, token))
            for i, reason in message["finished"].items():
                job, ri, row = self._row(batch, i)
                row.finish = [reason]
                row.sequences = [list(row.tokens)]
                self._row_finished(job, ri)
        elif op == "done":
            for i, (sequences, reasons) in enumerate(zip(message["sequences"], message["finish"])):
                job, ri, row = self._row(batch, i)
                if row.finish is None:
                    row.sequences, row.finish = sequences, reasons
                    if job.first_token_at is None:
                        job.first_token_at = time.monotonic()
                    self._row_finished(job, ri)
            self._batch_over(replica)
        elif op == "failed":
            error = ServeError(500, f"generate failed on this batch: {message['message']}")
            for job in batch.jobs:
                self._fail_job(job, error)
            self._batch_over(replica)

    def _row_finished(self, job: Job, ri: int) -> None:
        job.finished_rows += 1
        if not job.cancelled:
            job.events.put_nowait(("finish", ri, None))
            if job.finished_rows == len(job.rows):
                self._finish_job(job)

    def _batch_over(self, replica: Replica) -> None:
        replica.state, replica.batch, replica.idle_since = "idle", None, time.monotonic()
        self.wakeup.set()

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
                if why is None and replica.batch is not None and now - replica.batch.started > self.inference_timeout:
                    why = (f"replica {replica.index} did not finish a batch within --inference_timeout "
                           f"{self.inference_timeout:g} s")
                if why is None and replica.state == "idle" and now - replica.last_heard > self.inference_timeout:
                    why = (f"replica {replica.index}'s leader stopped answering for --inference_timeout "
                           f"{self.inference_timeout:g} s")
                if why:
                    self.break_down(why)
                    return
