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

from . import watchdog
from .errors import InferenceSetupError, LockstepError

# A setup error is the same on every rank, but a launcher ends all ranks as soon as one exits non-zero:
# each rank waits this long after reporting, so that its peers reach the same check and report too.
REPORT_GRACE_SECONDS = 3.0


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main: Callable[[list[str]], object], argv: list[str]) -> int:
    """Run a script's `main(argv)` with the project's exit rules; returns 0 on success."""
    rank = os.environ.get("RANK", "0")
    try:
        main(argv)
    except SystemExit as e:  # argparse's --help (code 0) and usage errors (code 2): its own message, its own code
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            sys.stderr.write(f"error: {e.code}\n")
        if code == 0:
            return 0
        _exit_now(code)
    except (InferenceSetupError, LockstepError) as e:
        # One write, starting on a fresh line: ranks share the launcher's stream (and tqdm's \r lines).
        sys.stderr.write(f"\nerror: {e} [rank {rank}]\n")
        sys.stderr.flush()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            time.sleep(REPORT_GRACE_SECONDS)
        _exit_now(2)
    except BaseException as e:  # noqa: BLE001 - any failure must end this rank now, never hang
        traceback.print_exc()
        sys.stderr.write(f"\nerror: rank {rank} failed: {type(e).__name__}: {e}\n")
        watchdog.explain_failure()  # a peer that stopped answering is the likely cause: name it
        _exit_now(1)
    watchdog.finished()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # gloo with a device mesh can abort (SIGABRT) in interpreter teardown after a clean run:
        # all output is written, so leave without it.
        _exit_now(0)
    return 0
