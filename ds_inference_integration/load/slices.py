"""Where the weights are split, and how that is recorded: one form, `TensorSlices`, on each split parameter
(`p.tensor_slices`).

Our own splits set it where they split (`shard/attention.py`'s head rows, `shard/inject.py`'s per-head parameters,
`shard/experts.py`, `shard/mixers.py`). DeepSpeed records its own splits in another form, an affine map on each
parameter it splits (`DS_AUTOTP_UC_META`, for its universal checkpoints); `from_deepspeed` converts it into this one
after `init_inference`, so that the loaders (`readers.py`) read every split parameter the same way, and the weight
share (`shard/weight_share.py`) reads what our splits chose from the same record."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InferenceSetupError


@dataclass(frozen=True)
class TensorSlices:
    """Of a full parameter of shape `full_shape`, this rank's part: along `dim`, the ranges it keeps, in order
    (concatenated); no ranges: this rank holds zeros (a bias added once per group, on its first rank)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full_shape: tuple[int, ...]

    def pieces(self) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """The part as blocks: (start in the full tensor, start in the part, block shape), in the part's order."""
        out, at = [], 0
        for a, b in self.ranges:
            source, dest, shape = [0] * len(self.full_shape), [0] * len(self.full_shape), list(self.full_shape)
            source[self.dim], dest[self.dim], shape[self.dim] = a, at, b - a
            out.append((tuple(source), tuple(dest), tuple(shape)))
            at += b - a
        return out


def record(p: torch.Tensor, dim: int, ranges, full_shape) -> None:
    """Record on `p` that it holds `ranges` along `dim` of a full tensor of shape `full_shape`."""
    p.tensor_slices = TensorSlices(dim, tuple((int(a), int(b)) for a, b in ranges), tuple(full_shape))


def ranges_of(indices: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5, 6] -> [(0, 3), (5, 7)]."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def recorded(p: torch.Tensor) -> TensorSlices | None:
    return getattr(p, "tensor_slices", None)


def take(t: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    """The `ranges` of `t` along `dim`, concatenated (meta tensors stay meta)."""
    return torch.cat([t.narrow(dim, s, e - s) for s, e in ranges], dim=dim).contiguous()


def from_deepspeed(name: str, p: torch.Tensor, full: tuple, rank: int) -> TensorSlices:
    """DeepSpeed's record of the part of `name` (full shape `full`) that rank `rank` holds, as a `TensorSlices`:
    its affine map lists blocks of the full tensor by flat offsets and strides; each block must be a run along one
    dimension (DeepSpeed's column- and row-parallel splits, its fused-QKV and 64-row-grain blocks are), else the
    loader cannot read it and says what would."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    want = tuple(p.shape)
    meta = getattr(p, DS_AUTOTP_UC_META, None) or {}
    amap = (meta.get("conversion") or {}).get("affine_map") or {}
    info = (amap.get("ranks") or {}).get(rank) or (amap.get("ranks") or {}).get(str(rank))
    if not info or tuple(amap.get("logical_shape", ())) != full or tuple(info["shard_shape"]) != want:
        raise InferenceSetupError(f"cannot tell which part of {name} ({list(full)} -> {list(want)}) this rank "
                                  "holds (DeepSpeed recorded no layout for it); use --loading full")
    dims, ranges, at = set(), [], 0
    for piece in info["pieces"]:
        shape = tuple(piece["shape"])
        (s_off, s_strides), (d_off, d_strides) = piece["source"], piece["dest"]
        if list(s_strides) != _row_major(full) or list(d_strides) != _row_major(want):
            raise InferenceSetupError(f"{name}: DeepSpeed's layout for this rank is strided in a way this loader "
                                      "does not read; use --loading full")
        if piece.get("scale", 1.0) != 1.0:  # a value DeepSpeed's layer holds pre-divided, not a slice of the file's
            raise InferenceSetupError(f"{name}: DeepSpeed holds this rank's part scaled by {piece['scale']}, which this "
                                      "loader does not read; use --loading full")
        source, dest = _unravel(s_off, full), _unravel(d_off, want)
        cut = [d for d in range(len(full)) if shape[d] != full[d]] or [0]
        if len(cut) > 1 or any(source[d] or dest[d] for d in range(len(full)) if d != cut[0]) or dest[cut[0]] != at:
            raise InferenceSetupError(f"{name}: DeepSpeed's layout for this rank is not a run of blocks along one "
                                      "dimension, which this loader reads; use --loading full")
        dims.add(cut[0])
        ranges.append((source[cut[0]], source[cut[0]] + shape[cut[0]]))
        at += shape[cut[0]]
    if len(dims) > 1:
        raise InferenceSetupError(f"{name}: DeepSpeed's layout for this rank cuts it along {len(dims)} dimensions, "
                                  "this loader reads a cut along one; use --loading full")
    slices = TensorSlices(dims.pop() if dims else 0, tuple(ranges), full)
    covered = sum(int(torch.Size(shape).numel()) for _, _, shape in slices.pieces())
    if covered != p.numel():
        raise InferenceSetupError(f"{name}: DeepSpeed's layout covers {covered} of {p.numel()} elements; "
                                  "use --loading full")
    return slices


def _unravel(offset: int, shape: tuple) -> tuple:
    at = []
    for n in reversed(shape):
        at.append(offset % n)
        offset //= n
    return tuple(reversed(at))


def _row_major(shape) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return list(reversed(strides))
