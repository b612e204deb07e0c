"""Start N local ranks of a worker module (CPU gloo, or one GPU each) and wait for them without hanging: the
one way `policy check`, `shard`, `bench memory`, `serve` and the tests' worker checks start, watch and end
local ranks.

Why not torch's elastic launch (`torch.distributed.elastic.multiprocessing.start_processes`, what torchrun
runs): at the first rank that fails, its SubprocessContext SIGTERMs every other rank at once
(`SubprocessContext._poll` -> `close()`, torch 2.13), so peers that were about to write their own report
(`policy check` merges every rank's result file, and names every failing rank) are cut off. Here a failed
rank's peers get 5 s to finish and report, then the rest are killed; every rank's exit code is returned, and
ranks other than 0 write to log files, as torchrun's `--redirects` would. Without a GPU the ranks are forked from
one process that imported their stack once (`template.py`: a start of N ranks imports it once, not N times). The
command-line examples are started with the real launchers (deepspeed, torchrun) by the tests and the benchmarks,
as a user starts them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..topology import threads_per_rank
from .template import DS_PARENT_ENV, template

# The ports this process drew, each held by a socket bound to a name of its own in Linux's abstract namespace
# (nothing on disk: the kernel frees the name when the socket closes, at the latest when the process ends), for
# RESERVED_SECONDS: long enough for the rank or launcher given it to bind it
RESERVED_SECONDS = 600
_held: dict[int, tuple[socket.socket, float]] = {}


def free_port() -> int:
    """A port free now for a process started later to bind (a world's rendezvous store, a launcher's --master_port),
    drawn at random from 10000 up to the kernel's ephemeral range (`ip_local_port_range`), which the kernel never
    hands to a bind to port 0 or to an outgoing connection, and reserved on this machine while this process holds it
    (`RESERVED_SECONDS`): no other starter (the suite's second worker) draws it meanwhile. A port from the kernel's
    own draw (bind to port 0, as this did first) is one the next connection anywhere on the machine may take in the
    seconds until the rank binds it: a test's server found its port in use so, failing a CI run (2026-12-06); and
    two workers drawing the same of ~22,000 ports, neither reserving it, met about once in a dozen suites
    ("--master_port 27367 ... is in use", a fresh clone's `make test`, 2026-12-07). Where that range is not there
    (another kernel, a range from 10000 or lower), the kernel's draw."""
    import random

    now = time.monotonic()
    for port in [p for p, (_, since) in _held.items() if now - since > RESERVED_SECONDS]:
        _held.pop(port)[0].close()
    low = _ephemeral_low()
    for _ in range(200 if low > 11000 else 0):
        port = random.SystemRandom().randrange(10000, low)
        if port not in _held and _bindable(port) and _reserve(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reserve(port: int) -> bool:
    """Whether this process now holds `port`'s name (no other process holds it)."""
    name = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        name.bind(f"\0ds-inference-port-{os.getuid()}-{port}")
    except OSError:
        name.close()
        return False
    _held[port] = (name, time.monotonic())
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    """Free on every address (a rendezvous store listens on all of them; a listener there makes a bind to 127.0.0.1
    fail too, which the check before did alone)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def start_ranks(n: int, module: str, args: list[str], log_dir: str | Path, *, extra_env: dict | None = None,
                first_device: int = 0, world: tuple[int, int, str, int] | None = None,
                threads: int | None = None) -> list[subprocess.Popen]:
    """`python -m module args...` as ranks 0..n-1 of one world. Rank 0 prints to this process's output; every
    other rank writes to `log_dir/rank-R.log`, a file, not a pipe: a rank that prints more than a pipe holds
    would block (and its peers wait for the timeout) if nobody read the pipe while it runs. `first_device`: the
    first GPU of this world, where several worlds share a machine (`serve --dp_size`: replica r starts at r x T);
    `extra_env` is added to every rank's environment. `world`: (world size, this machine's first rank, master
    address, master port) where the world spans machines (`serve --nnodes`); by default the n ranks are the world,
    on 127.0.0.1 at a free port. `threads`: each rank's CPU threads where the environment does not set
    OMP_NUM_THREADS (default: the cores shared out among the n ranks)."""
    world_size, first, host, port = world or (n, 0, "127.0.0.1", free_port())
    procs, forks = [], template(n, module)  # forked from one process that imported their stack, where no GPU is in view
    for local in range(n):
        rank = first + local
        env = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"),  # one JIT build per venv
               **os.environ,
               # this interpreter's tools first (its venv's ninja): two ninja versions hash DeepSpeed's JIT build
               # commands differently, and alternating between them rebuilds the op (~55 s) every time
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(local), "LOCAL_SIZE": str(n),
               "MASTER_ADDR": host, "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
               DS_PARENT_ENV: str(os.getpid()), **(extra_env or {})}
        if first_device:
            env["DS_INFERENCE_FIRST_DEVICE"] = str(first_device)
        env.setdefault("OMP_NUM_THREADS", str(threads or threads_per_rank(n)))
        log_path = Path(log_dir) / f"rank-{rank}.log" if rank else None
        proc = None
        if forks is not None:
            try:
                proc = forks.start(module, args, env, log_path)
            except OSError:  # the template could not fork (or is gone): this rank and the rest as processes
                forks = None
        if proc is None:
            log = open(log_path, "w") if log_path else None
            # stdin from /dev/null: no rank reads the user's terminal (transformers asks there before running a
            # model's own code; every rank asking at once, each waiting 15 s, is what `own_code.check_trust` prevents)
            proc = subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=log,
                                    stderr=subprocess.STDOUT if log else None, text=True, stdin=subprocess.DEVNULL)
            if log:
                log.close()  # the child holds its own descriptor
        proc.log_path = log_path
        procs.append(proc)
    return procs


def end_with_parent() -> None:
    """This rank dies with the process that started it (`start_ranks` sets DS_INFERENCE_PARENT_PID): Linux's
    parent-death signal, so that a server killed with SIGKILL leaves no rank behind (its ranks would otherwise
    keep a replica's ports and memory until they reached a timeout). Checked after setting it, for a parent that
    died before."""
    parent = os.environ.get(DS_PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):
        os._exit(1)


def init_rank(timeout: float, device_type: str | None = None):
    """The start of every rank worker `start_ranks` starts: (topology from the environment, this rank's device),
    with the default process group up (NCCL on GPU, gloo on CPU) and bounded by `timeout` seconds.
    `device_type`: "cuda" or "cpu", or None for a GPU where there is one."""
    import datetime

    import torch
    import torch.distributed as dist

    from ..topology import Topology

    topology = Topology.from_env()
    cuda = torch.cuda.is_available() if device_type is None else device_type == "cuda"
    device = torch.device("cpu")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", topology.rank)) + int(os.environ.get("DS_INFERENCE_FIRST_DEVICE", 0))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend, deadline = process_group_backend(cuda), datetime.timedelta(seconds=timeout)
    store = _loopback_store(topology.rank, topology.world_size, deadline)
    if store is None:
        dist.init_process_group(backend, timeout=deadline)
    else:
        dist.init_process_group(backend, store=store, rank=topology.rank, world_size=topology.world_size,
                                timeout=deadline)
    return topology, device


def _loopback_store(rank: int, world_size: int, timeout):
    """The rendezvous store, with rank 0's listening on the loopback address only, where the world is this machine
    (MASTER_ADDR 127.x or localhost): torch's own (`init_process_group` from the environment) listens on every
    interface (`::`, seen in /proc/net/tcp6 while `serve` ran), so a server bound to 127.0.0.1 still had a port
    open to the network. Every rank then passes a store of its own making: torch prefixes the keys of a store it
    makes itself ("default_pg") and not those of one it is given, so a rank 0 given its store and peers left to
    torch waited for each other's keys until the timeout. None (torch's default) for a world across machines."""
    import ipaddress
    import socket

    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if world_size < 2 or not loopback or not port:
        return None
    if rank != 0:
        return dist.TCPStore(host, int(port), world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    # as torch's store binds: a restart within a minute finds the port's last connections in TIME_WAIT
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1" if host == "localhost" else host, int(port)))
    listener.listen(max(128, world_size))
    # detach: the store owns the descriptor from here on (the socket object, collected, would close it)
    return dist.TCPStore(host, int(port), world_size, True, timeout=timeout, master_listen_fd=listener.detach())


def process_group_backend(cuda: bool, environ=os.environ) -> str:
    """NCCL with one GPU per rank; gloo on CPU, and where local ranks share GPUs (tp 2 on a one-GPU machine, the
    GPU check's way to run the GPU path of tensor parallelism there): NCCL refuses two ranks on one device, gloo
    carries CUDA tensors."""
    import torch

    if not cuda:
        return "gloo"
    local = int(environ.get("LOCAL_SIZE") or environ.get("LOCAL_WORLD_SIZE") or environ.get("WORLD_SIZE") or 1)
    return "nccl" if local <= torch.cuda.device_count() else "gloo"


def stop_session(proc: subprocess.Popen, grace: float) -> int:
    """End a process started in its own session (`start_new_session=True`: a server with its ranks): SIGTERM, up to
    `grace` seconds for it to end by itself (a server drains), then SIGKILL for whatever is left of its process
    group. Returns its exit code."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.wait()


def wait_ranks(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes; once one rank fails (after 5 s for its peers to report) or at the deadline, the rest are killed."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        if failed is not None or time.monotonic() > deadline:
            time.sleep(5 if failed is not None else 0)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    return [p.wait() for p in procs]


def failure_text(procs: list[subprocess.Popen], codes: list[int]) -> str:
    """Why the ranks failed, with the last lines of the first failed rank whose output was captured."""
    why = f"a rank failed, exit codes {codes}" if any(c not in (0, -9) for c in codes) else "timed out"
    logged = [i for i in range(len(procs)) if getattr(procs[i], "log_path", None)]
    failed = [i for i in logged if codes[i] not in (0, -9)] or logged
    tail = procs[failed[0]].log_path.read_text(errors="replace")[-1500:] if failed else ""
    return why + (f"\nrank {failed[0]}:\n{tail}" if tail else "")
