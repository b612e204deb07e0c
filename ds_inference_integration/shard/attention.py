"""Attention projections that DeepSpeed 0.19.8 splits wrongly, split here instead.

Two cases, each a small named piece:

* fused QKV (GPT-2 `c_attn`, GPTBigCode `c_attn`, Falcon/NeoX `query_key_value`, Falcon's grouped one): this rank's query
  heads and their key/value heads are cut out and packed in the layout the attention forward expects;
* fewer key/value heads than ranks (multi-query and grouped-query attention): each rank keeps a copy
  of the KV head its query heads read (vLLM's `QKVParallelLinear` idea), instead of DeepSpeed's
  "trailing ranks get no heads".

The result is a `ColumnShard`, which is deliberately not an `nn.Linear`, so DeepSpeed leaves it alone.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..load.slices import ranges_of, record
from ..policy.head_layout import HeadLayout, _rows, fused_rows

__all__ = ["ColumnShard", "HeadLayout", "split_fused_qkv", "split_heads", "take_rows", "whole"]


class ColumnShard(nn.Module):
    """A linear layer holding only this rank's output rows (already split; never all-reduced)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, bias={self.bias is not None}"


def take_rows(linear: nn.Module, rows: list[int]) -> ColumnShard:
    index = torch.tensor(rows, dtype=torch.long, device=linear.weight.device)
    bias = getattr(linear, "bias", None)
    shard = ColumnShard(linear.weight.detach()[index], None if bias is None else bias.detach()[index])
    for part, source in ((shard.weight, linear.weight), (shard.bias, bias)):
        if part is not None:  # which rows of the full projection it holds (read by shard-aware loading)
            record(part, 0, ranges_of(rows), source.shape)
    return shard


def split_fused_qkv(linear: nn.Module, layout: str, heads: HeadLayout) -> tuple[ColumnShard, int]:
    """This rank's rows of a fused QKV linear (`policy.heads.fused_rows`: which rows, in the layout's order); returns
    the shard and the head dim."""
    rows, head_dim = fused_rows(layout, linear.weight.shape[0], heads)
    return take_rows(linear, rows), head_dim


def whole(linear: nn.Module) -> ColumnShard:
    """The linear unsplit, as a ColumnShard that DeepSpeed leaves alone (a module the policy replicates)."""
    return take_rows(linear, list(range(linear.weight.shape[0])))


def split_heads(linear: nn.Module, heads: range, n_heads: int) -> tuple[ColumnShard, int]:
    """Rows of the given heads of a separate Q, K or V projection with `n_heads` heads."""
    head_dim = linear.weight.shape[0] // n_heads
    return take_rows(linear, _rows(heads, head_dim)), head_dim
