"""A request body from bytes to a checked JSON value, off the event loop: what any client may send, decoded so that
nothing in it can block the front, end it, or reach a rank as something it cannot compute.

- Size: the ASGI layer (`app.LimitBodies`) refuses a body over `--max_body_bytes` with 413 before it is decoded
  (at once from its Content-Length, else as soon as that many bytes arrived).
- Decoding runs in a worker thread, and never holds Python's lock for long: the C parser for small bodies, and for
  a body over `C_PARSER_BYTES` the standard library's pure-Python scanner, which lets the event loop in every few
  milliseconds. Measured (2 cores, 2026-12-05): the C parser held the lock 36 ms per MB of small integers and 69 ms
  per MB of empty lists (one call, the event loop waiting throughout); the Python scanner took 0.6 s per MB of
  integers but the longest wait it caused another thread was 6-15 ms. A 64 KB body costs the C parser under 5 ms.
- Values: text must be UTF-8 and its strings whole characters (a lone surrogate, which JSON's `\\ud800` escape can
  make, reached the tokenizer and was a 500); numbers must be finite (Python's parser reads `NaN`, `Infinity` and
  `1e999`, which are not JSON, and a NaN temperature passed every range check); nesting is bounded.

Every refusal is a ServeError with one line naming what is wrong and what would be valid."""

from __future__ import annotations

import json
import json.scanner
import math
import re

from .protocol import ServeError

C_PARSER_BYTES = 64 * 1024
MAX_DEPTH = 64  # arrays and objects inside each other; a request needs 4, a tool's JSON schema a dozen
# Arrays and objects (and bracket characters in its strings) a body may hold: a request needs one per prompt or
# message and a few more. Counted before it is parsed (two C calls, microseconds): 1.3 million empty lists in a
# 3.9 MB body cost a worker thread 2 s of parsing before they were refused, and the event loop, on a loaded machine,
# 184 ms for a /live answer meanwhile. A text with this many brackets would be some 25,000 tokens of them.
MAX_CONTAINERS = 100_000
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of a float's range")
    return value


def _decoder(pure_python: bool) -> json.JSONDecoder:
    decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
    if pure_python:
        decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder


_C_DECODER, _PY_DECODER = _decoder(False), _decoder(True)


def decode(raw: bytes):
    """The JSON value of a request body, checked (see the module's docstring); a ServeError (400) otherwise."""
    if not raw.strip():
        raise ServeError(400, "the body is empty; valid: a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ServeError(400, f"the body is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); valid: JSON "
                              "text in UTF-8") from None
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_CONTAINERS:
        raise ServeError(400, f"the body holds {containers} arrays, objects or brackets; valid: at most "
                              f"{MAX_CONTAINERS} (a request needs one per prompt or message)")
    decoder = _C_DECODER if len(raw) <= C_PARSER_BYTES else _PY_DECODER
    try:
        value = decoder.decode(text.lstrip("\ufeff"))
    except RecursionError:
        raise ServeError(400, f"the body nests arrays or objects too deeply; valid: at most {MAX_DEPTH} levels") \
            from None
    except ValueError as e:  # JSONDecodeError, and the number checks above
        raise ServeError(400, f"the body is not valid JSON ({' '.join(str(e).split())[:160]}); valid: a JSON object") \
            from None
    if containers > MAX_DEPTH or _SURROGATE_ESCAPE.search(raw):
        _check_values(value)  # only a body that could hold either needs the walk
    return value


def _check_values(value) -> None:
    """Nesting depth and lone surrogates, walked without recursion (the path of the first bad value in the
    message)."""
    stack = [(value, (), 1)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ServeError(400, f"the body nests arrays or objects more than {MAX_DEPTH} levels deep (at "
                                  f"{_where(path)}); valid: at most {MAX_DEPTH}", _where(path))
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, path)
                stack.append((child, (*path, key), depth + 1))
        elif isinstance(item, list):
            stack.extend((child, (*path, i), depth + 1) for i, child in enumerate(item))
        elif isinstance(item, str):
            _check_text(item, path)


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ServeError(400, f"{_where(path)}: a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start} "
                              "is not text; valid: whole characters (a JSON \\ud83d\\ude00 pair, or UTF-8)",
                         _where(path)) from None


def _where(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "body"


RELEASE_SLICE = 4096


def release(*values) -> None:
    """Empty the containers of a refused body (its decoded JSON, or the pydantic model holding it), a slice at a time.
    A million small lists dropped at once are freed in one C loop, or, held in a cycle by the error's traceback and
    asyncio's futures, walked by the collector in one go: either holds the event loop's lock (a 3.9 MB body of 1.3M
    lists kept /live waiting 176 ms under the full suite's load). Emptied here a slice at a time, the lock changes
    hands between slices, and nothing big is left for the collector."""
    stack = list(values)
    while stack:
        item = stack.pop()
        if hasattr(item, "__pydantic_fields__"):  # a request model: its fields and the unknown ones it kept
            stack.extend(vars(item).values())
            stack.extend((getattr(item, "model_extra", None) or {}).values())
        elif isinstance(item, dict):
            stack.extend(item.values())
            item.clear()
        elif isinstance(item, list):
            while item:
                piece = item[-RELEASE_SLICE:]
                del item[-RELEASE_SLICE:]
                stack.extend(child for child in piece if isinstance(child, (list, dict)) and child)
                del piece  # its items freed here, a slice's worth
