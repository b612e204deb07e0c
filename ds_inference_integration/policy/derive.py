"""A policy for a model type with no file in `policies/`, derived from the model and its config.

Its parts, each from the best source there is:

* row-parallel linears: transformers' own `base_model_tp_plan` first (maintained upstream for most decoders:
  its "rowwise" entries), validated against the module tree; the linears the plan does not name get DeepSpeed
  AutoTP's verdict (the linear before each norm, and `o_proj`/`out_proj`/`down_proj`-style names);
* the attention table, when DeepSpeed's own split would be wrong: a fused q/k/v projection (its layout from
  the projection's name and the config), or fewer key/value heads than query heads (grouped/multi-query
  attention, where at tp > KV heads each rank must keep a copy of its KV head);
* the attention module's per-rank attributes (`[attention.local]`): the head counts its own code reads, on
  itself or on its config (`self.config.num_attention_heads` in Phi-3);
* the packed experts (`shard/experts.py`), and the state-space, linear-attention and convolution mixers split by their
  heads or channels (`shard/mixers.py`, recognised by their shapes).

An attention no rank can compute from its own heads is kept whole on every rank (`replicated`), with a warning
naming the module: a norm over the whole query projection (OLMo-2's `q_norm`) mixes every head. The rest of
the layer is still split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from pathlib import Path

import torch
from torch import nn

from ..deepspeed_compat import autotp_keeps_whole, autotp_row_parallel, head_grain
from ..errors import InferenceSetupError
from .configs import text_config
from .kinds import (
    experts_in_two_modules,
    is_experts,
    is_packed_experts,
    is_router,
    is_ssm_mixer,
    is_ungated_experts,
    row_packed_experts,
)
from .layers import layer_kinds
from .schema import (
    DERIVE,
    AttentionSpec,
    Policy,
    class_source,
    is_linear,
    layer_classes,
    names_module,
    outermost_layer_classes,
    reading_configured_values,
    under_replicated,
)

# Config attributes holding the query and key/value head counts, in the order they are looked for.
QUERY_HEAD_ATTRIBUTES = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
SEPARATE_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"),
                ("project_q", "project_k", "project_v"))  # the last: CPM-Ant (BMTrain's names)
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


# a derived policy's `source`: it has no file
DERIVED = "<derived for {}>"


def is_derived(policy) -> bool:
    """Whether `policy` (a Policy, or None for autotp) was derived from the model, not read from a file."""
    return policy is not None and str(policy.source).startswith(DERIVED.partition("{")[0])


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
        for layer in layers:  # every layer: a dense-first MoE's first layers hold `mlp.down_proj`, the rest not
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


def _chain_rows(model: nn.Module) -> dict[str, dict[str, list[str]]]:
    """{layer class: {path of a linear that ends an MLP chain: its module's linears}}, where neither the plan nor AutoTP
    names a row-parallel linear by its conventions: of a child module's linears, the one that reads what every
    other one writes and writes what they read (LFM2's `w2` after `w1` and `w3`; AutoTP knows `w2` only in
    Mixtral). Modules with a convolution are mixers, kept whole instead (`_whole_reason`)."""
    found: dict[str, dict[str, list[str]]] = {}
    outermost = outermost_layer_classes(model)
    text = text_config(model.config)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "d_model", None)
    for name, kinds in layer_kinds(model).items():
        if name not in outermost:
            continue
        for layer in kinds:
            units = list(layer.named_children())
            for path, child in list(units):
                unpacked = _unpacked_experts(child)
                if unpacked:  # each expert its own MLP chain (its fc2), the router apart
                    units += [(f"{path}.{p}", e) for p, e in unpacked[1]]
            for path, child in units:
                linears = _linears(child)
                if len(linears) < 2 or any(isinstance(m, nn.Conv1d) for m in child.modules()):
                    continue
                if _unpacked_experts(child):
                    continue
                ends = [q for q, m in linears.items()
                        if all(o.weight.shape == m.weight.shape[::-1] for p, o in linears.items() if p != q)]
                if len(ends) == 2:  # fc1 and fc2 alone mirror each other: the end writes the model's width
                    ends = [q for q in ends if linears[q].weight.shape[0] == hidden]
                if len(ends) == 1:  # else (two square linears) either could end it, so neither is guessed
                    found.setdefault(name, {})[f"{path}.{ends[0]}"] = [f"{path}.{q}" for q in linears]
    return found


def derive_row_parallel(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{layer class name: row-parallel linear paths}: the tp plan's row-wise entries, plus AutoTP's verdict on
    the linears the plan does not name, plus the end of each MLP chain neither names (`_chain_rows`)."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    plan = _tp_plan_rows(model)
    autotp = _autotp_rows(model)
    for name, ends in _chain_rows(model).items():
        known = {e.split(":", 1)[1] for e in plan.get(name, ()) if e.startswith("row:")} | set(autotp.get(name, ()))
        extra = [end for end, linears in ends.items()  # only where no linear of that module is row-parallel yet
                 if not any("down_proj" in lp or names_module(k, lp) for k in known for lp in linears)]
        if extra:
            autotp[name] = tuple(sorted({*autotp.get(name, ()), *extra}))
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
                                         f"nor DeepSpeed AutoTP names one){_what_the_layers_hold(model)}")
    return layers


def _what_the_layers_hold(model: nn.Module) -> str:
    """What a policy would be written from, for the refusal's line: each outermost layer class with its linears and
    the modules holding weights that are not linears (JetMoE's `JetMoeParallelExperts`, its attention's and MLP's
    experts as [experts, out, in] parameters, which no rule here splits)."""
    kinds = layer_kinds(model)
    parts = []
    for name in sorted(outermost_layer_classes(model) & set(kinds)):
        layer = kinds[name][0]
        linears = sorted(_linears(layer))
        other = sorted({type(m).__name__ for _, m in layer.named_modules() if not is_linear(m)
                        and any(p.ndim >= 2 for p in m.parameters(recurse=False))})
        held = [f"linears {', '.join(linears)}" if linears else "no linear"]
        if other:
            held.append(f"weights in {', '.join(other)} (not linears: neither DeepSpeed nor a policy splits those)")
        parts.append(f"{name}: {'; '.join(held)}")
    return f"; its layers hold {' / '.join(parts)}" if parts else ""


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


def _attention_modules(layer: nn.Module) -> list[tuple[str, nn.Module, str | None, tuple[str, str, str] | None]]:
    """(path, module, fused projection name, separate q/k/v names) of each attention module inside a layer."""
    found = []
    for path, module in layer.named_modules():
        children = {n: c for n, c in module.named_children()}
        fused = next((n for n in FUSED_QKV if n in children and is_linear(children[n])), None)
        separate = _separate_qkv(module, children)
        if fused or separate:
            found.append((path, module, fused, separate))
    return found


# An attention whose query projection holds [query | gate] per head, as its forward views it (Qwen3-Next:
# `q_proj(x).view(..., -1, self.head_dim * 2)`; MiniCPM5-MoE: `(*input_shape, -1, 2 * self.head_dim)` of its
# `q_gate_proj`): a split by whole heads keeps each head's gate with it.
_PER_HEAD_GATE = re.compile(r"-1,\s*(self\.head_dim\s*\*\s*2|2\s*\*\s*self\.head_dim)\s*\)")
_GATED_QUERY = re.compile(r"q_\w+_proj")  # a query projection named for what it packs besides (`q_gate_proj`)


def _separate_qkv(module: nn.Module, children: dict[str, nn.Module]) -> tuple[str, str, str] | None:
    """The names of a module's separate query, key and value projections, or None: one of `SEPARATE_QKV`, or k_proj
    and v_proj beside a query that packs a per-head gate under another name (MiniCPM5-MoE's `q_gate_proj`: not
    recognised, its attention was kept whole on every rank, 64% of the layer per rank at tp 2, 2026-12-06)."""
    names = next((names for names in SEPARATE_QKV if all(n in children and is_linear(children[n]) for n in names)),
                 None)
    if names is None:  # the key is the value: the attribute there and None (Gemma 4's full-attention layers with
        # `attention_k_eq_v`); kept whole in every layer of the class, 72% per rank at tp 2 (2026-12-06)
        names = next((names for names in SEPARATE_QKV if all(n in children and is_linear(children[n])
                                                            for n in names[:2]) and _value_is_key(module, names[2])),
                     None)
    if names or not all(n in children and is_linear(children[n]) for n in ("k_proj", "v_proj")):
        return names
    queries = [n for n, c in children.items() if _GATED_QUERY.fullmatch(n) and is_linear(c)]
    return (queries[0], "k_proj", "v_proj") if len(queries) == 1 and _gated_per_head(module) else None


def _own_kv_heads(attention: nn.Module, separate) -> int | None:
    """The key/value heads an attention's key projection holds, in its own `head_dim`; None where it does not say.
    Gemma 4's full-attention layers hold 2 where the config (and its sliding layers) say 4: left to DeepSpeed's
    split by the config's count, at tp 4 each rank held half a head ("shape '[3, 10, -1, 64]' is invalid",
    2026-12-06); a table splits them by the layer's own count (`shard.inject.layer_heads`)."""
    head_dim = getattr(attention, "head_dim", None)
    key = getattr(attention, separate[1], None) if separate else None
    if not isinstance(head_dim, int) or head_dim <= 0 or key is None or key.weight.shape[0] % head_dim:
        return None
    return key.weight.shape[0] // head_dim


def _value_is_key(module: nn.Module, value: str) -> bool:
    """The module has no value projection of its own (the attribute set to None) and its code takes the key's
    states for the values where it is None."""
    return (value in vars(module) and vars(module)[value] is None
            and bool(re.search(rf"self\.{value}\s+is\s+not\s+None\s+else\s+key_states", class_source(type(module)))))


def _projections(attention: nn.Module, names) -> list[nn.Module]:
    """The attention's projections by name, but a value projection that is None (`_value_is_key`)."""
    return [m for m in (getattr(attention, n, None) if "." not in n else attention.get_submodule(n) for n in names)
            if m is not None]


def _gated_per_head(attention: nn.Module) -> bool:
    return bool(_PER_HEAD_GATE.search(class_source(type(attention))))
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
    return "per_head" if _PER_HEAD_VIEW.search(class_source(type(attention))) else "qkv"


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


# A module that builds its attention child again from its config at run time (BigBird's `set_attention_type`, which
# its model calls for an input too short for block-sparse attention: `BigBirdSelfAttention(self.config, ...)`): the
# new attention has the model's head counts around a rank's split projections, "shape '[3, 10, 128]' is invalid for
# input of size 1920" at tp 2 (`policy sweep`, 2026-12-06).
_REBUILT_FROM_CONFIG = re.compile(r"=\s*\w*Attention\(\s*self\.config\b")


def _rebuilt_while_running(owner: nn.Module) -> bool:
    """Whether `owner` may build its attention again while the model runs (`_REBUILT_FROM_CONFIG`): BigBird switches
    only from block-sparse attention to full, so one built with full attention (`attention_type`) keeps its own."""
    return (bool(_REBUILT_FROM_CONFIG.search(class_source(type(owner))))
            and getattr(owner, "attention_type", None) != "original_full")


# A forward that cuts the states in two along the head axis and pairs the halves (DiffLlama's `torch.chunk(value_states,
# 2, dim=1)`): the head split gave each rank one half (logits 9.8 off at tp 2, `policy sweep`, 2026-12-06)
_HEAD_AXIS_SPLIT = re.compile(r"chunk\(\s*\w*(query|key|value)_states\w*\s*,\s*2\s*,\s*dim\s*=\s*1\s*\)")


def _reshaped_to_input_width(attention: nn.Module) -> bool:
    """The attention's forward takes its width from its input (`bsz, tgt_len, embed_dim = hidden_states.size()`) and
    reshapes its heads' output to it (`attn_output.reshape(bsz, tgt_len, embed_dim)`): TrOCR's. A rank holding half
    the heads has half that many features ("shape '[3, 10, 128]' is invalid for input of size 1920" at tp 2,
    `policy sweep`, 2026-12-06); no attribute set per rank changes a width read from the input."""
    source = class_source(type(attention))
    for names in re.findall(r"(\w+)\s*,\s*(\w+)\s*,\s*(\w+)\s*=\s*hidden_states\.(?:size\(\)|shape)", source):
        if re.search(r"\.reshape\(\s*" + r"\s*,\s*".join(names) + r"\s*\)", source):
            return True
    return False


def _per_head_outside_layers(model: nn.Module, layers: dict[str, tuple[str, ...]], q: int, kv: int) -> str | None:
    """A parameter outside the layers with one column per head, made into a per-head input of every layer (CPM-Ant's
    `position_bias.relative_attention_bias`, [buckets, heads]: the bias of all heads reached attentions holding
    some, "(2) must match ... (4)" at tp 2, `policy sweep` 2026-12-06). T5's is inside its first layer, where
    DeepSpeed splits it with the heads. A linear's or convolution's weight is not one: its second dimension is what
    it reads (VibeVoice-ASR's audio tokenizer, whose first stage reads 4 channels at the sweep's size, kept a
    Qwen2 decoder's attention whole on every rank, 70% per rank at tp 2)."""
    inside = {id(m) for list_ in model.modules() if isinstance(list_, nn.ModuleList)
              for layer in list_ if type(layer).__name__ in layers for m in layer.modules()}
    hidden = getattr(text_config(model.config), "hidden_size", None)
    for name, module in model.named_modules():
        if id(module) in inside or isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.ndim == 2 and param.shape[1] in {q, kv} - {1, hidden} and "embed" not in f"{name}.{pname}":
                return f"{name}.{pname}"
    return None


def _row_parallel_per_head(attention: nn.Module, path: str, rows: tuple[str, ...], q: int, kv: int) -> str | None:
    """A row-parallel linear inside the attention that writes one value per (query or key/value) head: Doge's
    `dt_proj` (every value head's features -> one step size per head, "rowwise" in its tp plan) gave each rank all
    heads' values beside its own heads' scores, "(2) must match ... (4)" at tp 2 (`policy sweep`, 2026-12-06)."""
    for name, module in attention.named_modules():
        where = f"{path}.{name}" if path else name
        if (name and isinstance(module, nn.Linear) and module.out_features in {q, kv} - {1}
                and any(names_module(r, where) for r in rows)):
            return name
    return None


def _whole_projection_norms(attention: nn.Module, projections: list[nn.Module], head_dim: int) -> str | None:
    """A norm inside the attention whose width is a whole projection's (more than one head): it mixes heads."""
    widths = {p.weight.shape[0] for p in projections}
    for name, child in attention.named_children():
        weight = getattr(child, "weight", None)
        if "norm" in type(child).__name__.lower() and weight is not None and weight.ndim == 1:
            if weight.shape[0] in widths and weight.shape[0] != head_dim:
                return name
    return None


def derive_attention(model: nn.Module, layers: dict[str, tuple[str, ...]], skip: dict[str, set[str]] | None = None
                     ) -> tuple[AttentionSpec | None, dict[str, tuple[str, ...]]]:
    """The attention table for a model with no policy file, or None where DeepSpeed's own split is right
    (separate q/k/v with as many key/value heads as query heads, or a fused layout only DeepSpeed knows); and
    {layer class: attention paths} to keep whole, where no rank can compute the attention from its own heads."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    q_attr, kv_attr = _head_counts(config)
    text = text_config(config)
    if q_attr is None or head_grain(model_type) > 1:
        return None, {}  # no head count to split by, or a layout DeepSpeed keeps its own record of (CodeGen)
    q, kv = head_values(config)
    kinds = layer_kinds(model)
    by_path: dict[tuple[str, str], tuple] = {}  # one per attention path of each layer class, over its kinds
    rebuilt: dict[str, dict[str, str]] = {}  # {layer class: {path: class}} of attentions rebuilt while running
    own_kv: dict[tuple[str, str], set[int]] = {}  # the key/value head counts each kind's attention there holds
    for name in layers:
        for layer in kinds.get(name, ()):
            for a in _attention_modules(layer):
                if any(under_replicated(p, layer, a[0]) for p in (skip or {}).get(name, ())):
                    continue  # inside a module kept whole
                owner = a[0].rpartition(".")[0]
                if "." in a[0] and _rebuilt_while_running(layer.get_submodule(owner)):
                    rebuilt.setdefault(name, {})[owner] = type(layer.get_submodule(owner)).__name__
                    continue
                by_path.setdefault((name, a[0]), a)
                own_kv.setdefault((name, a[0]), set()).add(_own_kv_heads(a[1], a[3]))
    for name, owners in rebuilt.items():
        for owner, cls in owners.items():
            logger.warning("%s: %s.%s (%s) builds its attention again from the config while it runs (with the "
                           "model's head counts, not a rank's), so that attention is kept whole on every rank",
                           model_type, name, owner, cls)
    replicated: dict[str, list[str]] = {name: list(owners) for name, owners in sorted(rebuilt.items())}
    found = [(name, a) for (name, _), a in by_path.items()]
    if not found:
        return None, {name: tuple(paths) for name, paths in replicated.items()}
    outside = _per_head_outside_layers(model, layers, q, kv)
    if outside:
        logger.warning("%s: %s holds one column per head outside the layers (a bias every layer's attention adds, "
                       "made for all heads): no rank can use it with some of the heads, so the attention is kept "
                       "whole on every rank", model_type, outside)
        for name, (path, *_) in found:
            replicated.setdefault(name, []).append(path)
        return None, {name: tuple(dict.fromkeys(paths)) for name, paths in sorted(replicated.items())}
    specs: dict[AttentionSpec, list[tuple[str, str]]] = {}
    for layer_name, (path, attention, fused, separate) in found:
        prefix = f"{path}." if path else ""
        projections = _projections(attention, (fused,) if fused else separate)
        if _reshaped_to_input_width(attention):
            logger.warning("%s: %s.%s reshapes its output to its input's width, read from the input itself: a rank "
                           "holding some of its heads cannot compute it, so that attention is kept whole on every "
                           "rank", model_type, layer_name, path)
            replicated.setdefault(layer_name, []).append(path)
            continue
        if _HEAD_AXIS_SPLIT.search(class_source(type(attention))):
            logger.warning("%s: %s.%s pairs its heads across the head axis (differential attention: one half of the "
                           "value heads with the other): no rank can compute it from its own heads, so that attention "
                           "is kept whole on every rank", model_type, layer_name, path)
            replicated.setdefault(layer_name, []).append(path)
            continue
        tables = [n for n, t in attention._parameters.items() if isinstance(t, torch.Tensor) and t.ndim >= 2
                  and t.shape[0] in {q, kv} - {1}]
        if tables:
            logger.warning("%s: %s.%s%s holds one row per head ([heads, ...], a relative-position attention's bias): "
                           "no rank can use it with some of the heads, so that attention is kept whole on every rank",
                           model_type, layer_name, prefix, tables[0])
            replicated.setdefault(layer_name, []).append(path)
            continue
        scales = _feature_scales(attention, {m.weight.shape[0] for m in projections} - {q, kv})
        if scales:  # (one value per head, attention sinks, is split with the heads below)
            logger.warning("%s: %s.%s%s scales each of the %d features of a projection, a parameter neither "
                           "DeepSpeed nor a table splits with the heads: so that attention is kept whole on every rank",
                           model_type, layer_name, prefix, scales[0], attention._parameters[scales[0]].shape[0])
            replicated.setdefault(layer_name, []).append(path)
            continue
        mixing = _row_parallel_per_head(attention, path, layers.get(layer_name, ()), q, kv)
        if mixing:
            logger.warning("%s: %s.%s%s writes one value per head from every head's features, row-parallel (all-reduced "
                           "over the ranks): a rank holding some of the heads gets every head's values, so that "
                           "attention is kept whole on every rank", model_type, layer_name, prefix, mixing)
            replicated.setdefault(layer_name, []).append(path)
            continue
        norm = _whole_projection_norms(attention, projections, projections[0].weight.shape[0] // q)
        if norm:
            logger.warning("%s: %s.%s%s normalises a whole projection (%d features, %d heads): no rank can compute "
                           "it from its own heads, so that attention is kept whole on every rank", model_type,
                           layer_name, prefix, norm, projections[0].weight.shape[0], q)
            replicated.setdefault(layer_name, []).append(path)
            continue
        own_dim = getattr(attention, "head_dim", None)
        if not fused and isinstance(own_dim, int) and own_dim > 0:
            gated = 2 if _gated_per_head(attention) else 1  # [query | gate] per head
            mine = (projections[0].weight.shape[0] // (own_dim * gated), projections[1].weight.shape[0] // own_dim)
            if mine != (q, kv):  # Moonshine's encoder reads encoder_num_attention_heads, not the config's count
                logger.warning("%s: %s.%s has %d query and %d key/value heads, not the config's %s = %d and %s = %d: "
                               "no table describes it, so that attention is kept whole on every rank", model_type,
                               layer_name, path, *mine, q_attr, q, kv_attr or q_attr, kv)
                replicated.setdefault(layer_name, []).append(path)
                continue
        if fused:
            out = projections[0].weight.shape[0]
            head_dim = out // (q + 2 * kv)
        else:
            head_dim = projections[1].weight.shape[0] // kv
        local = _local_attributes(attention, q, kv, head_dim)
        per_layer = own_kv.get((layer_name, path), set()) - {None, kv}  # a kind with a KV count of its own
        # a parameter of the attention itself with one value per query head (attention sinks) is split with the
        # heads only where a table names the attention (`shard.inject.split_per_head_parameters`): GraniteMoE-SWA's
        # `sinks`, left whole under DeepSpeed's split, "(2) must match ... (4)" at tp 2 (`policy sweep`, 2026-12-06)
        per_head = any(isinstance(p, torch.Tensor) and p.ndim == 1 and p.shape[0] == q
                       for p in attention._parameters.values())
        if (not fused and kv == q and not per_layer and not per_head
                and not any(attr.startswith("config.") for attr, _ in local)):
            continue  # DeepSpeed's head-aware split of separate projections is right, and updates the module's
            # own head counts; a count read from the config (Moonshine views q by config.num_key_value_heads)
            # must be made this rank's by the table
        kv_value = kv_attr if kv_attr is not None else q_attr  # no KV-head attribute: as many as query heads
        if fused:
            spec = AttentionSpec(query_heads=q_attr, kv_heads=kv_value, fused_qkv=prefix + fused,
                                 layout=_fused_layout(attention, text, q, kv), local=local)
        else:
            spec = AttentionSpec(query_heads=q_attr, kv_heads=kv_value, query=prefix + separate[0],
                                 key=prefix + separate[1], value=prefix + separate[2], local=local)
        specs.setdefault(spec, []).append((layer_name, path))
    # Tables that differ only in which attention module they name (T5Gemma's and Moonshine's cross attention
    # beside their self attention) are one table with `also`. A policy holds one table: the one most attentions
    # use is split by it; an attention needing another (other head counts, another layout) is kept whole, with a
    # warning, rather than the model refused. (Several tables per policy: not built yet.)
    def relative(spec: AttentionSpec) -> AttentionSpec:
        names = [None if n is None else n.rpartition(".")[2] for n in (spec.fused_qkv, spec.query, spec.key, spec.value)]
        return dataclasses.replace(spec, fused_qkv=names[0], query=names[1], key=names[2], value=names[3])

    def module_of(spec: AttentionSpec) -> str:
        return (spec.fused_qkv or spec.key).rpartition(".")[0]

    groups: dict[AttentionSpec, list[AttentionSpec]] = {}
    for spec in specs:
        groups.setdefault(relative(spec), []).append(spec)
    merged: dict[AttentionSpec, list[tuple[str, str]]] = {}
    for members in groups.values():
        members.sort(key=lambda sp: (-len(specs[sp]), module_of(sp)))
        if len(members) > 1 and all(module_of(sp) for sp in members):
            first = dataclasses.replace(members[0], also=tuple(module_of(sp) for sp in members[1:]))
            merged[first] = [place for sp in members for place in specs[sp]]
        else:
            merged.update((sp, specs[sp]) for sp in members)
    specs = merged
    chosen = max(specs, key=lambda sp: len(specs[sp]), default=None)
    for spec, places in specs.items():
        if spec is not chosen:
            for layer_name, path in places:
                logger.warning("%s: %s.%s needs a second attention table (%s), which a policy cannot hold yet: that "
                               "attention is kept whole on every rank", model_type, layer_name, path,
                               spec.fused_qkv or spec.key)
                replicated.setdefault(layer_name, []).append(path)
    return chosen, {k: tuple(dict.fromkeys(v)) for k, v in replicated.items()}


def _linears(module: nn.Module) -> dict[str, nn.Module]:
    return {p: m for p, m in module.named_modules() if p and is_linear(m)}


def _unpacked_experts(module: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """(path, [(path, expert)]) of a list of experts held as modules (NLLB-MoE's `experts.expert_0` ...,
    several modules of one class holding linears), inside a block, else None."""
    for path, m in module.named_modules():
        if path and "expert" in path.rpartition(".")[2] and not _linears(m).keys() & {n for n, _ in m.named_children()}:
            children = [(n, c) for n, c in m.named_children() if _linears(c)]  # NLLB-MoE's holds a Dropout too
            if len(children) > 1 and len({type(c) for _, c in children}) == 1:
                return path, [(f"{path}.{n}", c) for n, c in children]
    return None


def _expert_count(module: nn.Module) -> int | None:
    """The number of experts of a mixture-of-experts block (packed experts' first dimension, or a list of
    expert modules), else None."""
    for _, m in module.named_modules():
        if is_packed_experts(m):
            return m.gate_up_proj.shape[0]
        if is_ungated_experts(m):
            return m.up_proj.shape[0]
        two = experts_in_two_modules(m)
        if two:
            return getattr(m, two[0]).weight.shape[0]
        row_packed = row_packed_experts(m)
        if row_packed:
            return row_packed[0]
    unpacked = _unpacked_experts(module)
    return len(unpacked[1]) if unpacked else None


def _row_parallel(where: str, q: str, rows: set[str]) -> bool:
    """Whether the linear at `q` inside the layer's module at `where` ("" for the layer itself) is row-parallel:
    named by the layer's rows, or a `down_proj`, which DeepSpeed makes row-parallel whatever the policy says
    (deepspeed_compat's note)."""
    return "down_proj" in q or any(names_module(r, f"{where}.{q}" if where else q) for r in rows)


def _narrow_value_heads(attention: nn.Module, separate: tuple[str, str, str], width: int,
                        heads: tuple[int, int] | None) -> bool:
    """Whether an attention's value heads are narrower than its query and key heads, every projection holding whole
    heads (MiMo-V2-Flash: query and key heads of 192, value heads of 128, the output projection reading query heads
    x 128): a split by heads is right. Read as a gate packed with the query, such an attention was kept whole on
    every rank (66% of the layer per rank at tp 2, 2026-12-06). The key's head count is the layer's own (its
    sliding layers have twice the configured KV heads)."""
    head_dim = getattr(attention, "head_dim", None)
    if heads is None or not isinstance(head_dim, int) or head_dim <= 0:
        return False
    query, key, *value = (p.weight.shape[0] for p in _projections(attention, separate))
    value = value[0] if value else key
    q_heads = heads[0]
    kv_layer, rem = divmod(key, head_dim)
    return (query == q_heads * head_dim and width % q_heads == 0 and not rem and kv_layer > 0
            and value == kv_layer * (width // q_heads))


def _unread_own_linears(layer: nn.Module, rows: set[str]) -> list[str]:
    """The layer's own linears (its direct children, not inside its attention or MLP) that DeepSpeed would split by
    output rows although no row-parallel linear of the layer reads that output back: each rank would keep part of
    what the layer uses whole. Gemma 4's per-layer input gate (hidden -> 256, multiplied by the per-layer input the
    model gives each layer whole; then `per_layer_projection` back to hidden): "The size of tensor a (8) must match
    the size of tensor b (16)" at tp 2; Zamba's hybrid layer's `linear` into its whole Mamba layer: "(128) must match
    ... (64)" (2026-12-06). A layer's own MLP (BART's fc1, read by the row-parallel fc2) is split."""
    own = {n: c for n, c in layer.named_children() if is_linear(c)}
    row = {n for n in own if _row_parallel("", n, rows)}
    read = {own[n].weight.shape[1] for n in row}
    return [n for n, c in own.items() if n not in row and c.weight.shape[0] not in read]


def _router_modules(block: nn.Module) -> list[str]:
    """Paths (in a mixture-of-experts block) of the outermost routers that are modules of several linears, not one
    linear: Zaya's `gate` (a `down_proj` to the router's width, then `router_mlp.fc1/fc2/out_proj`). Split, its
    `down_proj` was made row-parallel and its MLP cut by rows ("mat1 and mat2 shapes cannot be multiplied (30x16
    and 32x16)" at tp 2, 2026-12-06); each rank must route every token alike, so the whole router stays whole."""
    found: list[str] = []
    for q, m in block.named_modules():
        if (q and not is_linear(m) and "expert" not in q and len(_linears(m)) > 1 and _expert_count(m) is None
                and is_router(q, m) and not any(q.startswith(f"{r}.") for r in found)):
            found.append(q)
    return found


def _norm_over(module: nn.Module, widths: set[int]) -> str | None:
    """The name of a norm among a module's children over one of `widths` (what its column-split linears write):
    BitNet's `ffn_sub_norm` over the MLP's inner width, which each rank holds a part of ("The size of tensor a
    (256) must match the size of tensor b (128)" at tp 2, 2026-12-06)."""
    for name, child in module.named_children():
        weight = getattr(child, "weight", None)
        if "norm" in type(child).__name__.lower() and isinstance(weight, torch.Tensor) and weight.ndim == 1 and (
                weight.shape[0] in widths):
            return name
    return None


def _feature_scales(module: nn.Module, widths: set[int]) -> list[str]:
    """The module's own 1-D parameters of one of `widths` (a value per feature a split linear writes: Dory's `sqk`,
    `s_gate`, `suv_gate`), which neither DeepSpeed nor a table splits."""
    return [n for n, t in module._parameters.items() if isinstance(t, torch.Tensor) and t.ndim == 1
            and t.shape[0] in widths]


def _whole_reason(path: str, module: nn.Module, rows: set[str], attention_paths: set[str],
                  heads: tuple[int, int] | None, gathered_elsewhere: set[int] = frozenset(),
                  hidden: int | None = None) -> str | None:
    """Why a child module of a layer (at `path` in it) must be kept whole on every rank, or None where AutoTP's
    split (rows named in `rows`, every other linear by output rows) computes it right. (A mixer of a layout
    `shard/mixers.py` knows is split there by its heads or channels, and never asked here.)

    * a mixer with a depthwise convolution of a layout not known: its input projection packs several streams of
      different widths (Mamba2's [z | x | B | C | dt]), which a split by output rows cuts across, and its forward
      reads whole sizes;
    * a module whose linears do not chain as an MLP (each column-split linear's outputs the inputs of a
      row-parallel one): the split would pair the wrong features (MiniMax's lightning attention: a 3 x width
      `qkv_proj` into a 1 x width `out_proj`; GraniteMoE's `input_linear`, [gate | up] in one linear that
      DeepSpeed's GateUpPack handles only under the name `gate_up_proj`).
    DeepSeek's multi-head latent attention (`kv_a_proj_with_mqa`) is DeepSpeed's own record, left to it where a
    row-parallel linear gathers it."""
    if any(isinstance(m, nn.Conv1d) for m in module.modules()):
        return "a mixer with a convolution over its channels: its packed input projection does not split by rows"
    linears = _linears(module)
    if _bare_parameters(module):
        # XLNet's relative attention: q, k, v, o, r as [d_model, heads, d_head] parameters (held whole and not
        # placed: its weight share failed, 53.6% per rank at tp 2, `policy sweep`, 2026-12-06)
        return BARE_PARAMETERS
    # DeepSpeed makes any `down_proj` row-parallel whatever the policy says (deepspeed_compat's note)
    row = {q: m for q, m in linears.items() if _row_parallel(path, q, rows)}
    columns = {q: m for q, m in linears.items() if q not in row}
    if row and any(autotp_keeps_whole(f"{path}.{q}") for q in linears):
        return None  # DeepSpeed's own latent attention; without a row-parallel output (DeepSeek-V4's o_a_proj and
        # o_b_proj) nothing gathers it: the kv_norm of a split kv_proj failed, "(32) must match ... (16)"
    if path in attention_paths:
        if not row:
            return None  # the attention table's, or DeepSpeed's head-aware split
        fused = next((m for q, m in columns.items() if q.rpartition(".")[2] in FUSED_QKV), None)
        separate = _separate_qkv(module, dict(module.named_children()))
        query = module.get_submodule(separate[0]) if separate else None
        width = next(iter(row.values())).weight.shape[1]  # what the output projection reads
        if query is not None and query.weight.shape[0] != width:
            gated = _gated_per_head(module) and query.weight.shape[0] == 2 * width
            if not gated and not _narrow_value_heads(module, separate, width, heads):
                return (f"its query projection ({query.weight.shape[0]} outputs) is not the {width} features its "
                        "output projection reads (a gate packed with it)")
        if fused is None or heads is None:
            return None  # separate q/k/v: the attention table's, or DeepSpeed's head-aware split
        q_heads, kv_heads = heads
        head_dim = fused.weight.shape[0] // (q_heads + 2 * kv_heads)
        if q_heads * head_dim == width:
            return None
        return (f"its fused projection ({fused.weight.shape[0]} outputs) does not hold {q_heads} query and "
                f"{kv_heads} key/value heads of the {width // q_heads} features its output projection reads")
    if not columns:
        return None
    # a parameter of the module itself scaling what a split linear writes (Dory's `suv_gate`, [inner]): DeepSpeed
    # leaves it whole beside the split output ("(128) must match ... (256)"); Dory's attention likewise, below
    scale = next(iter(_feature_scales(module, {m.weight.shape[0] for m in columns.values()} - {hidden})), None)
    if scale:
        return (f"{scale} scales each of the {module._parameters[scale].shape[0]} features a split linear writes, a "
                "parameter DeepSpeed does not split")
    norm = _norm_over(module, {m.weight.shape[0] for m in columns.values()} - {hidden})
    if norm:
        return (f"{norm} normalises the {getattr(module.get_submodule(norm), 'weight').shape[0]} features its linears "
                "split: no rank can compute it from its own features")
    if not row and all(m.weight.shape[0] in gathered_elsewhere for m in columns.values()):
        return None  # an MLP across two modules: BERT's `intermediate.dense`, gathered by the layer's `output.dense`
    if not row:
        return (f"no row-parallel linear gathers what {', '.join(columns)} compute: split by output rows, each "
                "rank would keep part of the module's output")
    fed = {m.weight.shape[1] for m in row.values()}
    # a child module holding no row-parallel linear is judged on its own (`_whole_inside`: kept whole where nothing
    # gathers it), not against this module's row-parallel inputs: X-MOD's language adapter after `output.dense`
    # (128 -> 64 -> 128, on the all-reduced output) kept the whole `output` whole, and `intermediate` split before it
    own = {q for q in columns if "." not in q or any(r.startswith(f"{q.partition('.')[0]}.") for r in row)}
    odd = [q for q, m in columns.items() if q in own and m.weight.shape[0] not in fed
           and not (q.endswith("gate_up_proj") and m.weight.shape[0] // 2 in fed)]
    if odd:
        return (f"{odd[0]} ({columns[odd[0]].weight.shape[0]} outputs) does not feed a row-parallel linear "
                f"({', '.join(str(f) for f in sorted(fed))} inputs): no split by output rows pairs its features")
    return None


def _gathered_widths(layer: nn.Module, rows: set[str], hidden: int | None) -> set[int]:
    """The input widths of the layer's row-parallel linears, but the model's width: what a column-split linear of
    one child module may write for a row-parallel linear of another to gather (BERT's `intermediate.dense`, 4 x
    hidden, read by `output.dense`: judged alone, `intermediate` was kept whole while `output.dense` was split, and
    the sharded forward failed, "mat1 and mat2 shapes cannot be multiplied (30x256 and 128x128)", 2026-12-06; 13
    model types of the BERT family)."""
    return {m.weight.shape[1] for q, m in _linears(layer).items()
            if _row_parallel("", q, rows) and m.weight.shape[1] != hidden}


BARE_PARAMETERS = "its weights are bare parameters, not linears: DeepSpeed splits linears only"


def _bare_parameters(module: nn.Module) -> bool:
    """Whether the module holds weights (2-D or more) and no linear, nor is one."""
    return not _linears(module) and not is_linear(module) and any(p.ndim >= 2 for p in module.parameters())


def _wraps_a_linear(module: nn.Module) -> bool:
    """A module of the model's own around one linear and nothing else that holds parameters (Moshi's `MoshiLinear`,
    Kyutai's: `self_attn.q_proj.linear`)."""
    linears = _linears(module)
    return (len(linears) == 1 and not module._parameters
            and all(not any(True for _ in m.parameters()) for n, m in module.named_children() if n not in linears))


def _wrapped_linears(path: str, module: nn.Module, rows: set[str], read: set[int]) -> set[str]:
    """The names of the module's children that wrap one linear each (`_wraps_a_linear`), to be judged as those
    linears: all of them, where each is row-parallel or writes a width a row-parallel linear of the module reads (or
    the model's); else none. Judged as modules nested in the attention, Moshi's and Kyutai's projections were each
    kept whole on every rank, and the attention with them (Moshi 100% per rank at tp 2, Kyutai 59%; 50% now). All
    or none: a key projection of fewer heads than the query's (grouped-query attention) writes another width, and
    kept whole beside a split query it gave wrong logits (no table describes an attention through its wrappers)."""
    found = {n: c for n, c in module.named_children() if not is_linear(c) and _wraps_a_linear(c)}
    # only a module made of such wrappers, a row-parallel one gathering the others (an attention's projections): a
    # wrapped linear beside a module kept whole (Reformer's `attention.output.dense`, row-parallel by the name of
    # the layer's MLP output, after its whole `self_attention`) reads a whole input, which a split cannot
    others = [c for n, c in module.named_children() if n not in found and not is_linear(c)
              and any(True for _ in c.parameters())]
    row = {n for n, c in found.items() if any(_row_parallel(f"{path}.{n}", q, rows) for q in _linears(c))}
    fits = all(n in row or any(m.weight.shape[0] in read for m in _linears(c).values()) for n, c in found.items())
    return set(found) if fits and not others and row and len(row) < len(found) else set()


def _low_rank_adapter(module: nn.Module, width: int, hidden: int | None) -> bool:
    """Whether the module holds low-rank adapters to `width` and nothing else: linears from the model's width to a
    narrow rank, and from that rank to `width` (Zamba2's `gate_up_proj_adapter_list`, Sequentials of hidden -> 128
    -> 2 x inner, added to `gate_up_proj`'s output). The width is not the model's: a module whose output merely has
    the width of a sibling linear's (the model's, in a tiny model) is not taken for one (DeepSeek-V3.2's indexer)."""
    linears = list(_linears(module).values())
    held = {id(p) for m in linears for p in m.parameters()}
    if not linears or width == hidden or any(id(p) not in held for p in module.parameters()):
        return False
    down = [m for m in linears if m.weight.shape[1] == hidden and m.weight.shape[0] < width]
    up = [m for m in linears if m.weight.shape[0] == width and m.weight.shape[1] < width]
    return bool(down) and bool(up) and len(down) + len(up) == len(linears)


def _whole_inside(path: str, module: nn.Module, rows: set[str], hidden: int | None) -> dict[str, str]:
    """{path: why} of the modules nested in a split module (not linears themselves) whose linears no row-parallel
    linear gathers: DeepSpeed would split each by output rows and every rank would read a part as the whole
    (DeepSeek-V3.2's and GLM-5's `self_attn.indexer`, which scores every token for the sparse attention: "shape
    '[3, 10, 64, 128]' is invalid" at tp 2). Such a module is computed whole on every rank."""
    found = {}
    # what a row-parallel linear of the module reads, but the model's width: an MLP across two of its modules is
    # gathered by the second (Reformer's `feed_forward.dense`, 128 -> 256, read by `feed_forward.output.dense`: kept
    # whole while that was split, "mat1 and mat2 shapes cannot be multiplied (30x256 and 128x128)" at tp 2,
    # `policy sweep`, 2026-12-07), as `_gathered_widths` finds it among the layer's own modules
    read = {m.weight.shape[1] for q, m in _linears(module).items()
            if _row_parallel(path, q, rows) and m.weight.shape[1] != hidden}
    wrapped = _wrapped_linears(path, module, rows, read | {hidden})
    for name, child in module.named_children():
        linears = _linears(child)
        if _bare_parameters(child) and not is_experts(child) and not any(isinstance(m, nn.Embedding)
                                                                         for m in child.modules()):
            # weights DeepSpeed does not split, beside a split module's linears (Ergo's experts as bare [experts,
            # ...] parameters beside its shared expert): held whole, and counted so (an embedding DeepSpeed slices
            # itself: T5's relative attention bias)
            found[f"{path}.{name}"] = BARE_PARAMETERS
            continue
        if not linears or is_linear(child) or is_ssm_mixer(child) or _expert_count(child) is not None:
            continue
        if any(not p for p, *_ in _attention_modules(child)):  # q/k/v gathered by its parent (BigBird's `self`)
            continue
        where = f"{path}.{name}"
        if name in wrapped:
            continue  # a linear in a module of the model's own: judged as that linear
        if all(m.weight.shape[0] in read and not _row_parallel(where, q, rows) for q, m in linears.items()):
            continue
        # a row-parallel linear gathers the module when it writes the model's width back (AutoTP names the
        # indexer's `wk`, the linear before its norm, row-parallel, though it writes one head's features)
        # (and reads something narrower or wider than the model's width: a row-parallel linear that reads the layer's
        # input is not gathering anything; dots3's `indexer.wk`, 128 to 128 where hidden is 128, 2026-12-06)
        gathered = any(_row_parallel(where, q, rows) and m.weight.shape[0] == hidden and m.weight.shape[1] != hidden
                       or autotp_keeps_whole(f"{where}.{q}") for q, m in linears.items())
        if not gathered:
            # its output joins a column-split linear's of the module (Zamba2's low-rank adapters, added to its shared
            # MLP's `gate_up_proj`: kept whole beside the split linear, "(256) must match ... (512)" at tp 2): no
            # rank could add its part of that linear to the whole, so the module is kept whole with it
            beside = [q for q, m in _linears(module).items() if "." not in q and not _row_parallel(path, q, rows)
                      and _low_rank_adapter(child, m.weight.shape[0], hidden)]
            if beside:
                return {path: f"{where} adds its output to {beside[0]}'s, which a split would cut: the module is "
                              "computed whole on every rank"}
            found[where] = ("a module inside a split one whose linears no row-parallel linear gathers: each rank "
                            "computes it whole")
    return found


def _units(module: nn.Module, attention_paths: set[str], prefix: str = ""):
    """(path, module) of what is judged whole or split as one: the layer's children, except that a child holding an
    attention below it beside other modules is judged by its own children, down to the attention (DBRX's
    `norm_attn_norm`: two norms and `attn`; judged as one module, its fused `Wqkv` was taken for an MLP's first
    linear that feeds no row-parallel linear, and nothing of the layer was split, 2026-12-06)."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if path not in attention_paths and any(a.startswith(f"{path}.") for a in attention_paths):
            yield from _units(child, attention_paths, f"{path}.")
        else:
            yield path, child


def derive_whole_modules(model: nn.Module, layers: dict[str, tuple[str, ...]], experts: dict[str, tuple[str, ...]]
                         ) -> tuple[dict[str, dict[str, str]], dict[str, tuple[str, ...]]]:
    """{layer class: {path: why}} of the modules to keep whole on every rank: mixers AutoTP cannot split
    (`_whole_reason`), and mixture-of-experts routers and gates (each rank must route every token alike:
    a linear of the block, outside its experts, with one output per expert or a single one); and {layer class:
    paths} of the Mamba2-style mixers split by their heads instead (`shard/mixers.py`)."""
    found: dict[str, dict[str, str]] = {}
    text = text_config(model.config)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "d_model", None)
    mixers: dict[str, dict[str, None]] = {}
    mixer_types: dict[tuple[str, str], set[str]] = {}
    heads = head_values(model.config)
    placed = (set(layers) | set(experts)) & outermost_layer_classes(model)
    whole_types: dict[tuple[str, str], set[str]] = {}
    split_types: dict[tuple[str, str], set[str]] = {}
    for name, kinds in layer_kinds(model).items():
        if name not in placed:
            continue  # not a layer the policy names (T5LayerFF inside T5Block: its linears are T5Block's)
        rows = set(layers.get(name, ()))
        for layer in kinds:
            attention_paths = {a[0] for a in _attention_modules(layer)}
            for path in _unread_own_linears(layer, rows):
                found.setdefault(name, {}).setdefault(path, "a linear of the layer itself whose output no row-parallel "
                                                            "linear reads: the layer uses it whole")
            for path, child in _units(layer, attention_paths):
                count = _expert_count(child)
                if count is not None:
                    routers = _router_modules(child)
                    for q in routers:
                        found.setdefault(name, {}).setdefault(f"{path}.{q}", "a router: every rank routes every token")
                    for q, m in _linears(child).items():  # by shape, or by name where it scores more than the
                        # experts (LongCat-Flash's `router.classifier`: its zero-computation experts too)
                        if any(q.startswith(f"{r}.") for r in routers):
                            continue
                        if "expert" not in q.rpartition(".")[0] and (m.weight.shape[0] in (count, 1) or (
                                m.weight.shape[0] > count and is_router(q, m))):
                            found.setdefault(name, {}).setdefault(f"{path}.{q}", "a router: every rank routes "
                                                                                 "every token")
                    continue
                if is_ssm_mixer(child):
                    mixers.setdefault(name, {})[path] = None
                    mixer_types.setdefault((name, path), set()).add(type(child).__name__)
                    continue
                why = _whole_reason(path, child, rows, attention_paths, heads, _gathered_widths(layer, rows, hidden),
                                    hidden)
                if why:
                    found.setdefault(name, {}).setdefault(path, why)
                    whole_types.setdefault((name, path), set()).add(type(child).__name__)
                else:
                    split_types.setdefault((name, path), set()).add(type(child).__name__)
                    for inner, why in _whole_inside(path, child, rows, hidden).items():
                        found.setdefault(name, {}).setdefault(inner, why)
    # a path kept whole in one kind and split in another (NemotronH's `mixer`): name the kind by its class
    for (name, path), types in whole_types.items():
        if (name, path) in split_types or (name, path) in mixer_types:
            why = found[name].pop(path)
            for cls in sorted(types):
                found[name][f"{path}@{cls}"] = why
    for (name, path), types in mixer_types.items():  # likewise a path that is an SSM mixer in some kinds only
        if (name, path) in split_types or (name, path) in whole_types:
            del mixers[name][path]
            mixers[name].update(dict.fromkeys(f"{path}@{cls}" for cls in sorted(types)))
    return found, {name: tuple(paths) for name, paths in mixers.items()}


@contextlib.contextmanager
def _conv1d_seen_as_linear(model: nn.Module):
    """While deriving, transformers' Conv1D layers (GPT-1, GPT-2) are the nn.Linears `shard_model` makes them
    (`shard.inject.conv1d_to_linear`), as empty ones on meta ([out, in], no data copied), then the model's own again:
    DeepSpeed's parser and the shape rules here read a linear's weight as [out, in]. Read as Conv1D, GPT-1's
    `mlp.c_fc` was taken for its MLP's row-parallel end and `attn.c_attn` was cut wrong ("not enough values to
    unpack", `policy sweep`, 2026-12-06). Not converted in place: the loaders and the reference copies of the layers
    know the model as it was built."""
    places = [(name, m) for name, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    for name, conv in places:
        model.set_submodule(name, nn.Linear(conv.weight.shape[0], conv.weight.shape[1], bias=conv.bias is not None,
                                            device="meta"))
    try:
        yield
    finally:
        for name, conv in places:
            model.set_submodule(name, conv)


@reading_configured_values
def derive_policy(model: nn.Module) -> Policy:
    """A complete policy for a model with no policy file: row-parallel linears, the attention table, the packed
    experts, and the modules kept whole."""
    with _conv1d_seen_as_linear(model):
        return _derive_policy(model)


def _derive_policy(model: nn.Module) -> Policy:
    model_type = getattr(model.config, "model_type", type(model).__name__)
    layers = derive_row_parallel(model)
    experts = derive_experts(model)
    whole, mixers = derive_whole_modules(model, layers, experts)
    for name, paths in whole.items():
        logger.warning("%s: kept whole on every rank in %s: %s", model_type, name,
                       "; ".join(f"{p} ({why})" for p, why in paths.items()))
    attention, replicated = derive_attention(model, layers, skip={n: {*whole.get(n, ()), *mixers.get(n, ())}
                                                                  for n in sorted({*whole, *mixers})})
    replicated = {n: tuple(dict.fromkeys((*whole.get(n, {}), *replicated.get(n, ()))))
                  for n in sorted({*whole, *replicated})}
    # a row-parallel linear inside a module kept whole, or inside a mixer split here, is not DeepSpeed's to split
    # (by its path, or by a DeepSpeed-style key that names a linear inside: NLLB-MoE's "expert_3.fc2")
    kinds = layer_kinds(model)

    def inside_whole(name: str, row: str) -> bool:
        """Every linear the row names, in every kind of the layer, is inside a module kept whole or split here."""
        places = [(layer, q) for layer in kinds.get(name, ()) for q, m in layer.named_modules()
                  if q and is_linear(m) and names_module(row, q)]
        return bool(places) and all(any(under_replicated(p, layer, q) for p in (*replicated.get(name, ()),
                                                                                *mixers.get(name, ())))
                                    for layer, q in places)

    layers = {name: tuple(r for r in rows if not inside_whole(name, r)) for name, rows in layers.items()}
    # a layer whose experts are all that is split (JetMoE: its attention of experts and its routers whole) is named
    # with no row-parallel linear: left out, DeepSpeed parsed the model itself and refused its activation ("Unsupported
    # activation function: silu")
    layers.update({name: () for name in experts if name not in layers})
    q_attr, _ = _head_counts(model.config)
    heads = (q_attr,) if q_attr else ()
    return Policy(source=Path(DERIVED.format(model_type)), description=f"derived from {type(model).__name__}",
                  model_types=(model_type,), head_count_attributes=heads, layers=layers, attention=attention,
                  replicated=replicated, experts=experts, mixers=mixers)


def derive_experts(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{layer class: paths of its packed mixture-of-experts modules} (3-D gate_up_proj and down_proj, or 2-D
    [experts x inner, hidden] parameters: `kinds.row_packed_experts`)."""
    found: dict[str, tuple[str, ...]] = {}
    for name, layers in layer_kinds(model).items():  # every kind: DeepSeek-V3's first layers are dense
        found_paths = [p for layer in layers for p, m in layer.named_modules() if p and is_experts(m)]
        # the outermost: DBRX's `ffn.experts` reads the inner size its `mlp`, which holds the parameters, records too
        paths = tuple(dict.fromkeys(p for p in found_paths if not any(p.startswith(f"{o}.") for o in found_paths)))
        if paths:
            found[name] = paths
    return found


def derived_summary(policy: Policy) -> str:
    """A derived policy in one line, for the log and the unchecked-policy warning."""
    spec = policy.attention
    attention = "" if spec is None else (
        f"; attention {spec.fused_qkv} (fused, layout {spec.layout})" if spec.fused_qkv else
        f"; attention {spec.query}/{spec.key}/{spec.value} ({spec.query_heads} / {spec.kv_heads} heads)") + (
        f", also {', '.join(spec.also)}" if spec and spec.also else "")
    kept = f"; kept whole on every rank: {dict(policy.replicated)}" if policy.replicated else ""
    experts = f"; experts split: {dict(policy.experts)}" if policy.experts else ""
    mixers = f"; mixers split by heads or channels: {dict(policy.mixers)}" if policy.mixers else ""
    return f"row-parallel linears {dict(policy.layers)}{attention}{kept}{experts}{mixers}"


def policy_for_model(policy: Policy | str | None, model: nn.Module, tp_size: int) -> Policy | None:
    """What `shard_model` takes, from what `resolve_policy` / `policy_for_run` answered before the model loaded: a
    Policy as it is; None for DeepSpeed's AutoTP; DERIVE becomes the policy derived from this model (said in one
    log line), or None at tp 1, where nothing is split. Resolved here, once, so that no string reaches the
    sharding, and a pre-sharded directory is checked against the policy the run will use."""
    if policy is None or isinstance(policy, Policy):
        return policy
    if policy != DERIVE:
        raise InferenceSetupError(f"policy {policy!r} is not resolved; valid: a Policy, None (autotp) or {DERIVE!r}")
    if tp_size == 1:
        return None
    derived = derive_policy(model)
    logger.warning("no policy file for model_type %r: derived %s", getattr(model.config, "model_type", "?"),
                   derived_summary(derived))
    return derived
