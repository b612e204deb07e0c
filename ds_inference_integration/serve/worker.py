"""`ds-inference serve MODEL_DIR --worker --nnodes N --node_rank K --master_addr A --master_port P --tp_size T`:
this node's ranks of a replica that spans N machines (as a Kubernetes LeaderWorkerSet starts its worker pods).
Node 0 runs the front and the replica's leader; a worker node runs only its T/N ranks, which join the leader's
world through the rendezvous at A:P and take every batch from the leader's broadcast. No HTTP here.

The worker ends with its ranks: all exit 0 (the front stopped the replica) -> 0; one fails (its node's rank
died, or the leader's side went away and the collectives broke) -> the rest are ended and it exits 3, so that
the supervisor restarts the group (LeaderWorkerSet's RecreateGroupOnPodRestart). SIGTERM ends its ranks."""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from ..run.ranks import start_ranks
from .replicas import ENGINE
from .settings import engine_settings, parse

EXIT_RANK_FAILED = 3


def main(argv: list[str]) -> int:
    model_dir, serve_args, inference_args = parse(argv)
    local = inference_args.tp_size // serve_args.nnodes
    own_logs = serve_args.log_dir is None  # removed at exit, however the worker ends
    log_dir = Path(serve_args.log_dir or tempfile.mkdtemp(prefix="ds-inference-worker-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _run(serve_args, inference_args, model_dir, local, log_dir)
    finally:
        if own_logs:
            shutil.rmtree(log_dir, ignore_errors=True)


def _run(serve_args, inference_args, model_dir: str, local: int, log_dir: Path) -> int:
    import json

    world = (inference_args.tp_size, serve_args.node_rank * local, serve_args.master_addr, serve_args.master_port)
    # no front on this node: start_ranks shares the cores among its ranks (`serving_threads(local, front=False)`)
    procs = start_ranks(local, ENGINE, [json.dumps(engine_settings(model_dir, serve_args, inference_args))], log_dir,
                        world=world)
    print(f"ds-inference serve --worker: node {serve_args.node_rank} of {serve_args.nnodes}, ranks {world[1]} to "
          f"{world[1] + local - 1} of tp {inference_args.tp_size}, joining {serve_args.master_addr}:"
          f"{serve_args.master_port} (rank logs in {log_dir})", flush=True)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # Ctrl-C, a closed terminal: as SIGTERM
        signal.signal(sig, lambda *_: stopping.append(True))
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):  # as the front: they mean nothing here
        signal.signal(sig, signal.SIG_IGN)
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if stopping or failed or all(c == 0 for c in codes):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(5)
        except Exception:  # noqa: BLE001 - a rank that does not go within 5 s is killed
            p.kill()
            p.wait()
    if failed and not stopping:
        print(f"error: a rank of node {serve_args.node_rank} exited with code {failed[0]}; this node's ranks ended",
              file=sys.stderr, flush=True)
        return EXIT_RANK_FAILED
    return 0
