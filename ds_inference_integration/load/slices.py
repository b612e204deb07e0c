"""Which part of a full tensor a split parameter holds: the record shard-aware loading reads to convert only this
rank's part from the checkpoint, and the weight share reads as what the split chose (`shard/experts.py`, `shard/mixers.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSlices:
    """Of a full parameter of shape `full_shape`, this rank's part: along `dim`, the ranges it keeps, in order
    (concatenated); no ranges: this rank holds zeros (a bias added once per group, on its first rank)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full_shape: tuple[int, ...]


def take(t: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    """The `ranges` of `t` along `dim`, concatenated (meta tensors stay meta)."""
    return torch.cat([t.narrow(dim, s, e - s) for s, e in ranges], dim=dim).contiguous()
