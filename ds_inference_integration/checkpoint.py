"""Read parts of safetensors checkpoints without reading (or mapping) the rest.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte offsets)
and the raw row-major data. `SafetensorsCheckpoint` indexes one model directory (a single
`model.safetensors` or shards listed in `model.safetensors.index.json`) from the headers alone, and
`read` copies the selected rows/columns of one tensor straight into a tensor of the target dtype
with positioned reads (through a bounded buffer when the dtype changes), or, for one contiguous
range in the file's dtype, returns a copy-on-write view of the mapped file.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 16 * 2**20  # read buffer per call
SEGMENT_BYTES = 4096  # column runs at least this long are read alone, row by row

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
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
    """The JSON header of a safetensors file and the byte offset where its data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ValueError(f"{path} is not a safetensors file (header of {n} bytes)")
        return json.loads(f.read(n)), 8 + n


def checkpoint_files(model_dir: Path) -> list[Path] | None:
    """The safetensors files of a model directory, or None when it has none."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    if (model_dir / SINGLE).is_file():
        return [model_dir / SINGLE]
    return None


class SafetensorsCheckpoint:
    """Name -> location of every tensor in a model directory's safetensors files."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.entries: dict[str, Entry] = {}
        self.bytes_read = 0
        self._maps: dict[Path, mmap.mmap] = {}
        for path in files:
            header, start = read_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in DTYPES:
                    raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which this reader does not handle")
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
        With `view`, a selection that is one contiguous byte range in the file's dtype is returned as a
        copy-on-write view of the mapped file (as `from_pretrained` does): nothing is copied, and only
        the pages of that range ever become resident, when first used.
        """
        e = self.entries[name]
        dtype = dtype or e.dtype
        shape = e.shape
        if cols is not None and len(shape) == 2 and list(cols) == [(0, shape[1])]:
            cols = None  # every column
        if view and dtype == e.dtype and cols is None and len(shape) > 0 and (rows is None or len(rows) == 1):
            a, b = rows[0] if rows else (0, shape[0])
            row_bytes = e.nbytes // max(1, shape[0])
            offset = e.offset + a * row_bytes
            if offset % e.dtype.itemsize == 0 and b > a and row_bytes > 0:
                self.bytes_read += (b - a) * row_bytes
                flat = torch.frombuffer(self._map(e.file), dtype=e.dtype, offset=offset,
                                        count=(b - a) * row_bytes // e.dtype.itemsize)
                return flat.view(b - a, *shape[1:])
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

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[path]

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


def ranges_of(indices: list[int]) -> Ranges:
    """[0, 1, 2, 5, 6] -> [(0, 3), (5, 7)]."""
    out: Ranges = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def fingerprint(files: list[Path]) -> str:
    """sha256 over the contents of the files (in name order)."""
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(8 * 2**20):
                h.update(chunk)
    return h.hexdigest()
