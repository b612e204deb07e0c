"""A policy for a model type with no file in `policies/`, derived from the model and its config.

Three parts, each from the best source there is:

* row-parallel linears: transformers' own `base_model_tp_plan` first (maintained upstream for most decoders:
  its "rowwise" entries), validated against the module tree; the linears the plan does not name get DeepSpeed
  AutoTP's verdict (the linear before each norm, and `o_proj`/`out_proj`/`down_proj`-style names);
* the attention table, when DeepSpeed's own split would be wrong: a fused q/k/v projection (its layout from
  the projection's name and the config), or fewer key/value heads than query heads (grouped/multi-query
  attention, where at tp > KV heads each rank must keep a copy of its KV head);
* the attention module's per-rank attributes (`[attention.local]`): the head counts its own code reads, on
  itself or on its config (`self.config.num_attention_heads` in Phi-3).

An attention no rank can compute from its own heads is kept whole on every rank (`replicated`), with a warning
naming the module: a norm over the whole query projection (OLMo-2's `q_norm`) mixes every head. The rest of
the layer is still split.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from pathlib import Path

from torch import nn

from .deepspeed_compat import autotp_row_parallel, head_grain
from .errors import InferenceSetupError
from .experts import is_packed_experts
from .policy import AttentionSpec, Policy, is_linear, layer_classes, names_module

# Config attributes holding the query and key/value head counts, in the order they are looked for.
QUERY_HEAD_ATTRIBUTES = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
SEPARATE_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"))
FUSED_QKV = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack", "qkv")
# Attributes an attention module may read in forward, and the per-rank value each must then hold.
LOCAL_ATTRIBUTES = {
    "num_heads": "q_heads", "num_attention_heads": "q_heads", "n_head": "q_heads", "n_heads": "q_heads",
    "num_key_value_heads": "kv_heads", "num_kv_heads": "kv_heads", "n_kv_heads": "kv_heads",
    "num_key_value_groups": "q_per_kv", "num_kv_groups": "q_per_kv",
    "embed_dim": "q_width", "split_size": "q_width", "hidden_size": "q_width", "all_head_size": "q_width",
    "kv_heads": "kv_heads", "kv_dim": "kv_width",
}
logger = logging.getLogger(__name__)
CONFIG_LOCAL = ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head")


def _cannot_derive(model_type: str, why: str) -> InferenceSetupError:
    return InferenceSetupError(
        f"cannot derive a policy for model_type {model_type!r}: {why}; write one: "
        "`ds-inference policy suggest MODEL_DIR > my_policy.toml`, edit it, then --injection_policy my_policy.toml")


def _tp_plan_rows(model: nn.Module) -> dict[str, set[str]]:
    """{layer class name: {"row:PATH" or "column:PATH"}}: each linear (its path inside the layer) that the
    config's base_model_tp_plan names, and how it splits it (the AutoTP fallback then skips the named ones)."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    base = getattr(model, "base_model", model)
    found: dict[str, set[str]] = {}
    for pattern, style in plan.items():
        head, star, rest = pattern.partition(".*.")
        if not star:
            continue
        try:
            layers = base.get_submodule(head)
        except AttributeError:
            continue
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            continue
        layer = layers[0]
        try:
            target = layer.get_submodule(rest)
        except AttributeError:
            continue
        if not is_linear(target):
            continue  # a packed expert parameter or a norm: not a linear DeepSpeed splits
        kind = "row" if style.startswith("rowwise") or style == "local_rowwise" else "column"
        found.setdefault(type(layer).__name__, set()).add(f"{kind}:{rest}")
    return found


def _autotp_rows(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{layer class name: DeepSpeed AutoTP's row-parallel keys}, each key the linear's parent and own name
    ("self_attn.o_proj", "fc2"): one class can hold different modules in different places (T5's encoder and
    decoder blocks are both T5Block), and a policy name matches as a whole-component suffix."""
    return {cls.__name__: tuple(sorted(n.lstrip(".") for n in names)) for cls, names in autotp_row_parallel(model)}


def derive_row_parallel(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{layer class name: row-parallel linear paths}: the tp plan's row-wise entries, plus AutoTP's verdict on
    the linears the plan does not name."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    plan = _tp_plan_rows(model)
    autotp = _autotp_rows(model)
    classes = layer_classes(model)
    layers: dict[str, tuple[str, ...]] = {}
    for name in sorted(set(plan) | set(autotp)):
        if name not in classes:
            continue
        named = {e.split(":", 1)[1] for e in plan.get(name, ())}
        rows = {e.split(":", 1)[1] for e in plan.get(name, ()) if e.startswith("row:")}
        rows |= {k for k in autotp.get(name, ()) if not any(names_module(k, p) for p in named)}
        if rows:
            layers[name] = tuple(sorted(rows))
    if not layers and not derive_experts(model):
        raise _cannot_derive(model_type, "no row-parallel linear found (neither the config's base_model_tp_plan "
                                         "nor DeepSpeed AutoTP names one)")
    return layers


def _head_counts(config: object) -> tuple[str | None, str | int | None]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    query = next((a for a in QUERY_HEAD_ATTRIBUTES if isinstance(getattr(text, a, None), int)), None)
    kv = next((a for a in KV_HEAD_ATTRIBUTES if isinstance(getattr(text, a, None), int)), None)
    if getattr(text, "multi_query", False) is True and not getattr(text, "new_decoder_architecture", False):
        kv = 1  # Falcon-7B and GPTBigCode: one KV head, whatever num_kv_heads says (Falcon sets it to the query count)
    return query, kv


def _attention_modules(layer: nn.Module) -> list[tuple[str, nn.Module, str | None, tuple[str, str, str] | None]]:
    """(path, module, fused projection name, separate q/k/v names) of each attention module inside a layer."""
    found = []
    for path, module in layer.named_modules():
        children = {n: c for n, c in module.named_children()}
        fused = next((n for n in FUSED_QKV if n in children and is_linear(children[n])), None)
        separate = next((names for names in SEPARATE_QKV if all(n in children and is_linear(children[n])
                                                              for n in names)), None)
        if fused or separate:
            found.append((path, module, fused, separate))
    return found


# A forward that views the fused output as (..., heads, 3, head_dim) or (..., heads, 3 * head_dim): [q k v] per head.
_PER_HEAD_VIEW = re.compile(r"3\s*\*\s*self\.head_(dim|size)|,\s*3\s*,\s*self\.head_(dim|size)")


def _fused_layout(attention: nn.Module, config: object, q: int, kv: int) -> str:
    """The order of q, k and v rows in a fused projection, from the config and the attention's own code: [q_1 ..
    q_g k v] per KV head (Falcon's new decoder architecture), [Q | K | V] blocks with fewer KV heads than query
    heads (Falcon-7B, GPTBigCode multi-query, Phi-3), [q k v] per head where the forward views it so (GPT-NeoX,
    BLOOM, Persimmon, GPTBigCode multi-head), else [Q | K | V] (GPT-2's split, Phi-3's slices, MPT, Baichuan)."""
    if getattr(config, "new_decoder_architecture", False):
        return "grouped"
    if kv < q:
        return "qkv"
    return "per_head" if _PER_HEAD_VIEW.search(_class_source(type(attention))) else "qkv"


@functools.lru_cache(maxsize=None)
def _class_source(cls: type) -> str:
    """The class's own code ("" where Python has none to give), read once per class."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _source_names(cls: type) -> tuple[set[str], set[str]]:
    """Attributes (of the module, of its config) the class's own code reads."""
    source = _class_source(cls)
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


def _whole_projection_norms(attention: nn.Module, projections: list[nn.Module], head_dim: int) -> str | None:
    """A norm inside the attention whose width is a whole projection's (more than one head): it mixes heads."""
    widths = {p.weight.shape[0] for p in projections}
    for name, child in attention.named_children():
        weight = getattr(child, "weight", None)
        if "norm" in type(child).__name__.lower() and weight is not None and weight.ndim == 1:
            if weight.shape[0] in widths and weight.shape[0] != head_dim:
                return name
    return None


def derive_attention(model: nn.Module, layers: dict[str, tuple[str, ...]]
                     ) -> tuple[AttentionSpec | None, dict[str, tuple[str, ...]]]:
    """The attention table for a model with no policy file, or None where DeepSpeed's own split is right
    (separate q/k/v with as many key/value heads as query heads, or a fused layout only DeepSpeed knows); and
    {layer class: attention paths} to keep whole, where no rank can compute the attention from its own heads."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    q_attr, kv_attr = _head_counts(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if q_attr is None or head_grain(model_type) > 1:
        return None, {}  # no head count to split by, or a layout DeepSpeed keeps its own record of (CodeGen)
    q = getattr(text, q_attr)
    kv = kv_attr if isinstance(kv_attr, int) else getattr(text, kv_attr) if kv_attr else q
    classes = layer_classes(model)
    found = [(name, a) for name in layers if name in classes
             for a in _attention_modules(next(m for m in model.modules() if type(m) is classes[name]))]
    if not found:
        return None, {}
    specs, replicated = set(), {}
    for layer_name, (path, attention, fused, separate) in found:
        prefix = f"{path}." if path else ""
        projections = [attention.get_submodule(n) for n in ((fused,) if fused else separate)]
        norm = _whole_projection_norms(attention, projections, projections[0].weight.shape[0] // q)
        if norm:
            logger.warning("%s: %s.%s%s normalises a whole projection (%d features, %d heads): no rank can compute "
                           "it from its own heads, so that attention is kept whole on every rank", model_type,
                           layer_name, prefix, norm, projections[0].weight.shape[0], q)
            replicated.setdefault(layer_name, []).append(path)
            continue
        if not fused and kv == q:
            continue  # DeepSpeed's head-aware split of separate projections is right
        if fused:
            out = projections[0].weight.shape[0]
            head_dim = out // (q + 2 * kv)
        else:
            head_dim = projections[1].weight.shape[0] // kv
        local = _local_attributes(attention, q, kv, head_dim)
        kv_value = kv_attr if kv_attr is not None else q_attr  # no KV-head attribute: as many as query heads
        if fused:
            spec = AttentionSpec(query_heads=q_attr, kv_heads=kv_value, fused_qkv=prefix + fused,
                                 layout=_fused_layout(attention, text, q, kv), local=local)
        else:
            spec = AttentionSpec(query_heads=q_attr, kv_heads=kv_value, query=prefix + separate[0],
                                 key=prefix + separate[1], value=prefix + separate[2], local=local)
        specs.add(spec)
    if len(specs) > 1:
        paths = sorted(s.fused_qkv or s.key for s in specs)
        raise _cannot_derive(model_type, f"more than one attention to split here ({', '.join(paths)}); a policy "
                                         "holds one [attention] table")
    return (specs.pop() if specs else None), {k: tuple(v) for k, v in replicated.items()}


def derive_policy(model: nn.Module) -> Policy:
    """A complete policy for a model with no policy file: row-parallel linears and the attention table."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    layers = derive_row_parallel(model)
    attention, replicated = derive_attention(model, layers)
    # a row-parallel linear inside a module kept whole is not split either
    layers = {name: tuple(r for r in rows if not any(r == p or r.startswith(p + ".") for p in replicated.get(name, ())))
              for name, rows in layers.items()}
    q_attr, _ = _head_counts(model.config)
    heads = (q_attr,) if q_attr else ()
    return Policy(source=Path(f"<derived for {model_type}>"), description=f"derived from {type(model).__name__}",
                  model_types=(model_type,), head_count_attributes=heads, layers=layers, attention=attention,
                  replicated=replicated, experts=derive_experts(model))


def derive_experts(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{layer class: paths of its packed mixture-of-experts modules} (3-D gate_up_proj and down_proj)."""
    found: dict[str, tuple[str, ...]] = {}
    for name, cls in layer_classes(model).items():
        layer = next(m for m in model.modules() if type(m) is cls)
        paths = tuple(p for p, m in layer.named_modules() if p and is_packed_experts(m))
        if paths:
            found[name] = paths
    return found
