"""How a rank ends: a clean run tears the process group down; a failing rank prints one line and
exits at once, so that its peers see the closed connection and stop too instead of waiting out a
timeout in a collective (and the launcher, seeing a non-zero exit, ends the rest)."""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Callable

import torch.distributed as dist

from ..errors import InferenceSetupError, LockstepError, RunFailure
from . import output_dir, watchdog

# A setup error is the same on every rank, but a launcher ends all ranks as soon as one exits non-zero (the
# deepspeed launcher polls every second and SIGKILLs the rest; torchrun stops them too). So a rank that has
# printed its line waits until every rank has said, in the launcher's rendezvous store, that it printed its
# own, and at most this long (a peer that does not fail the same way is ended by the launcher anyway). A fixed
# sleep of 3 s was not enough: in CI, under load from a parallel test, rank 0 had not reached the check 3 s
# after rank 1 had (2026-12-02), and only rank 1's line was printed.
REPORT_GRACE_SECONDS = 30.0
_REPORTED_KEY = "ds_inference_reported"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def tear_down_at_exit(timeout: float = 10.0) -> None:
    """For a script that ends by returning rather than through `run_main` (the README's three changes): destroy the
    process groups at exit, while the interpreter is still whole (once per process), and end the rank by the
    project's rules after an uncaught exception (`install_exit_rules`).

    Left to the interpreter's teardown, torch's process-group objects were destroyed after Python's: a user's
    evaluation script that had written all its results aborted in 2 of 13 clean runs at dp 2 ("terminate called
    without an active exception", SIGABRT, exit -6; tests/workers/causal_lm_eval.py under torchrun, 2 CPU ranks,
    2026-12-04), and torchrun then reports the job failed (pytorch#190489); with the destroy, 0 of 30 alone, but it
    still aborted now and then under the test suite's load (3 of 8 `make test` runs, 2026-12-05/06). A destroyed
    group is only shut down: gloo's threads (two per group, and its transport's loop) end when the last Python
    reference to the group goes, and the Trainer had handed the device mesh, which holds its groups, to accelerate's
    process-wide state, and DeepSpeed pins the world group in `TorchBackend.barrier`'s default
    (`deepspeed_compat.unpin_world_group`), so they lived on into the interpreter's teardown (6 gloo threads at exit).
    So the destroy also runs what `release_at_exit` registered (the references the library handed out) and collects
    the garbage: the groups' threads are joined here, while the interpreter is whole (none left at exit). After an
    uncaught exception nothing is destroyed (a peer may be inside a collective; the rank leaves at once), and the
    destroy is bounded by `timeout`."""
    import atexit
    import threading

    install_exit_rules()
    if _teardown.get("registered"):
        return
    _teardown["registered"] = True

    def destroy():
        if _teardown.get("failed") or not (dist.is_available() and dist.is_initialized()):
            return
        sys.stdout.flush()
        sys.stderr.flush()
        worker = threading.Thread(target=_destroy_and_release, daemon=True, name="ds-inference-teardown")
        worker.start()
        worker.join(timeout)

    atexit.register(destroy)


_teardown: dict = {}
_RELEASES: list[Callable[[], None]] = []


def release_at_exit(release: Callable[[], None]) -> None:
    """`release()` drops, at a clean exit after the process groups are destroyed, references to them that the
    library put where the script cannot see them (see `tear_down_at_exit`)."""
    _RELEASES.append(release)


def _destroy_and_release() -> None:
    import gc

    dist.destroy_process_group()
    while _RELEASES:
        _RELEASES.pop()()
    gc.collect()  # the groups' last references are in cycles (a Trainer, its model): their threads are joined now


def install_exit_rules() -> None:
    """`run_main`'s exit rules for a script that does not call it (the README's three changes: the parser installs
    them, and `setup_inference` for a script with a parser of its own): an uncaught exception ends the rank as
    `run_main` would, one `error:` line for the library's errors and for a file system that said no, a traceback and
    a line otherwise, and the rank leaves at once (`os._exit`) so that its peers stop instead of waiting in a
    collective; Ctrl-C (KeyboardInterrupt) one line too, exit 130. Once per process.

    Without it, a user's script with the README's three changes (tests/workers/causal_lm_eval.py) at `--tp_size 2`
    on a model of 3 heads printed a traceback of 17 lines per rank around the one-line error (torchrun, 2 CPU
    ranks, 2026-12-04). Not in an interactive interpreter (`sys.ps1`: an error there must not end the session), which
    keeps Python's own handling. What it prints goes to the stderr of the moment it was installed:
    torch's process-group start wraps the hook in one that collects the output in a buffer and prints it after the
    hook returns, which this one never does (the watchdog's line about a stopped peer was lost that way)."""
    if _teardown.get("exit_rules"):
        return
    _teardown["exit_rules"] = True
    previous, stream = sys.excepthook, sys.stderr

    def on_uncaught(kind, error, tb):
        if hasattr(sys, "ps1") or not isinstance(error, (Exception, KeyboardInterrupt)):
            previous(kind, error, tb)
            return
        _teardown["failed"] = True
        sys.stderr = stream  # everything end_rank prints, the watchdog's explanation too: the rank exits from here
        end_rank(error)

    sys.excepthook = on_uncaught


def exit_now(code: int) -> None:
    """Leave now, without the interpreter's teardown: for a rank whose output is written (a tool's rank worker
    that returned), where gloo's threads can abort the teardown ("terminate called without an active exception",
    exit -6) and turn a run that succeeded into a failed one; and for a failing rank, whose peers must see it go."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_rank(e: BaseException) -> None:
    """End this rank after `e`, by the project's rules (see `run_main`), printing to sys.stderr; never returns."""
    stream = sys.stderr
    rank = os.environ.get("RANK", "0")
    if isinstance(e, KeyboardInterrupt):
        # Ctrl-C reaches every rank of a terminal's launch (torchrun forwards it too): each says so in one line
        # (each printed its traceback, 176-317 lines in all under torchrun, 2026-12-05). What a streamed predict
        # wrote is kept, and the same command resumes from it.
        stream.write(f"\nerror: interrupted (SIGINT); this rank stopped; a streamed predict resumes from its parts "
                     f"when the same command runs again [rank {rank}]\n")
        stream.flush()
        exit_now(EXIT_INTERRUPTED)
    if isinstance(e, ModuleNotFoundError) and e.name:
        e = InferenceSetupError(_not_installed(e.name))  # the same on every rank: as a setup error
    if isinstance(e, (InferenceSetupError, LockstepError, RunFailure)):
        # One write, starting on a fresh line: ranks share the launcher's stream (and tqdm's \r lines).
        stream.write(f"\nerror: {e} [rank {rank}]\n")
        stream.flush()
        ranks = getattr(e, "ranks", None) or range(int(os.environ.get("WORLD_SIZE", "1")))
        if len(ranks) > 1:  # a setup error is every rank's; a lock-step failure is its TP group's
            wait_for_peers_to_report(int(rank), list(ranks), REPORT_GRACE_SECONDS)
        exit_now(1 if isinstance(e, RunFailure) else 2)
    if _is_file_system_error(e):
        # The file system said no (full, read-only, a directory gone): not a bug of the code, so one line
        # naming the file, without a traceback. The other ranks see this one leave and stop.
        where = f": {e.filename}" if e.filename else ""
        stream.write(f"\nerror: {e.strerror or e} (errno {e.errno}){where}; nothing was claimed done: fix "
                     f"it and re-run the same command [rank {rank}]\n")
        stream.flush()
        exit_now(1)
    traceback.print_exception(e, file=stream)
    stream.write(f"\nerror: rank {rank} failed: {type(e).__name__}: {e}\n")
    stream.flush()
    watchdog.explain_failure()  # a peer that stopped answering is the likely cause: name it
    exit_now(1)


def _not_installed(module: str) -> str:
    """The line for a package a script needs and the environment lacks: which extra installs it where it is one of
    ours (a user's copy of run_translation.py without the [examples] extra met sacrebleu's ModuleNotFoundError as a
    traceback on every rank, where the library's own commands name the extra), else the package itself."""
    from ..extras import EXTRAS, PACKAGE

    top = module.split(".")[0]
    extra = next((name for name, packages in EXTRAS.items() if top in packages), None)
    if extra:
        return f"{top} is not installed; valid: pip install '{PACKAGE}[{extra}]'"
    return f"no module named {module!r} is installed; valid: install the package that provides {top!r}"


def run_main(main: Callable[[list[str]], object], argv: list[str]) -> int:
    """Run a script's `main(argv)` with the project's exit rules; returns 0 on success."""
    try:
        main(argv)
    except SystemExit as e:  # argparse's --help (code 0) and usage errors (code 2): its own message, its own code
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            sys.stderr.write(f"error: {e.code}\n")
        if code == 0:
            return 0
        exit_now(code)
    except BaseException as e:  # noqa: BLE001 - any failure must end this rank now, never hang
        end_rank(e)
    watchdog.finished()
    output_dir.release_all()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # gloo with a device mesh can abort (SIGABRT) in interpreter teardown after a clean run:
        # all output is written, so leave without it.
        exit_now(0)
    return 0


def _is_file_system_error(e: BaseException) -> bool:
    """An OSError from a file (with an errno), not from a connection: peers that leave are reported otherwise."""
    return isinstance(e, OSError) and bool(e.errno) and not isinstance(e, (ConnectionError, TimeoutError))


def wait_for_peers_to_report(rank: int, ranks: list[int], grace: float) -> int:
    """Count this rank as reported in the launcher's rendezvous store, then wait until all of `ranks` (the ranks
    that fail the same way) have, or `grace` seconds at most; returns the count seen last (0 when there is no
    store to count in).

    Before the process group exists nobody hosts the store yet: rank 0 hosts it then, as torch's env://
    rendezvous would (multi-tenant, so a process group created later in this process shares it), unless
    torchrun's agent already does (TORCHELASTIC_USE_AGENT_STORE). Every store call is bounded by what is left
    of `grace`; a store that cannot be reached ends the wait, never the exit."""
    import datetime

    deadline = time.monotonic() + grace
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:  # not started by a launcher with a rendezvous store: wait a little, blind
        time.sleep(min(grace, 3.0))
        return 0
    key = f"{_REPORTED_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{ranks[0]}"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    seen = 0
    try:
        timeout = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
        if dist.is_available() and dist.is_initialized():
            store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)
        else:
            hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            store = dist.TCPStore(host, int(port), world_size=world, is_master=hosts, wait_for_workers=False,
                                  multi_tenant=True, timeout=timeout)
        seen = store.add(key, 1)
        while seen < len(ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = store.add(key, 0)
        # the rank that hosts the store leaves last: a peer still asking it (the count it last saw was one short)
        # found it gone, and torch printed that connection's failure with 24 frames of its C++ stack beside the
        # one-line error (rank 1, deepspeed launcher, an empty --test_file, 2 runs in 5, 2026-12-05)
        done = store.add(f"{key}/seen", 1)
        host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        while host and done < len(ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
            done = store.add(f"{key}/seen", 0)
    except Exception:  # noqa: BLE001 - the store host has left, or never came: nothing more to wait for
        pass
    return seen
