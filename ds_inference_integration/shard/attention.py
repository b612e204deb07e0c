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

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import InferenceSetupError
from ..load.slices import ranges_of, record
from ..policy.schema import FUSED_LAYOUTS


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


@dataclass(frozen=True)
class HeadLayout:
    """How this rank's heads relate to the model's: query heads are split evenly; key/value heads
    are split when there are at least as many as ranks, else replicated."""

    query_heads: int
    kv_heads: int
    tp_size: int
    tp_rank: int
    own: bool = False  # a layer's own KV head count, not the configured one (`inject.layer_heads`)

    def __post_init__(self):
        q, kv, tp = self.query_heads, self.kv_heads, self.tp_size
        if q % tp:
            raise InferenceSetupError(f"{q} query heads do not divide by --tp_size {tp}")
        if q % kv or (kv % tp and tp % kv):
            raise InferenceSetupError(
                f"{kv} key/value heads fit neither --tp_size {tp} (divide or be divided by it) nor {q} query heads"
            )

    @property
    def local_q(self) -> int:
        return self.query_heads // self.tp_size

    @property
    def local_kv(self) -> int:
        return max(1, self.kv_heads // self.tp_size)

    @property
    def replicated(self) -> bool:
        return self.kv_heads < self.tp_size

    def q_heads(self) -> range:
        return range(self.tp_rank * self.local_q, (self.tp_rank + 1) * self.local_q)

    def kv_heads_of_rank(self) -> range:
        if self.replicated:  # ranks sharing one KV head hold a copy of it
            head = self.tp_rank // (self.tp_size // self.kv_heads)
            return range(head, head + 1)
        return range(self.tp_rank * self.local_kv, (self.tp_rank + 1) * self.local_kv)

    def local_values(self, head_dim: int) -> dict[str, int]:
        """Per-rank sizes a policy can write into attention attributes (`[attention.local]`)."""
        return {
            "q_heads": self.local_q, "kv_heads": self.local_kv, "q_width": self.local_q * head_dim,
            "kv_width": self.local_kv * head_dim, "q_per_kv": self.local_q // self.local_kv, "head_dim": head_dim,
        }


def _rows(heads: range, head_dim: int, offset: int = 0) -> list[int]:
    return [offset + h * head_dim + i for h in heads for i in range(head_dim)]


def take_rows(linear: nn.Module, rows: list[int]) -> ColumnShard:
    index = torch.tensor(rows, dtype=torch.long, device=linear.weight.device)
    bias = getattr(linear, "bias", None)
    shard = ColumnShard(linear.weight.detach()[index], None if bias is None else bias.detach()[index])
    for part, source in ((shard.weight, linear.weight), (shard.bias, bias)):
        if part is not None:  # which rows of the full projection it holds (read by shard-aware loading)
            record(part, 0, ranges_of(rows), source.shape)
    return shard


def split_fused_qkv(linear: nn.Module, layout: str, heads: HeadLayout) -> tuple[ColumnShard, int]:
    """This rank's rows of a fused QKV linear; returns the shard and the head dim.

    `layout` "qkv": [Q | K | V] blocks (GPT-2, GPTBigCode multi-query, Falcon multi-query);
    "per_head": [q k v] interleaved per head (GPTBigCode multi-head, GPT-NeoX, BLOOM);
    "grouped": [q_1 .. q_g k v] per key/value head, g = query heads per KV head (Falcon's new decoder
    architecture, transformers' `FalconAttention._split_heads`): each rank keeps, for each of its KV heads, its
    own query heads of that group and the group's k and v, in the same layout.
    """
    out = linear.weight.shape[0]
    if layout == "qkv":
        head_dim, rem = divmod(out, heads.query_heads + 2 * heads.kv_heads)
        q_size, kv_size = heads.query_heads * head_dim, heads.kv_heads * head_dim
        rows = (_rows(heads.q_heads(), head_dim)
                + _rows(heads.kv_heads_of_rank(), head_dim, q_size)
                + _rows(heads.kv_heads_of_rank(), head_dim, q_size + kv_size))
    elif layout == "grouped":
        per = heads.query_heads // heads.kv_heads
        head_dim, rem = divmod(out, heads.kv_heads * (per + 2))
        mine = set(heads.q_heads())
        rows = []
        for g in heads.kv_heads_of_rank():
            block = g * (per + 2) * head_dim
            rows += _rows([h - g * per for h in range(g * per, (g + 1) * per) if h in mine], head_dim, block)
            rows += _rows(range(per, per + 2), head_dim, block)  # the group's k and v
    elif layout == "per_head":
        if heads.kv_heads != heads.query_heads:
            raise InferenceSetupError("layout 'per_head' needs as many key/value heads as query heads")
        head_dim, rem = divmod(out, 3 * heads.query_heads)
        rows = _rows(heads.q_heads(), 3 * head_dim)
    else:
        raise InferenceSetupError(f"fused QKV layout {layout!r} is unknown; valid: {', '.join(FUSED_LAYOUTS)}")
    if rem:
        raise InferenceSetupError(f"fused QKV has {out} outputs, which does not fit {heads.query_heads} query "
                                  f"and {heads.kv_heads} key/value heads in layout {layout!r}")
    return take_rows(linear, rows), head_dim


def whole(linear: nn.Module) -> ColumnShard:
    """The linear unsplit, as a ColumnShard that DeepSpeed leaves alone (a module the policy replicates)."""
    return take_rows(linear, list(range(linear.weight.shape[0])))


def split_heads(linear: nn.Module, heads: range, n_heads: int) -> tuple[ColumnShard, int]:
    """Rows of the given heads of a separate Q, K or V projection with `n_heads` heads."""
    head_dim = linear.weight.shape[0] // n_heads
    return take_rows(linear, _rows(heads, head_dim)), head_dim
