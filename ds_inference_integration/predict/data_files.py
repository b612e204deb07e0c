"""A user's data files, checked before anything loads: each problem a file really has (it is missing or empty, a
byte is not UTF-8, one json line among good ones is malformed, a CSV row has another number of fields, a column the
run reads is missing or empty) is one line naming the file, the line or example and what would be valid, the same on
every rank. Then `datasets` loads them.

Why not let `datasets` find them: on such files it raised from inside its Arrow builder (a `DatasetGenerationError`
around a `UnicodeDecodeError` or an `ArrowInvalid` with no file or line), each rank printed two tracebacks, and
the user learned neither the file nor the line (2026-12-02, run_translation.py at tp 2); a missing column or
language was a KeyError inside the tokenizing `map`.

`check_run_data` is what `InferenceArgumentParser` calls: it finds the files and columns by upstream's argument
names (`--train_file`, `--validation_file`, `--test_file`; `--source_lang`/`--target_lang` for translation's
`translation` column, `--text_column`/`--summary_column` for summarization), so an upstream-shaped script, the
examples and a user's copy alike, loads its data with upstream's own `load_dataset` call and needs no check of its
own."""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
from dataclasses import fields, is_dataclass
from pathlib import Path

from ..errors import InferenceSetupError

logger = logging.getLogger(__name__)

KINDS = {".json": "json", ".jsonl": "json", ".csv": "csv"}
# upstream examples' names for their data files, and the split each one is
SPLIT_FILES = {"train_file": "train", "validation_file": "validation", "test_file": "test"}


def kind_of(path: str) -> str:
    """`json` or `csv`, as `datasets.load_dataset` names the builder for the file."""
    return KINDS.get(Path(path).suffix.lower(), "json")


def check_data_file(path: str, flag: str, what: str = "examples", columns: Columns | None = None) -> None:
    """One line when `path` cannot be read as its kind of data file, or (with `columns`) its rows lack what the
    run reads. Read a line at a time: a bulk predict's data need not fit in memory (reading it whole, as this did,
    held the bytes and the text: twice the file on every rank). A file this reading refuses is offered to `datasets`
    before the refusal stands (`_datasets_rows`): the check must never refuse what upstream's `load_dataset` reads."""
    p = Path(path)
    if not p.is_file():
        raise InferenceSetupError(f"{flag} {path!r} does not exist")
    stamp = _stamp(p, flag, columns)
    if stamp is not None and stamp.exists():
        return
    try:
        count = _read(p, path, flag, columns)
    except _Unreadable as e:
        raise InferenceSetupError(str(e)) from None
    except InferenceSetupError as e:  # the columns' lines: named for their file
        raise InferenceSetupError(f"{flag} {path!r}: {e}") from None
    if count == 0:
        raise InferenceSetupError(f"{flag} {path!r} holds no {what}; give at least one line")
    if stamp is not None:
        _write_stamp(stamp)


class _Unreadable(InferenceSetupError):
    """The line-by-line reading could not read the file as its kind (what `datasets` may still read)."""


def _read(p: Path, path: str, flag: str, columns: Columns | None) -> int:
    """The rows checked, read line by line, or, where that reading refuses the file, as `datasets` reads it."""
    try:
        return _check_rows(_rows(p, path, flag), columns)
    except _Unreadable:
        rows = _datasets_rows(path)
        if rows is None:
            raise
        return _check_rows(rows, _fresh(columns))


def _rows(p: Path, path: str, flag: str):
    lines = _lines(p, path, flag)
    return _csv_rows(lines, path, flag) if kind_of(path) == "csv" else _json_rows(lines, p, path, flag)


def _check_rows(rows, columns: Columns | None) -> int:
    count = 0
    for row in rows:
        count += 1
        if columns is not None:
            columns.row(row)
    if count and columns is not None:
        columns.end()
    return count


def _fresh(columns: Columns | None) -> Columns | None:
    """The same checks, from the first row again (the refused reading may have counted some): `settings` are each
    kind's constructor arguments."""
    return None if columns is None else type(columns)(columns.split, *columns.settings())


def _datasets_rows(path: str):
    """The file's rows as upstream's `load_dataset` reads them, or None where it cannot (nor where datasets is not
    installed: then the script's own load fails too). Only for a file the line-by-line reading refused, so the cost
    (importing datasets, its cache) falls on that case alone."""
    from ..extras import optional_import

    try:
        datasets = optional_import("datasets", "reading a data file as upstream's load_dataset does")
    except InferenceSetupError:
        return None
    datasets_logging = optional_import("datasets.utils.logging", "datasets' logging")

    log, level = logging.getLogger("datasets"), logging.getLogger("datasets").level
    bars = datasets_logging.is_progress_bar_enabled()
    log.setLevel(logging.CRITICAL + 1)  # its own error log and progress bars: the refusal, if it stands, says it
    datasets_logging.disable_progress_bar()
    try:
        return list(datasets.load_dataset(kind_of(path), data_files=path, split="train"))
    except Exception:  # noqa: BLE001 - datasets cannot read it either: the line-by-line refusal stands
        return None
    finally:
        log.setLevel(level)
        if bars:
            datasets_logging.enable_progress_bar()


def _lines(p: Path, path: str, flag: str):
    """The file's lines as text (line ends kept, a UTF-8 byte-order mark dropped, as datasets drops it), a byte that is
    not UTF-8 one line naming its line and offset."""
    offset = 0
    with p.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise _Unreadable(f"{flag} {path!r}: line {number} holds a byte that is not UTF-8 "
                                  f"({raw[e.start]:#04x} at byte {offset + e.start}); valid: a UTF-8 text file") from None
            offset += len(raw)


def _json_rows(lines, p: Path, path: str, flag: str):
    """JSON lines (one object a line, blank lines allowed), or one JSON document: an array of objects, or of strings
    (a `text` column), on one line (what `json.dump` writes) or many, as the json builder of `datasets` reads them."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            document = _whole_document(p) if number == 1 else None
            if document is not None:
                yield from document
                return
            raise _Unreadable(f"{flag} {path!r}: line {number} is not valid JSON ({e.msg} at column {e.colno}); "
                              "valid: one JSON object per line, or one JSON array of objects") from None
        if number == 1 and isinstance(row, list):
            rows = _records(row)
            if rows is None:
                raise _Unreadable(f"{flag} {path!r}: the JSON array holds neither objects nor strings; valid: one "
                                  "JSON object per line, or one JSON array of objects")
            yield from rows
            return
        if not isinstance(row, dict):
            raise _Unreadable(f"{flag} {path!r}: line {number} is a JSON {type(row).__name__}, not an object; "
                              "valid: one JSON object per line")
        yield row


def _records(document) -> list[dict] | None:
    """A JSON array as rows: its objects, or its strings as a `text` column (datasets' reading); None otherwise."""
    if isinstance(document, list) and all(isinstance(row, dict) for row in document):
        return document
    if isinstance(document, list) and all(isinstance(row, str) for row in document):
        return [{"text": row} for row in document]
    return None


def _whole_document(p: Path) -> list[dict] | None:
    try:
        document = json.loads(p.read_text(encoding="utf-8-sig"))
    except ValueError:  # UnicodeDecodeError too: the line-by-line reading names the line
        return None
    return _records(document)


def _csv_rows(lines, path: str, flag: str):
    rows = csv.reader(lines)
    try:
        header = next(rows, None)
        if header is None:
            return
        for row in rows:
            if not row:
                continue
            if len(row) != len(header):
                raise _Unreadable(f"{flag} {path!r}: line {rows.line_num} has {len(row)} fields, the header "
                                          f"{len(header)} ({', '.join(header)}); valid: one field per column")
            yield {k: (v if v != "" else None) for k, v in zip(header, row)}  # an empty field: None, as datasets reads it
    except csv.Error as e:
        raise _Unreadable(f"{flag} {path!r}: line {rows.line_num} is not valid CSV ({e})") from None


# A file that passed is not read again while it is unchanged (its path, size and modification time, and what was
# checked in it): every rank of every run reads it, and a resumed bulk predict once more. Measured 2026-12-05,
# 2 cores, 200,000 translation pairs (32 MB), medians of 5 (min-max): checked 0.45 s (0.45-0.46), ~14 s a GB on
# every rank, where datasets' cached load takes 0.01 s; unchanged, 0.0002 s. (A throwaway script timing
# `check_run_data` on a generated file, twice after removing the records.)
def _stamp(p: Path, flag: str, columns: Columns | None) -> Path | None:
    root = os.environ.get("DS_INFERENCE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ds-inference")
    try:
        stat = p.stat()
    except OSError:
        return None
    key = repr((str(p.resolve()), stat.st_size, stat.st_mtime_ns, flag, columns.rule if columns else None, STAMP_FORMAT))
    return Path(root) / "checked-data" / hashlib.sha256(key.encode()).hexdigest()


STAMP_FORMAT = 1  # raise when the checks change: every file is then checked again


def _write_stamp(stamp: Path) -> None:
    """Best effort: a cache directory that cannot be written only means the next run checks again."""
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError:
        pass


class Texts:
    """Counts the examples without a text in a column (a JSON null, an empty or non-string value) as rows go by;
    `check` is one line naming the first and the count."""

    def __init__(self, column: str, flag: str, split: str):
        self.column, self.flag, self.split = column, flag, split
        self.seen, self.bad, self.first = 0, 0, None

    def add(self, value) -> None:
        self.seen += 1
        if not isinstance(value, str) or not value.strip():
            self.bad += 1
            if self.first is None:
                self.first = (self.seen, value)

    def check(self) -> None:
        if self.bad:
            number, value = self.first
            shown = "null" if value is None else repr(value) if isinstance(value, str) else type(value).__name__
            raise InferenceSetupError(f"{self.bad} of {self.seen} {self.split} examples have an empty {self.column!r} "
                                      f"(the first: example {number}, {shown}; {self.flag}); valid: a text in every "
                                      "example")


class Columns:
    """What a run reads from each row of one split's file, checked row by row."""

    def __init__(self, split: str):
        self.split, self.count = split, 0

    @property
    def rule(self) -> tuple:
        """What is checked, for the record of a file that passed."""
        return type(self).__name__, self.split, *self.settings()

    def settings(self) -> tuple:
        return ()

    def row(self, row: dict) -> None:
        if self.count == 0:
            self.first(row)
        self.count += 1
        self.each(row)

    def first(self, row: dict) -> None: ...

    def each(self, row: dict) -> None: ...

    def end(self) -> None:
        """After the last row (`check_data_file` has refused a file without any)."""

    def _references(self, present: int, what: str, valid_all: str, valid_none: str) -> None:
        """Targets in every example, or (the test split) in none: predictions only, no score."""
        if self.split == "test" and present == 0:
            logger.info(f"the test data has no {what}: predictions only, no score")
        elif present != self.count:
            raise InferenceSetupError(
                f"{self.count - present} of {self.count} {self.split} examples have no {what}; valid: {valid_all}"
                f"{f' or {valid_none} (predictions only)' if self.split == 'test' else ''}")


class TranslationColumns(Columns):
    """upstream's run_translation.py: a `translation` column of {language: text}, the source language in every
    example, the target in every one (or, the test split, in none)."""

    def __init__(self, split: str, source_lang: str, target_lang: str):
        super().__init__(split)
        # mBART-style codes (en_XX) name the language `en` in the data, as upstream's script reads them
        self.source, self.target = source_lang.split("_")[0], target_lang.split("_")[0]
        self.texts = Texts(f"translation.{self.source}", f"--source_lang {self.source}", split)
        self.with_target = 0

    def settings(self) -> tuple:
        return self.source, self.target

    def first(self, row: dict) -> None:
        if "translation" not in row:
            raise InferenceSetupError(f"the {self.split} data has no 'translation' column; columns: {list(row)}")
        keys = sorted(row["translation"] or {})
        if self.source not in keys:
            raise InferenceSetupError(f"the {self.split} data has no language {self.source!r} in 'translation'; "
                                      f"languages there: {keys}")

    def each(self, row: dict) -> None:
        pair = row.get("translation") or {}
        self.texts.add(pair.get(self.source))
        self.with_target += self.target in pair

    def end(self) -> None:
        self.texts.check()
        self._references(self.with_target, f"{self.target!r} in 'translation'", "every example has it", "none")


class SummarizationColumns(Columns):
    """upstream's run_summarization.py: a text column and a summary column (by default its first two), a text in
    every example, a summary in every one (or, the test split, no summary column)."""

    def __init__(self, split: str, text_column: str | None, summary_column: str | None):
        super().__init__(split)
        self.text, self.summary, self.texts, self.summaries = text_column, summary_column, None, 0
        self.asked = text_column, summary_column

    def settings(self) -> tuple:
        return self.asked

    def first(self, row: dict) -> None:
        columns = list(row)
        self.text = self.text or columns[0]
        self.summary = self.summary or (columns[1] if len(columns) > 1 else None)
        for flag, column in (("--text_column", self.text), ("--summary_column", self.summary)):
            if column not in row and not (flag == "--summary_column" and self.split == "test"):
                raise InferenceSetupError(f"{flag} {column!r} is not a column of the {self.split} data; "
                                          f"columns: {', '.join(columns)}")
        self.texts = Texts(self.text, f"--text_column {self.text}", self.split)

    def each(self, row: dict) -> None:
        self.texts.add(row.get(self.text))
        self.summaries += row.get(self.summary) is not None

    def end(self) -> None:
        self.texts.check()
        self._references(self.summaries, repr(self.summary), "every example has one", "the column is absent")


def check_run_data(outputs) -> None:
    """The data files a script's parsed arguments name (upstream's `--{split}_file`s), each checked as a file (upstream's
    `load_dataset` reads them all) and, for the splits the run uses (`--do_train`, `--do_eval`, `--do_predict`) where
    the arguments say which columns it reads (translation's languages, summarization's columns), row by row, those
    first. A script loading a hub data set (`--dataset_name`) is left to `datasets`."""
    values = {}
    for output in outputs:
        if is_dataclass(output):
            for f in fields(output):
                values.setdefault(f.name, getattr(output, f.name))
    files = {split: values[name] for name, split in SPLIT_FILES.items() if values.get(name)}
    if not files or values.get("dataset_name"):
        return
    missing = next((split for split, path in files.items() if not Path(path).is_file()), None)
    if missing is not None:
        raise InferenceSetupError(f"--{missing}_file {files[missing]!r} does not exist")
    # upstream's scripts hand any other extension to datasets as its builder's name (parquet, arrow, ...): those
    # files are datasets' to read, and to report
    files = {split: path for split, path in files.items() if Path(path).suffix.lower() in KINDS}
    if len({kind_of(path) for path in files.values()}) > 1:
        raise InferenceSetupError(f"the data files mix kinds ({', '.join(files.values())}); valid: all json/jsonl "
                                  "or all csv")
    flags = {"train": "do_train", "validation": "do_eval", "test": "do_predict"}
    used = {split for split, flag in flags.items() if values.get(flag) or flag not in values}
    for split in sorted(files, key=lambda split: split not in used):
        columns = None
        if split in used and values.get("source_lang") and values.get("target_lang"):
            columns = TranslationColumns(split, values["source_lang"], values["target_lang"])
        elif split in used and "text_column" in values and "summary_column" in values:
            columns = SummarizationColumns(split, values["text_column"], values["summary_column"])
        check_data_file(files[split], f"--{split}_file", columns=columns)
