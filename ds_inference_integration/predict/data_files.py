"""A user's data files, checked before anything loads: each problem a file really has (it is missing or empty, a
byte is not UTF-8, one json line among good ones is malformed, a CSV row has another number of fields) is one
line naming the file, the line and what would be valid, the same on every rank. Then `datasets` loads them.

Why not let `datasets` find them: on such files it raised from inside its Arrow builder (a `DatasetGenerationError`
around a `UnicodeDecodeError` or an `ArrowInvalid` with no file or line), each rank printed two tracebacks, and
the user learned neither the file nor the line (2026-12-02, run_translation.py at tp 2)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from ..errors import InferenceSetupError

KINDS = {".json": "json", ".jsonl": "json", ".csv": "csv"}


def kind_of(path: str) -> str:
    """`json` or `csv`, as `datasets.load_dataset` names the builder for the file."""
    return KINDS.get(Path(path).suffix.lower(), "json")


def check_data_file(path: str, flag: str, what: str = "examples") -> None:
    """One line when `path` cannot be read as its kind of data file."""
    p = Path(path)
    if not p.is_file():
        raise InferenceSetupError(f"{flag} {path!r} does not exist")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InferenceSetupError(f"{flag} {path!r}: line {line} holds a byte that is not UTF-8 ({raw[e.start]:#04x} "
                                  f"at byte {e.start}); valid: a UTF-8 text file") from None
    if not text.strip():
        raise InferenceSetupError(f"{flag} {path!r} holds no {what}; give at least one line")
    if kind_of(path) == "csv":
        _check_csv(text, path, flag)
    else:
        _check_json(text, path, flag)


def _check_json(text: str, path: str, flag: str) -> None:
    """JSON lines (one object a line, blank lines allowed), or one JSON document (a list of objects), as the json
    builder of `datasets` reads either."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if number == 1 and _whole_document(text):
                return
            raise InferenceSetupError(f"{flag} {path!r}: line {number} is not valid JSON ({e.msg} at column "
                                      f"{e.colno}); valid: one JSON object per line") from None
        if not isinstance(row, dict):
            raise InferenceSetupError(f"{flag} {path!r}: line {number} is a JSON {type(row).__name__}, not an "
                                      "object; valid: one JSON object per line")


def _whole_document(text: str) -> bool:
    try:
        document = json.loads(text)
    except ValueError:
        return False
    return isinstance(document, list) and all(isinstance(row, dict) for row in document)


def _check_csv(text: str, path: str, flag: str) -> None:
    rows = csv.reader(io.StringIO(text))
    try:
        header = next(rows)
        for row in rows:
            if row and len(row) != len(header):
                raise InferenceSetupError(f"{flag} {path!r}: line {rows.line_num} has {len(row)} fields, the header "
                                          f"{len(header)} ({', '.join(header)}); valid: one field per column")
    except csv.Error as e:
        raise InferenceSetupError(f"{flag} {path!r}: line {rows.line_num} is not valid CSV ({e})") from None


def load_data_files(data_files: dict[str, str], cache_dir: str | None = None, what: str = "examples"):
    """`datasets.load_dataset` of a script's `--{split}_file`s, after `check_data_file` on each (the flag of a split
    is `--{split}_file`)."""
    from ..extras import optional_import

    load_dataset = optional_import("datasets", f"reading the {what}' data files").load_dataset
    kinds = {kind_of(p) for p in data_files.values()}
    if len(kinds) > 1:
        raise InferenceSetupError(f"the data files mix kinds ({', '.join(data_files.values())}); valid: all json/jsonl "
                                  "or all csv")
    for split, path in data_files.items():
        check_data_file(path, f"--{split}_file", what)
    return load_dataset(kinds.pop(), data_files=data_files, cache_dir=cache_dir)


def check_texts(values: list, flag: str, column: str, split: str) -> None:
    """Every example has a text in `column`: a null or a non-string there (a JSON null source) is one line naming
    the first example and the count."""
    bad = [i for i, v in enumerate(values) if not isinstance(v, str) or not v.strip()]
    if bad:
        value = values[bad[0]]
        shown = "null" if value is None else repr(value) if isinstance(value, str) else type(value).__name__
        raise InferenceSetupError(f"{len(bad)} of {len(values)} {split} examples have an empty {column!r} (the first: "
                                  f"example {bad[0] + 1}, {shown}; {flag}); valid: a text in every example")
