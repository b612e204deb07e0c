"""The wire between the front and each replica's leader, and from the leader to its peers: every message a typed
dataclass (pickled by `multiprocessing.connection` and by the peers' broadcast). Rows are named by the id the front
gives each when it admits it, never by their place in a batch; the engine builds the model's inputs from each row's
prompt.

    front -> leader -> every rank   Admit (rows, with what rows generated together share), Cancel (rows whose
                                    clients left), Stop; the leader adds Keepalive while it has nothing to run
    leader -> front                 Hello (which replica this is), Ready (with its capacity), Alive, Tokens (the new
                                    token of each running row, a step), Finished (a row's sequences and why it
                                    ended), Failed (rows that failed, and why)

Every admitted row is answered once, by Finished or Failed (a cancelled row too: Finished, reason "cancelled"), so
the front always knows which rows a replica holds."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from .sampling import SamplingParams

FRONT_ENV = "DS_INFERENCE_SERVE_FRONT"  # host:port of the front's socket (the leader connects)
AUTHKEY_ENV = "DS_INFERENCE_SERVE_AUTHKEY"  # hex; the front makes a random one per start


def no_delay(conn) -> None:
    """Each message on a front-leader connection leaves at once: TCP_NODELAY (Nagle's algorithm held a step's small
    Tokens message until the previous one was acknowledged, and the receiver delays its acknowledgements: issue #42
    measured a 1-token request at 52 ms with it, 5 ms without)."""
    with socket.socket(fileno=socket.dup(conn.fileno())) as sock:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass(frozen=True)
class BatchKey:
    """What rows generated together must share: beam search's settings (a beam batch has one length, one set of
    stop strings) and generate's own settings; greedy and sampled rows share only the repetition penalty."""

    num_beams: int = 1
    num_return_sequences: int = 1
    max_new_tokens: int = 0  # beams only; 0 for per-row lengths
    stop: tuple[str, ...] = ()  # beams only
    min_tokens: int = 0  # beams only
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    generate: tuple[tuple[str, str], ...] = ()  # other generate settings (/generate), as (name, JSON value)


@dataclass
class RowSpec(SamplingParams):
    """One sequence to generate, as the engine needs it: its prompt, how its tokens are chosen (`SamplingParams`, the
    sampler's, carried unchanged from the request), where it ends, and the id the front gave it (`protocol.Row`, the
    front's record of a row, adds what comes back)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: end the row at any of these (kept in its text), not before min_tokens
    logprobs: int = -1  # each new token's log probability and the top `logprobs` (-1: none; the step engine's)
    prompt_logprobs: bool = False  # and each prompt token's after the first (`echo` with `logprobs`)
    id: int = 0


# front -> leader -> every rank ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Admit:
    """Rows to generate, sharing `key`; `group`: the batch they form (the batch engine runs it as one generate)."""

    group: int
    key: BatchKey
    rows: tuple[RowSpec, ...]
    alone: bool = False  # a request run again after its batch failed: run with no other request beside it


@dataclass(frozen=True)
class Cancel:
    """Rows whose clients left: each ends at the next step (and is answered Finished, reason "cancelled")."""

    rows: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    """End the replica (the front drains or is gone)."""


@dataclass(frozen=True)
class Keepalive:
    """The leader's, to its peers while idle, so that a waiting peer never reaches the process group's timeout."""


# leader -> front --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    pid: int  # the leader's: which replica's connection this is


@dataclass(frozen=True)
class Ready:
    report: str  # the setup line
    capacity: int  # rows it holds at most
    joins_running: bool  # whether rows may be admitted while others run (the batch engine: no)


@dataclass(frozen=True)
class Alive:
    pass


@dataclass(frozen=True)
class RowOutput:
    """What one step gave one row: its new token, its count of new tokens so far (this one included), where the row
    asked for them (`RowSpec.logprobs`, `prompt_logprobs`) the token's log probability with the top ones' ((its own,
    ((id, log probability)...))) and, with its first token, each prompt token's after the first; and why the row
    ends with this token, where it does (the step engine's: a stream's last token chunk then carries it, as vLLM's)."""

    token: int
    count: int
    logprobs: tuple | None = None
    prompt_logprobs: list | None = None
    ends: str | None = None  # "stop" or "length" where this token ends the row (its Finished follows)


@dataclass(frozen=True)
class Tokens:
    """A step's new tokens: one record per row that got one (row id -> `RowOutput`)."""

    rows: dict[int, RowOutput] = field(default_factory=dict)


@dataclass(frozen=True)
class Finished:
    row: int
    sequences: list[list[int]]  # new tokens only; beams: num_return_sequences of them
    reasons: list[str]  # "stop", "length" or "cancelled", one per sequence


@dataclass(frozen=True)
class Failed:
    rows: tuple[int, ...]
    status: int  # the HTTP status it answers: 400 for what the request asked, 500 otherwise
    message: str
    together: bool = False  # the rows' batch failed as one (which row made it fail is not known)
