"""Local ranks forked from one process that imported their stack once (`start_ranks`' way on a machine without a GPU).

Why: a rank of `policy check`, `shard` or `serve` spends most of its start importing torch, transformers and
DeepSpeed: a tp-2 policy check rank of the embedded GPT-2 cost 7.2 CPU-s, 6.3 of them importing the 3,440 modules
it ends with (the same modules imported in one process: 6.2-6.5 CPU-s; 2 cores, 2026-12-06). The template imports
them once, and each rank is a fork of it that starts with them imported: a start of N ranks imports once, not N
times: a tp-2 `policy check` of that GPT-2 took 7.3-9.4 CPU-s forked and 11.8-13.9 as processes of their own
(three runs each, alternately, `/usr/bin/time python -m ds_inference_integration.tools.cli policy check
examples/models/gpt2-num2words-en-ro --tp-size 2` with DS_INFERENCE_FORK_RANKS=1 / 0; 6.5-8.1 s and 6.7-8.0 s of
wall time; 14.2-17.2 CPU-s and 9.9-11.4 s before the commands stopped importing torch themselves).
multiprocessing's forkserver does the same for a function; ranks are modules run as `python -m` runs them, with
their own environment, working directory, output file and ignored signals, and the starters watch them as processes
(`subprocess.Popen`'s poll, wait, signals and exit codes), so the few lines of fork and wait are here.
`tests/test_sync_and_failures.py` compares forked ranks with the same ranks started as processes, line for line and
exit code for exit code.

Where not: with a GPU (or another accelerator) in view. A process that touched CUDA cannot hand it to a fork, and
DeepSpeed's import asks torch for the GPU count; so the template first asks through NVML only
(`PYTORCH_NVML_BASED_CUDA_CHECK`, torch's fork-safe check) and declines where a GPU answers: the ranks are then
started as their own processes, as everywhere before. `DS_INFERENCE_FORK_RANKS=0` asks for that anywhere. The
template also declines where the imports left a Python thread running (a fork copies none of a thread but its
locks).

How the template and its starter talk: JSON lines on two pipes; the starter asks `{"module", "args", "env", "cwd",
"log", "ignored"}` and reads `started PID`, and later `exited PID CODE` (the code as `Popen.returncode` has it: negative for a
signal). A template whose starter is gone (its pipe closed without a `close`) kills its ranks, as a rank started
with `end_with_parent` dies with its starter; each rank dies with the template (Linux's parent-death signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

DS_PARENT_ENV = "DS_INFERENCE_PARENT_PID"  # the process that started a rank: its starter, or the template it forked
# "0": every rank its own process (`python -m`), with or without a GPU; "1": any module's ranks forked (by default
# only ours: a template imports our ranks' stack, which another module's ranks may not need)
FORK_ENV = "DS_INFERENCE_FORK_RANKS"
# The stack every rank of ours imports, loaded once by the template (the module the first rank runs comes on top)
PRELOAD = ("torch", "torch.distributed", "transformers", "deepspeed", "transformers.modeling_utils",
           "transformers.generation", "ds_inference_integration.load.loaders", "ds_inference_integration.shard.setup",
           "ds_inference_integration.policy.derive")
SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
READY_SECONDS = 300.0  # for the template's imports, on a loaded machine (they take ~7 s alone)


class ForkedRank:
    """A rank the template forked, as the starters use a `subprocess.Popen`: pid, poll, wait, send_signal,
    terminate, kill, returncode (and `log_path`, as `start_ranks` sets it)."""

    def __init__(self, template: Template, pid: int, module: str):
        self._template, self.pid, self.args, self.returncode = template, pid, module, None
        self.log_path = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._template.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self.returncode = self._template.wait_exit(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # The template reaps the rank and tells; until it has, the pid is the rank's (a zombie at worst)
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Template:
    """The starter's side: the template process, the ranks it forked and their exit codes."""

    def __init__(self, environ: dict):
        self.environ = dict(environ)
        request_r, self._request_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(request_r), str(reply_w)],
                                     pass_fds=(request_r, reply_w), env=self.environ,
                                     stdin=subprocess.DEVNULL)  # its ranks too: none reads the user's terminal
        os.close(request_r)
        os.close(reply_w)
        self._codes: dict[int, int] = {}
        self._started: list[int] = []
        self._changed = threading.Condition()
        self._state = "starting"  # starting, ready, declined: WHY, gone
        threading.Thread(target=self._read, daemon=True, name="ds-inference-rank-template").start()
        with self._changed:
            self._changed.wait_for(lambda: self._state != "starting", READY_SECONDS)
        if self._state == "starting":
            self.proc.kill()
            self._state = f"declined: not ready in {READY_SECONDS:.0f} s"

    @property
    def declined(self) -> str | None:
        """Why it forks no rank (declined, gone), or None."""
        return None if self._state == "ready" else self._state

    def _read(self) -> None:
        with os.fdopen(self._reply_r) as replies:
            for line in replies:
                word, _, rest = line.strip().partition(" ")
                with self._changed:
                    if word == "ready":
                        self._state = "ready"
                    elif word == "declined":
                        self._state = f"declined: {rest}"
                    elif word == "started":
                        self._started.append(int(rest))
                    elif word == "exited":
                        pid, code = rest.split()
                        self._codes[int(pid)] = int(code)
                    self._changed.notify_all()
        with self._changed:  # the template is gone: so are its ranks (the parent-death signal)
            self._state = "gone" if self._state in ("ready", "starting") else self._state
            self._changed.notify_all()

    def start(self, module: str, args: list[str], env: dict, log: Path | None) -> ForkedRank:
        request = {"module": module, "args": args, "env": env, "cwd": os.getcwd(), "log": str(log) if log else None,
                   "ignored": [int(sig) for sig in SIGNALS if signal.getsignal(sig) == signal.SIG_IGN]}
        with self._changed:
            if self._state != "ready":
                raise OSError(f"the rank template is {self._state}")
            os.write(self._request_w, (json.dumps(request) + "\n").encode())
            if not self._changed.wait_for(lambda: self._started or self._state != "ready", READY_SECONDS):
                raise OSError("the rank template did not fork")
            if not self._started:
                raise OSError(f"the rank template is {self._state}")
            return ForkedRank(self, self._started.pop(0), module)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._codes.get(pid, -signal.SIGKILL if self._state == "gone" else None)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes or self._state == "gone", timeout)
        return self.exit_code(pid)

    def close(self, kill_ranks: bool = False) -> None:
        """No more ranks from it: it ends once the ranks it forked have, or at once, killing them (`kill_ranks`)."""
        try:
            if not kill_ranks:
                os.write(self._request_w, b'"close"\n')
            os.close(self._request_w)
        except OSError:
            pass


_TEMPLATE: list[Template] = []  # the current one
_CLOSED: list[Template] = []
_LOCK = threading.Lock()


def end_all() -> None:
    """At this process's exit (and where a test counts its ranks' CPU): the ranks still running are killed, and the
    templates are waited for (their CPU and their ranks' is then counted as this process's children's, as ranks
    started as its own processes were)."""
    for t in _TEMPLATE + _CLOSED:
        t.close(kill_ranks=True)
    for t in _TEMPLATE + _CLOSED:
        try:
            t.proc.wait(10)
        except subprocess.TimeoutExpired:
            t.proc.kill()


def template(ranks: int, module: str) -> Template | None:
    """This process's template for its environment as it is now, to fork `ranks` ranks of `module` from, or None
    where they must be processes of their own: a GPU, `DS_INFERENCE_FORK_RANKS=0`, not Linux, a module not ours
    (unless `DS_INFERENCE_FORK_RANKS=1`), and one rank where this process has no template yet (a template and a fork
    cost more than the one rank's own imports: a server's two "nodes" of one rank each took 3 CPU-s more forked). A
    changed environment gets a new template (the old one ends with its ranks): what a rank imports can depend on it
    (PYTHONPATH, the tests' fault hooks)."""
    wanted = os.environ.get(FORK_ENV, "")
    if wanted == "0" or not sys.platform.startswith("linux"):
        return None
    if wanted != "1" and not module.startswith("ds_inference_integration."):
        return None
    if ranks < 2 and not (_TEMPLATE and _TEMPLATE[0].environ == os.environ):
        return None
    with _LOCK:
        if _TEMPLATE and _TEMPLATE[0].environ != os.environ:
            _CLOSED.append(_TEMPLATE.pop())
            _CLOSED[-1].close()
        if not _TEMPLATE:
            if not _CLOSED:
                import atexit

                atexit.register(end_all)
            _TEMPLATE.append(Template(dict(os.environ)))
        current = _TEMPLATE[0]
    return None if current.declined else current


# The template process: `python -m ds_inference_integration.run.template REQUEST_FD REPLY_FD`

def _why_not() -> str | None:
    """Why ranks must not be forked here (a GPU in view), asked without touching CUDA; None where they may."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch asks NVML, not the CUDA driver (the ranks' env is theirs)
    import torch

    if torch.cuda.is_available():
        return "a GPU is in view"
    for name in ("xpu", "mps", "hpu", "npu", "mlu"):
        backend = getattr(torch, name, None)
        if backend is not None and getattr(backend, "is_available", lambda: False)():
            return f"a {name} device is in view"
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}"
    return None


def _preload(name: str) -> None:
    import importlib

    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - the rank imports it again, and fails as a process of its own would
        pass


def _serve(request_fd: int, reply_fd: int) -> None:
    import selectors

    def reply(text: str) -> None:
        os.write(reply_fd, (text + "\n").encode())

    # What reaches the whole process group (Ctrl-C, a closed terminal, SLURM's SIGUSR1/2 and a systemd stop's
    # SIGTERM) is the ranks' to act on; the template stays, to tell how they ended
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    import gc

    # No collection while the stack is imported: its passes over the growing heap took a third of the import (the
    # PRELOAD modules: 6.3-6.4 CPU-s collected, 4.2-4.5 not, two runs each alternately; a tp-2 policy check of the
    # embedded GPT-2 7.8-8.2 CPU-s and 6.9-7.3 s against 8.9-10.2 and 7.8-9.3, four runs each alternately, 2026-12-06)
    gc.disable()
    why = _why_not()
    if why is None:
        for name in PRELOAD:
            _preload(name)
        if threading.active_count() > 1:
            why = f"the imports left {threading.active_count() - 1} thread(s) running"
    if why is not None:
        reply(f"declined {why}")
        return
    # the collector leaves the imported objects alone from here on: its passes over them would write to their pages,
    # and each rank would copy those pages from the template (the "copy on read" of forked Pythons)
    gc.freeze()
    gc.enable()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    reply("ready")
    children: set[int] = set()
    requests, closing = os.fdopen(request_fd, "rb", buffering=0), False
    selector = selectors.DefaultSelector()
    selector.register(request_fd, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    pending = b""
    while True:
        ready = {key.fd for key, _ in selector.select()}
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:  # reap what ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            reply(f"exited {pid} {os.waitstatus_to_exitcode(status)}")
        if request_fd in ready:
            chunk = requests.read(65536)
            if not chunk:  # the starter is gone (or closed us)
                selector.unregister(request_fd)
                if not closing:
                    for pid in children:
                        _kill(pid)
                closing = True
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if request == "close":
                    closing = True
                    continue
                try:
                    pid = _fork(request, (request_fd, reply_fd, wake_r, wake_w))
                except OSError as e:  # no fork (out of memory, of processes): the starter starts its ranks itself
                    reply(f"declined fork failed: {e}")
                    closing = True
                    continue
                children.add(pid)
                reply(f"started {pid}")
        if closing and not children:
            return


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _fork(request: dict, own_fds: tuple[int, ...]) -> int:
    """Fork one rank. Its environment is set before the fork, so that what runs at a fork in the child (a library's
    `os.register_at_fork`) sees the rank's, and given back here after it."""
    module = request["module"]
    if module.startswith("ds_inference_integration."):  # ours: importing runs nothing but definitions
        _preload(module)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(request["env"], **{DS_PARENT_ENV: str(os.getpid())})
    try:
        pid = os.fork()
    except OSError:
        os.environ.clear()
        os.environ.update(saved)
        raise
    if pid:
        os.environ.clear()
        os.environ.update(saved)
        return pid
    code = 1
    try:
        code = _run_rank(request, own_fds)
    finally:
        os._exit(code)


def _run_rank(request: dict, own_fds: tuple[int, ...]) -> int:
    """In the forked child: become the rank `python -m MODULE ARGS` would be, run it, and end as the interpreter
    would (non-daemon threads joined, atexit handlers, streams flushed), without its teardown."""
    import atexit
    import ctypes
    import runpy

    signal.set_wakeup_fd(-1)
    for fd in own_fds:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for sig in SIGNALS:  # as an exec'd child has them: what its starter ignores stays ignored, the rest default
        if sig in request["ignored"]:
            signal.signal(sig, signal.SIG_IGN)
        else:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the template
    if os.getppid() != int(os.environ[DS_PARENT_ENV]):
        return 1
    os.chdir(request["cwd"])
    if request["log"]:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # as PYTHONUNBUFFERED (start_ranks sets it) makes a process's
        stream.reconfigure(line_buffering=True, write_through=True)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the template's torch read its own, not the rank's
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = [request["module"], *request["args"]]
    code, interrupted = 0, False
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt as e:
        sys.excepthook(type(e), e, _own_frames(e))
        interrupted = True
    except BaseException as e:  # noqa: BLE001 - as the interpreter: the hook prints it, exit 1
        sys.excepthook(type(e), e, _own_frames(e))
        code = 1
    threading._shutdown()  # noqa: SLF001 - the interpreter's own join of the non-daemon threads at exit
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as CPython ends on an uncaught KeyboardInterrupt: by SIGINT itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _own_frames(e: BaseException):
    """The traceback from the rank's module on, as `python -m` shows it (less runpy's two frames there): not the
    template's and runpy's frames that ran it. Set on the exception too: the hook prints the exception's own."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
        tb = tb.tb_next
    e.__traceback__ = tb
    return tb


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # as a process's exit status: sys.exit(-1) is 255
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
