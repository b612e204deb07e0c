"""Read parts of safetensors checkpoints, after safetensors itself has accepted every file.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte offsets)
and the raw row-major data. `SafetensorsCheckpoint` indexes one model directory (a single
`model.safetensors` or shards listed in `model.safetensors.index.json`):

* every file is opened with `safetensors.safe_open` first, the reader `from_pretrained` uses: a file
  it refuses (offsets that do not match shape x dtype, overlapping or outside the data, a truncated
  file, a header that is not JSON) is refused here too, in one line naming the file and the tensor;
* a whole tensor, or one contiguous run of rows, in the file's dtype is `get_slice(...)[a:b]`: a
  copy-on-write view of the mapped file, as `from_pretrained` gets;
* column selections (the input-feature shard of a row-parallel linear) and reads that change the
  dtype use positioned reads of only the selected bytes (through a bounded buffer when the dtype
  changes). Why not `get_slice` there too: its column slice is a strided view of the mapping, and
  copying it faults in every page of the whole tensor, which stays resident while the file is
  mapped; `ds-inference bench memory` measures both side by side (README, "Loading only your shard").
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InferenceSetupError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 16 * 2**20  # read buffer per call
SEGMENT_BYTES = 4096  # column runs at least this long are read alone, row by row

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
}

Ranges = list[tuple[int, int]]  # half-open [start, stop) intervals along one dimension


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where its data starts (call only on a file that
    `safe_open` accepted: this does not validate)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _what_is_wrong(path: Path) -> str:
    """For the error message: which tensor of a file that safetensors refused is at fault, as far as can be told."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return f"the file is {size} bytes, shorter than a header"
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                return f"the header claims {n} bytes, the file has {size - 8} after the length"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"the header is not valid JSON ({' '.join(str(e).split())[:80]})"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    data = size - 8 - n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            (a, b), dtype, shape = info["data_offsets"], info["dtype"], info["shape"]
        except (TypeError, KeyError, ValueError):
            return f"tensor {name!r} has no valid dtype, shape and data_offsets"
        if dtype not in DTYPES:
            return f"tensor {name!r} has dtype {dtype!r}; known: {', '.join(DTYPES)}"
        numel = 1
        for d in shape:
            numel *= d
        want = numel * DTYPES[dtype].itemsize
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b):
            return f"tensor {name!r} has data offsets {[a, b]}"
        if b - a != want:
            return f"tensor {name!r} ({dtype} {list(shape)}) needs {want} bytes, its data offsets {[a, b]} hold {b - a}"
        if b > data:
            return f"tensor {name!r} ends at byte {b} of the data, the file holds {data} (truncated?)"
        entries.append((a, b, name))
    entries.sort()
    at = 0
    for a, b, name in entries:
        if a != at:
            return f"tensor {name!r} starts at byte {a} of the data, the previous tensor ends at {at} (overlap or gap)"
        at = b
    if at != data:
        return f"the tensors cover {at} bytes of data, the file holds {data}"
    return "no tensor found at fault"


def open_safetensors(path: Path):
    """`safe_open(path)`, or one `InferenceSetupError` naming the file and what is wrong with it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise InferenceSetupError(f"{path} is not a valid safetensors file: {_what_is_wrong(Path(path))} "
                                  f"(safetensors: {' '.join(str(e).split())})") from None


def inside_dir(model_dir: Path, name: str, what: str) -> Path:
    """`model_dir / name`, refused unless it stays inside the model directory."""
    path = (model_dir / name).resolve()
    if os.path.isabs(name) or not path.is_relative_to(model_dir.resolve()):
        raise InferenceSetupError(f"{what} names {name!r}, which is outside the model directory {model_dir}")
    return model_dir / name


def checkpoint_files(model_dir: Path) -> list[Path] | None:
    """The safetensors files of a model directory, or None when it has none. Every file an index names must
    be inside the directory and exist."""
    model_dir = Path(model_dir)
    if (model_dir / SINGLE).is_file():  # from_pretrained's order: the single file first, then the index
        return [model_dir / SINGLE]
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InferenceSetupError(f"{index} is not a valid index (a JSON object with a weight_map): {e}") from None
        files = [inside_dir(model_dir, str(name), f"{index}") for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InferenceSetupError(f"{index} names {missing[0]!r}, which is not in {model_dir}")
        return files
    return None


class SafetensorsCheckpoint:
    """Name -> location of every tensor in a model directory's safetensors files."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.entries: dict[str, Entry] = {}
        self.metadata: dict[Path, dict] = {}
        self.bytes_read = 0
        self._handles: dict[Path, object] = {}
        for path in files:
            self._handles[path] = open_safetensors(path)  # safetensors validates the whole layout here
            header, start = read_header(path)
            self.metadata[path] = header.get("__metadata__") or {}
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in DTYPES:
                    raise InferenceSetupError(f"{path}: tensor {name} has dtype {info['dtype']}; known: {', '.join(DTYPES)}")
                if name in self.entries:
                    raise InferenceSetupError(f"{path}: tensor {name} is also in {self.entries[name].file}")
                a, b = info["data_offsets"]
                self.entries[name] = Entry(path, DTYPES[info["dtype"]], tuple(info["shape"]), start + a, b - a)

    @classmethod
    def open(cls, model_dir: Path) -> "SafetensorsCheckpoint | None":
        files = checkpoint_files(model_dir)
        return None if files is None else cls(files)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def read(self, name: str, rows: Ranges | None = None, cols: Ranges | None = None,
             dtype: torch.dtype | None = None, view: bool = False) -> torch.Tensor:
        """Rows `rows` (dim 0) and columns `cols` (dim 1) of tensor `name`, in `dtype`; None = all.

        Tensors of more than two dimensions are read as [dim 0, the rest] (then only `rows` may be given).
        With `view`, a selection that is one contiguous run of rows in the file's dtype is safetensors'
        copy-on-write view of the mapped file (as `from_pretrained` gets): nothing is copied, and only the
        pages of that range ever become resident, when first used.
        """
        e = self.entries[name]
        dtype = dtype or e.dtype
        shape = e.shape
        if cols is not None and len(shape) == 2 and list(cols) == [(0, shape[1])]:
            cols = None  # every column
        if view and dtype == e.dtype and cols is None and (rows is None or len(rows) == 1):
            a, b = rows[0] if rows else (0, shape[0] if shape else 0)
            if not shape or (a, b) == (0, shape[0]):
                t = self._handles[e.file].get_tensor(name)
            else:
                if not 0 <= a <= b <= shape[0]:
                    raise ValueError(f"{name}: rows [{a}, {b}) outside 0..{shape[0]}")
                t = self._handles[e.file].get_slice(name)[a:b]
            self.bytes_read += t.numel() * t.element_size()
            return t
        if len(shape) == 0:
            return self._read_bytes(e, 0, e.nbytes).view(e.dtype).reshape(()).to(dtype)
        n_rows = shape[0]
        row_len = 1
        for s in shape[1:]:
            row_len *= s
        if cols is not None and len(shape) != 2:
            raise ValueError(f"{name}: a column selection needs a 2-D tensor, not shape {list(shape)}")
        rows = rows if rows is not None else [(0, n_rows)]
        col_ranges = cols if cols is not None else [(0, row_len)]
        for a, b in rows:
            if not 0 <= a <= b <= n_rows:
                raise ValueError(f"{name}: rows [{a}, {b}) outside 0..{n_rows}")
        for a, b in col_ranges:
            if not 0 <= a <= b <= row_len:
                raise ValueError(f"{name}: columns [{a}, {b}) outside 0..{row_len}")
        out_rows = sum(b - a for a, b in rows)
        out_cols = sum(b - a for a, b in col_ranges)
        out = torch.empty(out_rows, out_cols, dtype=dtype)
        item = e.dtype.itemsize
        # Column runs of at least a page are read alone, row by row (only their bytes); shorter ones as whole rows.
        segments = cols is None or min((c1 - c0) * item for c0, c1 in col_ranges) >= SEGMENT_BYTES
        if out.numel() == 0:
            pass
        elif segments and dtype == e.dtype:  # straight into the result: no buffer, no copy
            with _File(e.file) as f:
                self._read_rows_into(f, e, rows, col_ranges, row_len, _bytes_of(out))
        else:  # through a bounded buffer, converted to `dtype` chunk by chunk
            width = out_cols if segments else row_len
            per_chunk = max(1, CHUNK_BYTES // max(1, width * item))
            pos = 0
            with _File(e.file) as f:
                for a, b in rows:
                    for start in range(a, b, per_chunk):
                        stop = min(b, start + per_chunk)
                        block = torch.empty(stop - start, width, dtype=e.dtype)
                        if segments:
                            self._read_rows_into(f, e, [(start, stop)], col_ranges, row_len, _bytes_of(block))
                        else:
                            self._read_rows_into(f, e, [(start, stop)], [(0, row_len)], row_len, _bytes_of(block))
                            block = torch.cat([block[:, c0:c1] for c0, c1 in col_ranges], dim=1)
                        out[pos:pos + stop - start].copy_(block)
                        pos += stop - start
        if cols is None and len(shape) != 2:
            out = out.view(out_rows, *shape[1:])
        return out

    def _read_rows_into(self, f: "_File", e: Entry, rows: Ranges, col_ranges: Ranges, row_len: int,
                        dest: memoryview) -> None:
        """Rows `rows`, columns `col_ranges`, packed into `dest` (bytes) in order: one positioned read per
        row range when whole rows are wanted, else one per row and column run."""
        item = e.dtype.itemsize
        at = 0
        for a, b in rows:
            if col_ranges == [(0, row_len)]:
                n = (b - a) * row_len * item
                f.read_into(dest[at:at + n], e.offset + a * row_len * item)
                at += n
                continue
            for r in range(a, b):
                for c0, c1 in col_ranges:
                    n = (c1 - c0) * item
                    f.read_into(dest[at:at + n], e.offset + (r * row_len + c0) * item)
                    at += n
        self.bytes_read += at

    def _read_bytes(self, e: Entry, offset: int, n: int) -> torch.Tensor:
        buf = bytearray(n)
        with open(e.file, "rb", buffering=0) as f:
            f.seek(e.offset + offset)
            got = f.readinto(buf)
        if got != n:
            raise ValueError(f"{e.file} is truncated: wanted {n} bytes at {e.offset + offset}, got {got}")
        self.bytes_read += n
        return torch.frombuffer(buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)


class _File:
    """A file descriptor for positioned reads into a buffer."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> "_File":
        self.fd = os.open(self.path, os.O_RDONLY)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def read_into(self, dest: memoryview, offset: int) -> None:
        done = 0
        while done < len(dest):  # one call reads at most ~2 GiB
            got = os.preadv(self.fd, [dest[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"{self.path} is truncated: wanted {len(dest)} bytes at {offset}")
            done += got


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
