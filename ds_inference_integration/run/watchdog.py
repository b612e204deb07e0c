"""A rank that stops answering ends the whole run within `--inference_timeout`, with one line naming it.

Process-group timeouts cover the collectives that go through torch.distributed, but not DeepSpeed's CPU
shared-memory all-reduce, which busy-waits with no timeout: a peer that is stopped (SIGSTOP, a paused
container) or stuck keeps the others spinning forever. So every rank runs a small thread that beats a
heartbeat counter in the launcher's rendezvous store (its own TCP connection, with a short timeout) and
reads everybody else's: a peer whose counter has not moved for the timeout has stopped answering.

The thread then prints `error: rank R stopped answering ...`, SIGKILLs that peer if it is stopped and
runs on this host (it would otherwise stay until the launcher's grace period, or forever), and ends
this rank at once. A rank that finishes marks itself done first, so a peer still writing its results
is not mistaken for a stopped one. If the store itself stops answering (its host is the stopped rank
under the deepspeed launcher), that is reported the same way.

Cost: one store round trip per rank every `interval` seconds (a tenth of the timeout, at most 5 s).
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import sys
import threading
import time

_PREFIX = "ds_inference_watchdog"
_state: dict = {}


def _exit_with(message: str, rank: int) -> None:
    sys.stderr.write(f"\nerror: {message} [rank {rank}]\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def start(rank: int, world_size: int, timeout: float) -> None:
    """Start this rank's watchdog thread (once per process; a world of one needs none)."""
    if world_size < 2 or _state:
        return
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return  # not started by a launcher with a rendezvous store: process-group timeouts only
    interval = min(5.0, max(0.5, timeout / 10))
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(2.0, interval)))
    store.set(f"{_PREFIX}/where/{rank}", f"{socket.gethostname()} {os.getpid()}")
    _state.update(store=store, rank=rank, wake=threading.Event())
    atexit.register(finished)  # a script that simply returns is done too (run_main calls it before os._exit)
    thread = threading.Thread(target=_watch, args=(store, rank, world_size, timeout, interval), daemon=True,
                              name="ds-inference-watchdog")
    _state["thread"] = thread
    thread.start()


def finished() -> None:
    """This rank is done: peers stop expecting its heartbeat, and the watchdog's thread ends (woken from its sleep,
    waited for up to 2 s). Left running, the daemon thread could be inside a store call of torch's C++ while the
    interpreter tore down at exit (its sleep was up to 5 s of every beat): one suspect for a clean run's rank that
    aborted in its teardown ("terminate called without an active exception", twice in one `make test`, 2026-12-05,
    not reproduced alone)."""
    store = _state.get("store")
    if store is not None and not _state.get("done"):
        _state["done"] = True
        try:
            store.add(f"{_PREFIX}/done/{_state['rank']}", 1)
        except Exception:  # noqa: BLE001 - the store may already be gone at exit; nothing is waiting on this
            pass
    if "wake" in _state:
        _state["wake"].set()
    thread = _state.get("thread")
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=2.0)


def explain_failure() -> None:
    """Called by a rank that is about to exit because something failed (a collective timed out, a connection
    closed): if a peer has also stopped beating, that is the likely cause, so say so as the watchdog would,
    and end that peer if it runs here. A collective's own timeout can fire a moment before the watchdog."""
    last_change = _state.get("last_change")
    if not last_change or _state.get("done"):
        return
    now = time.monotonic()
    stale = [r for r, t in last_change.items() if now - t > 3 * _state["interval"]]
    if stale:
        sys.stderr.write(f"\nerror: {_stopped(stale[0], now - last_change[stale[0]])} [rank {_state['rank']}]\n")
        sys.stderr.flush()


def _stopped(peer: int, silent: float) -> str:
    """The line that names a stopped peer (which is SIGKILLed if it runs on this host)."""
    where = _state.setdefault("where", {}).get(peer) or _where(_state["store"], peer)
    _kill_if_local(where)
    return (f"rank {peer}{' (' + where + ')' if where else ''} stopped answering: no heartbeat for {silent:.0f} s "
            f"(--inference_timeout {_state['timeout']:.0f}); ending the run")


def _watch(store, rank: int, world_size: int, timeout: float, interval: float) -> None:
    peers = [r for r in range(world_size) if r != rank]
    last_value = {r: None for r in peers}
    last_change = {r: time.monotonic() for r in peers}
    _state.update(last_change=last_change, interval=interval, timeout=timeout)
    last_store_ok = time.monotonic()
    while not _state.get("done"):
        now = time.monotonic()
        try:
            store.add(f"{_PREFIX}/beat/{rank}", 1)
            known = _state.setdefault("where", {})
            for r in peers:
                if r not in known and store.check([f"{_PREFIX}/where/{r}"]):
                    known[r] = _where(store, r)  # kept: by the time a peer stops, the store may be gone
                if store.add(f"{_PREFIX}/done/{r}", 0):
                    last_change[r] = now  # finished cleanly: not expected to beat any more
                    continue
                value = store.add(f"{_PREFIX}/beat/{r}", 0)
                if value != last_value[r]:
                    last_value[r], last_change[r] = value, now
            last_store_ok = now
        except Exception:  # noqa: BLE001 - a store that does not answer is judged below, by how long
            if time.monotonic() - last_store_ok > timeout:
                host_rank = "" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else " (rank 0 hosts it)"
                _exit_with(f"the rendezvous store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                           f"{host_rank} stopped answering for {timeout:.0f} s (--inference_timeout); ending the run",
                           rank)
        stopped = [r for r in peers if now - last_change[r] > timeout]
        if stopped:
            _exit_with(_stopped(stopped[0], now - last_change[stopped[0]]), rank)
        _state["wake"].wait(interval)  # `finished` wakes it


def _where(store, rank: int) -> str:
    try:
        host, pid = store.get(f"{_PREFIX}/where/{rank}").decode().split()
        return f"pid {pid} on {host}"
    except Exception:  # noqa: BLE001 - only for the message
        return ""


def _kill_if_local(where: str) -> None:
    """SIGKILL a stopped peer on this host (only if /proc says it is stopped: never a process that merely reused
    a dead peer's pid, and a running one is left to the launcher's own termination)."""
    parts = where.split()
    if len(parts) == 4 and parts[3] == socket.gethostname():
        try:
            with open(f"/proc/{int(parts[1])}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state in ("T", "t"):
                os.kill(int(parts[1]), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
