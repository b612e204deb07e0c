"""Linears whose output packs two equal halves the module reads apart (a policy's `packed`: ChatGLM's [gate | up],
OLMo's [x | gate], a cross-attention's [key | value]): each rank keeps its share of each half, the same share of
the half's rows DeepSpeed gives it of the row-parallel linear that reads them (equal, contiguous: the run's
`deepspeed_compat.even_grain`). DeepSpeed's own split cuts the whole output by rows, each rank getting a part of
one half only; it knows [gate | up] under the name `gate_up_proj` alone."""

from __future__ import annotations

from torch import nn

from ..errors import InferenceSetupError
from .attention import ColumnShard, take_rows

PARTS = 2


def split_packed(linear: nn.Module, tp_size: int, tp_rank: int, where: str) -> ColumnShard:
    """This rank's rows of each half of `linear` (at `where`, for the error line), as a `ColumnShard`."""
    size = linear.weight.shape[0]
    if size % (PARTS * tp_size):
        raise InferenceSetupError(f"{where} packs two halves of {size // PARTS} rows, which do not split into "
                                  f"--tp_size {tp_size} equal shares; valid: a tp size dividing {size // PARTS}, or "
                                  "keep it whole in a policy (replicated)")
    share, half = size // (PARTS * tp_size), size // PARTS
    rows = [p * half + tp_rank * share + i for p in range(PARTS) for i in range(share)]
    return take_rows(linear, rows)
