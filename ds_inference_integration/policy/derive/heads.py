"""Head counts: the config attributes that hold them, and the attributes an attention module reads that must hold
this rank's values once its heads are split (`[attention.local]`)."""

from __future__ import annotations

import re

from torch import nn

from ..configs import text_config
from ..schema import class_source

# Config attributes holding the query and key/value head counts, in the order they are looked for.
QUERY_HEAD_ATTRIBUTES = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
# Attributes an attention module may read in forward, and the per-rank value each must then hold.
LOCAL_ATTRIBUTES = {
    "num_heads": "q_heads", "num_attention_heads": "q_heads", "n_head": "q_heads", "n_heads": "q_heads",
    "num_key_value_heads": "kv_heads", "num_kv_heads": "kv_heads", "n_kv_heads": "kv_heads",
    "num_key_value_groups": "q_per_kv", "num_kv_groups": "q_per_kv",
    "embed_dim": "q_width", "split_size": "q_width", "hidden_size": "q_width", "all_head_size": "q_width",
    "kv_heads": "kv_heads", "kv_dim": "kv_width",
}
CONFIG_LOCAL = ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head")


def _head_counts(config: object) -> tuple[str | None, str | int | None]:
    text = text_config(config)
    query = next((a for a in QUERY_HEAD_ATTRIBUTES if isinstance(getattr(text, a, None), int)), None)
    kv = next((a for a in KV_HEAD_ATTRIBUTES if isinstance(getattr(text, a, None), int)), None)
    if getattr(text, "multi_query", False) is True and not getattr(text, "new_decoder_architecture", False):
        kv = 1  # Falcon-7B and GPTBigCode: one KV head, whatever num_kv_heads says (Falcon sets it to the query count)
    return query, kv


def head_values(config: object) -> tuple[int, int] | None:
    """(query heads, key/value heads) as the attributes `_head_counts` finds say; None without a query count."""
    q_attr, kv_attr = _head_counts(config)
    if q_attr is None:
        return None
    text = text_config(config)
    q = getattr(text, q_attr)
    return q, kv_attr if isinstance(kv_attr, int) else getattr(text, kv_attr) if kv_attr else q


def _source_names(cls: type) -> tuple[set[str], set[str]]:
    """Attributes (of the module, of its config) the class's own code reads."""
    source = class_source(cls)
    return set(re.findall(r"self\.(\w+)", source)), set(re.findall(r"self\.config\.(\w+)", source))


def _local_attributes(attention: nn.Module, q: int, kv: int, head_dim: int) -> tuple[tuple[str, str], ...]:
    read, read_on_config = _source_names(type(attention))
    full = {"q_heads": q, "kv_heads": kv, "q_per_kv": q // kv, "q_width": q * head_dim, "kv_width": kv * head_dim}
    local = []
    for attr, value in LOCAL_ATTRIBUTES.items():
        if attr in read and getattr(attention, attr, None) == full[value] and isinstance(getattr(attention, attr), int):
            local.append((attr, value))
    own_config = getattr(attention, "config", None)
    for attr in CONFIG_LOCAL:
        if attr in read_on_config and own_config is not None:
            value = "q_heads" if getattr(own_config, attr, None) == q else "kv_heads" if getattr(
                own_config, attr, None) == kv else None
            if value:
                local.append((f"config.{attr}", value))
    return tuple(local)
