"""A rank's heads: which query and key/value heads it holds (`HeadLayout`), the values its attention's attributes
take (`HeadLayout.local_values`), and which rows of a fused projection hold them (`fused_rows`, in each layout a
table names). Read by the derivation's probe (a split simulated before it is made) and by `shard/attention.py`
(the split made): one arithmetic for both."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InferenceSetupError
from .schema import FUSED_LAYOUTS


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
            "qkv_width": (self.local_q + 2 * self.local_kv) * head_dim,
        }


def _rows(heads: range, head_dim: int, offset: int = 0) -> list[int]:
    return [offset + h * head_dim + i for h in heads for i in range(head_dim)]


def fused_rows(layout: str, out: int, heads: HeadLayout) -> tuple[list[int], int]:
    """This rank's rows of a fused QKV projection of `out` rows, in its layout's order, and the head dim.

    `layout` "qkv": [Q | K | V] blocks (GPT-2, GPTBigCode multi-query, Falcon multi-query, ChatGLM);
    "per_head": [q k v] interleaved per head (GPTBigCode multi-head, GPT-NeoX, BLOOM);
    "grouped": [q_1 .. q_g k v] per key/value head, g = query heads per KV head (Falcon's new decoder
    architecture, InternLM2's `wqkv`): each rank keeps, for each of its KV heads, its own query heads of that group
    and the group's k and v, in the same layout.
    """
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
    return rows, head_dim


