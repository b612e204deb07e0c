"""The errors the library raises on purpose. Each message is one line that names the bad value and the valid
ones; `lifecycle.run_main` prints it as `error: ...` and exits 2 (a lock-step failure exits 1)."""


class InferenceSetupError(ValueError):
    """A user-caused setup error: the message is one line naming the bad value and the valid ones."""


class LockstepError(RuntimeError):
    """Ranks of one TP group were about to generate from different inputs (the lock-step guard)."""
