"""The errors the library raises on purpose. Each message is one line; the exit rules (`run.lifecycle`: `run_main`,
or `install_exit_rules` for a script without it) print it as `error: ...` (no traceback) and exit 2 for a setup
error or a lock-step failure, 1 for a run that failed."""

from __future__ import annotations


class InferenceSetupError(ValueError):
    """A user-caused setup error: the message is one line naming the bad value and the valid ones. `ranks`: the
    global ranks that raise it (None: every rank), which wait for each other to report before exiting; a check
    only rank 0 can make (its output directory's lock, its port) names [0], so that rank exits at once."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = list(ranks) if ranks else None


class LockstepError(RuntimeError):
    """Ranks of one TP group were about to generate from different inputs (the lock-step guard). `ranks` are
    the global ranks of that group: they all raise it, and wait for each other to report before exiting."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = list(ranks) if ranks else None


class RunFailure(RuntimeError):
    """A run that cannot go on for a reason outside the code (the output disk is full, a directory cannot be
    written): every rank learns of it and raises it with the same one-line message; nothing is claimed done,
    and the message says how to continue."""

    ranks = None


def first_line(error: BaseException) -> str:
    """An exception's message as one line (its first non-empty line), for an `error:` line; a first line that only
    introduces the next ("Class validation error for validator 'validate_architecture':", huggingface_hub's strict
    configs, whose cause is on the second line) is joined with it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def sharding_failure(error: BaseException) -> bool:
    """Whether an exception from sharding a model or from its sharded forward is the model's (any type: a shape
    that does not fit, an index, an attribute a module lacks), to become one line naming the layer; not our own
    errors, a lost peer (torch.distributed's errors), or an interrupt, which keep their own handling."""
    import torch.distributed as dist

    ours = (InferenceSetupError, LockstepError, RunFailure)
    return isinstance(error, Exception) and not isinstance(error, (*ours, dist.DistError, ConnectionError,
                                                                    TimeoutError))
