"""Each mechanism's verdict on a model, one row each, kept with the derived policy (`Policy.verdicts`): what
`policy check` prints before its checks and `policy suggest` writes above the policy, so that a model a rule
misreads is seen in the rule's own words."""

from __future__ import annotations

import contextlib
import contextvars

_ROWS: contextvars.ContextVar[list | None] = contextvars.ContextVar("ds_inference_verdicts", default=None)
MECHANISMS = ("row-parallel linears", "attention", "per-rank attributes", "packed projections", "per-head biases",
              "experts", "mixers", "kept whole", "probe")


@contextlib.contextmanager
def recording():
    """While open, `note` adds rows to the list it yields."""
    rows: list[tuple[str, str, str]] = []
    token = _ROWS.set(rows)
    try:
        yield rows
    finally:
        _ROWS.reset(token)


def note(mechanism: str, where: str, verdict: str) -> None:
    rows = _ROWS.get()
    if rows is not None and (mechanism, where, verdict) not in rows:
        rows.append((mechanism, where, verdict))


def table(rows) -> list[str]:
    """The rows as aligned text lines, in `MECHANISMS` order (a mechanism with no row: "none")."""
    rows = sorted(rows, key=lambda r: MECHANISMS.index(r[0]) if r[0] in MECHANISMS else len(MECHANISMS))
    shown = [(m, w or "-", v) for m, w, v in rows] + [(m, "-", "none") for m in MECHANISMS[:-1]
                                                       if not any(r[0] == m for r in rows)]
    shown.sort(key=lambda r: MECHANISMS.index(r[0]) if r[0] in MECHANISMS else len(MECHANISMS))
    width = [max(len(r[i]) for r in shown) for i in range(2)]
    return [f"{m:<{width[0]}}  {w:<{width[1]}}  {v}" for m, w, v in shown]
