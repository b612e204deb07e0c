"""The errors the library raises on purpose. Each message is one line that names the bad value and the valid
ones; `lifecycle.run_main` prints it as `error: ...` and exits 2."""

from __future__ import annotations


class InferenceSetupError(ValueError):
    """A user-caused setup error: the message is one line naming the bad value and the valid ones."""


class LockstepError(RuntimeError):
    """Ranks of one TP group were about to generate from different inputs (the lock-step guard). `ranks` are
    the global ranks of that group: they all raise it, and wait for each other to report before exiting."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = list(ranks) if ranks else None
