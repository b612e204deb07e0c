"""The replicas the front starts and watches: each a world of T ranks (`run.ranks.start_ranks`, its own rendezvous
port, as DeepSpeed-MII starts its replicas), whose leader connects back to the front's socket.

A replica is *broken* when any of its ranks exits, when its connection drops, or when its leader has said
nothing for `--inference_timeout`, idle or generating (a stopped rank: its peers' watchdogs end them within the
timeout too; a long batch keeps saying it is alive). The front then answers every open request 503, ends every rank,
and exits non-zero, so that a supervisor restarts it (TGI's launcher and vLLM's engine monitor do the same)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path

from ..run.ranks import start_ranks
from ..topology import serving_threads
from .wire import AUTHKEY_ENV, FRONT_ENV, Hello, Stop, no_delay

ENGINE = "ds_inference_integration.serve.engine"


class Replica:
    """One replica as the front sees it: its ranks, its leader's connection, and the rows it holds (admitted, not yet
    answered). It takes rows up to its capacity; an engine that does not take rows while others run (the batch
    engine: one generate a batch) takes none until it holds none."""

    def __init__(self, index: int, procs: list[subprocess.Popen], log_dir: Path):
        self.index, self.procs, self.log_dir = index, procs, log_dir
        self.conn = None
        self.state = "loading"  # loading, ready
        self.capacity, self.joins_running = 0, False  # the leader's Ready says
        self.rows: dict[int, int] = {}  # the ids of the rows it holds -> the tokens each holds (`Row.slot_tokens`)
        self.last_heard = self.free_since = time.monotonic()

    def free(self) -> int:
        """How many rows it takes now."""
        if self.state != "ready" or (self.rows and not self.joins_running):
            return 0
        return self.capacity - len(self.rows)

    def tokens_room(self, max_batch_tokens: int | None) -> int | None:
        """What its running rows leave of --max_batch_tokens, for rows that join them (`Queue.take`); None for the
        batch engine (a batch of its own: the padded rule) or without the flag."""
        if not self.joins_running or not max_batch_tokens:
            return None
        return max_batch_tokens - sum(self.rows.values())

    def waits_for_company(self) -> bool:
        """Whether a batch for it waits in the queue for company (`Queue.take(wait=...)`): always for the batch engine;
        for rows that join running ones, only while it runs none. Rows then join at the next step, and waiting
        gains nothing; an idle replica's first admission waits as the batch engine's does, so that clients that
        come back together start together (16 clients at fixed lengths, admitted one or two at a time when each
        came back, ran 14.6 rows a step against 16: the embedded T5 at 0.86x the batch engine's tokens/s at tp 1,
        `ds-inference bench serve --output_lengths 64`, 2026-12-05)."""
        return not self.joins_running or not self.rows

    def send(self, message) -> None:
        self.conn.send(message)

    def exited(self) -> str | None:
        """Why this replica is gone (a rank's exit), or None while every rank runs."""
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                return f"replica {self.index} rank {rank} exited with code {code}{_last_error(p)}"
        return None

    def kill(self, grace: float = 2.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)  # a stopped rank cannot act on SIGTERM
                    p.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _last_error(proc: subprocess.Popen) -> str:
    """The `error:` line a rank printed last (ranks other than 0 log to a file), if any."""
    path = getattr(proc, "log_path", None)
    if path is None or not Path(path).is_file():
        return ""
    lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.startswith("error:")]
    return f": {lines[-1][len('error:'):].strip()}" if lines else ""


class Replicas:
    """Start R replicas of T ranks; `on_message(replica, message)` and `on_lost(replica, why)` are called from
    reader threads (the server hands them to its event loop)."""

    def __init__(self, settings: dict, tp_size: int, dp_size: int, log_dir: Path, on_message, on_lost,
                 nodes: tuple[int, str, int | None] = (1, "127.0.0.1", None)):
        self.settings, self.tp_size, self.dp_size, self.log_dir = settings, tp_size, dp_size, log_dir
        self.nnodes, self.master_addr, self.master_port = nodes
        self.on_message, self.on_lost = on_message, on_lost
        self.replicas: list[Replica] = []
        self.authkey = os.urandom(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.authkey)

    def start(self) -> None:
        host, port = self.listener.address
        for r in range(self.dp_size):
            log_dir = self.log_dir / f"replica-{r}"
            log_dir.mkdir(parents=True, exist_ok=True)
            env = {FRONT_ENV: f"{host}:{port}", AUTHKEY_ENV: self.authkey.hex()}
            world = None
            if self.nnodes > 1:  # this node's share of the replica: ranks 0.. of it; the --worker nodes start the rest
                world = (self.tp_size, 0, self.master_addr, self.master_port)
            procs = start_ranks(self.tp_size // self.nnodes, ENGINE, [json.dumps(self.settings)], log_dir,
                                extra_env=env, first_device=r * self.tp_size, world=world,
                                threads=serving_threads(self.dp_size * self.tp_size // self.nnodes, front=True))
            self.replicas.append(Replica(r, procs, log_dir))
        threading.Thread(target=self._accept, daemon=True, name="serve-accept").start()

    def _accept(self) -> None:
        """Each leader connects once and says hello with its pid: that names its replica."""
        pending = {r.procs[0].pid: r for r in self.replicas}
        while pending:
            try:
                conn = self.listener.accept()
                no_delay(conn)
                hello = conn.recv()
            except (OSError, EOFError):
                return
            replica = pending.pop(hello.pid, None) if isinstance(hello, Hello) else None
            if replica is None:
                conn.close()
                continue
            replica.conn = conn
            threading.Thread(target=self._read, args=(replica,), daemon=True,
                             name=f"serve-replica-{replica.index}").start()

    def _read(self, replica: Replica) -> None:
        while True:
            try:
                message = replica.conn.recv()
            except (EOFError, OSError):
                self.on_lost(replica, f"replica {replica.index} closed its connection")
                return
            self.on_message(replica, message)

    def stop(self) -> None:
        """Ask every leader to end its replica, then end what is left."""
        for replica in self.replicas:
            if replica.conn is not None and replica.state == "ready":
                try:
                    replica.send(Stop())
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        for replica in self.replicas:
            for p in replica.procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            replica.kill()
        self.listener.close()

    def kill(self) -> None:
        for replica in self.replicas:
            replica.kill()
        self.listener.close()
