"""The attention table: which projections hold the heads (fused or separate), their layout, the attributes set per
rank, and the attentions no rank can compute from its own heads (kept whole)."""

from __future__ import annotations

import dataclasses
import logging
import re

import torch
from torch import nn

from ...deepspeed_compat import head_grain
from ..configs import text_config
from ..layers import layer_kinds
from ..schema import AttentionSpec, class_source, is_linear, names_module, under_replicated
from .common import _feature_scales
from .heads import _head_counts, _local_attributes, head_values
from .layouts import attention_rows_parallel, layout_of, local_attributes, probed_fused, probed_separate
from .probe import active
from .verdicts import note

logger = logging.getLogger(__name__)


SEPARATE_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"),
                ("project_q", "project_k", "project_v"))  # the last: CPM-Ant (BMTrain's names)
FUSED_QKV = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack", "qkv")


def _attention_modules(layer: nn.Module) -> list[tuple[str, nn.Module, str | None, tuple[str, str, str] | None]]:
    """(path, module, fused projection name, separate q/k/v names) of each attention module inside a layer: by the
    projections' names, and, while the derivation probes the model (`probe.active`), a linear of any name whose rows
    the attention products read as query, key and value together (InternLM2's `wqkv`, OLMo's `att_proj` on the
    block itself: the module is the linear's parent)."""
    found = []
    for path, module in layer.named_modules():
        children = {n: c for n, c in module.named_children()}
        fused = next((n for n in FUSED_QKV if n in children and is_linear(children[n])), None)
        separate = _separate_qkv(module, children)
        if fused or separate:
            found.append((path, module, fused, separate))
    probe = active()
    if probe is not None and not found:  # (where names find an attention, the probe is not run for it: ~0.1 s a model)
        for linear in probed_fused(probe, layer):
            owner, _, name = linear.rpartition(".")
            found.append((owner, layer.get_submodule(owner) if owner else layer, name, None))
        for owner, names in probed_separate(probe, layer).items():
            if not any(p == owner for p, *_ in found):
                found.append((owner, layer.get_submodule(owner) if owner else layer, None, names))
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


def _per_head_outside_layers(model: nn.Module, layers: dict[str, tuple[str, ...]], q: int, kv: int,
                             biases: tuple[str, ...] = ()) -> str | None:
    """A parameter outside the layers with one column per head, made into a per-head input of every layer (CPM-Ant's
    `position_bias.relative_attention_bias`, [buckets, heads]: the bias of all heads reached attentions holding
    some, "(2) must match ... (4)" at tp 2, `policy sweep` 2026-12-06). T5's is inside its first layer, where
    DeepSpeed splits it with the heads. A linear's or convolution's weight is not one: its second dimension is what
    it reads (VibeVoice-ASR's audio tokenizer, whose first stage reads 4 channels at the sweep's size, kept a
    Qwen2 decoder's attention whole on every rank, 70% per rank at tp 2). A module the policy cuts to each rank's
    heads (`biases.py`: `head_biases`) is not one."""
    inside = {id(m) for list_ in model.modules() if isinstance(list_, nn.ModuleList)
              for layer in list_ if type(layer).__name__ in layers for m in layer.modules()}
    hidden = getattr(text_config(model.config), "hidden_size", None)
    for name, module in model.named_modules():
        if id(module) in inside or isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) or name in biases:
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


def derive_attention(model: nn.Module, layers: dict[str, tuple[str, ...]], skip: dict[str, set[str]] | None = None,
                     biases: tuple[str, ...] = ()) -> tuple[AttentionSpec | None, dict[str, tuple[str, ...]]]:
    """The attention table for a model with no policy file, or None where DeepSpeed's own split is right
    (separate q/k/v with as many key/value heads as query heads, or a fused layout only DeepSpeed knows); and
    {layer class: attention paths} to keep whole, where no rank can compute the attention from its own heads."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    q_attr, kv_attr = _head_counts(config)
    text = text_config(config)
    if q_attr is None:
        _refuse_unnamed_head_counts(model, layers, model_type)
    if q_attr is None or head_grain(model_type) > 1:
        return None, {}  # no head count to split by, or a layout DeepSpeed keeps its own record of (CodeGen)
    q, kv = head_values(config)
    kinds = layer_kinds(model)
    by_path: dict[tuple[str, str], tuple] = {}  # one per attention path of each layer class, over its kinds
    rebuilt: dict[str, dict[str, str]] = {}  # {layer class: {path: class}} of attentions rebuilt while running
    own_kv: dict[tuple[str, str], set[int]] = {}  # the key/value head counts each kind's attention there holds
    layer_of: dict[tuple[str, str], nn.Module] = {}  # the layer each attention path was found in
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
                layer_of.setdefault((name, a[0]), layer)
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
    outside = _per_head_outside_layers(model, layers, q, kv, biases)
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
        probed = None
        if not fused:  # a model the probe reads: the attributes a rank's split needs, whatever their names
            probed = _probed_table(layer_of[(layer_name, path)], tuple(prefix + n for n in separate), q, kv, local)
            if isinstance(probed, str):
                logger.warning("%s: %s.%s %s, so that attention is kept whole on every rank", model_type, layer_name,
                               path, probed)
                replicated.setdefault(layer_name, []).append(path)
                continue
            if probed is not None:
                local = probed[1]
        if (not fused and kv == q and not per_layer and not per_head
                and not any(attr.startswith("config.") for attr, _ in local) and not (probed and local)):
            continue  # DeepSpeed's head-aware split of separate projections is right, and updates the module's
            # own head counts; a count read from the config (Moonshine views q by config.num_key_value_heads),
            # or an attribute the probe found a rank's split needs (Meta's reference LLaMA's `n_local_heads`),
            # must be made this rank's by the table
        kv_value = kv_attr if kv_attr is not None else q_attr  # no KV-head attribute: as many as query heads
        if fused:
            layout = _fused_layout(attention, text, q, kv)
            probed = _probed_table(layer_of[(layer_name, path)], (prefix + fused,), q, kv, local)
            if isinstance(probed, str):
                logger.warning("%s: %s.%s%s %s, so that attention is kept whole on every rank", model_type, layer_name,
                               prefix, fused, probed)
                replicated.setdefault(layer_name, []).append(path)
                continue
            if probed is not None:
                layout, local = probed
            spec = AttentionSpec(query_heads=q_attr, kv_heads=kv_value, fused_qkv=prefix + fused, layout=layout,
                                 local=local)
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


def _refuse_unnamed_head_counts(model: nn.Module, layers: dict[str, tuple[str, ...]], model_type: str) -> None:
    """One `InferenceSetupError` where the probe reads a fused attention projection but the config names its head
    counts under no attribute the rules know (`heads.QUERY_HEAD_ATTRIBUTES`): left to DeepSpeed, its rows were cut
    across query, key and value. A policy names its head counts by the config's attribute, so that one file serves
    every size of a family; the line says which attributes hold the probe's counts."""
    from .common import _cannot_derive
    from .heads import KV_HEAD_ATTRIBUTES, QUERY_HEAD_ATTRIBUTES

    probe = active()
    if probe is None:
        return
    for name, kinds in layer_kinds(model).items():
        if name not in layers:
            continue
        for path, rows in probed_fused(probe, kinds[0]).items():
            found = layout_of(rows)
            if found is None:
                continue
            layout, heads, kv, _ = found
            text = text_config(model.config)
            holding = {n: v for n, v in vars(text).items() if type(v) is int and v in (heads, kv)
                       and not n.startswith("_")}
            said = ", ".join(f"{n} = {v}" for n, v in sorted(holding.items())) or "none"
            raise _cannot_derive(
                model_type, f"{name}.{path} holds {heads} query and {kv} key/value heads in a fused projection (layout "
                            f"{layout}, read by the probe), and the config names its head counts under no attribute "
                            f"the rules know ({', '.join(QUERY_HEAD_ATTRIBUTES + KV_HEAD_ATTRIBUTES)}; its attributes of "
                            f"those values: {said}): declare them, [attention] query_heads = \"<attribute>\", kv_heads = "
                            f"\"<attribute>\", fused_qkv = \"{path}\", layout = \"{layout}\"", suggest=False)


def _probed_table(layer: nn.Module, paths: tuple[str, ...], q: int, kv: int, local: tuple
                  ) -> tuple[str, tuple] | str | None:
    """(layout, per-rank attributes) of a fused projection, or of separate query, key and value projections read as
    one [Q | K | V] (`paths`), as the probe reads them (`layouts.py`), or a reason to keep the attention whole, or
    None where the model is not probed (the rules of its names decide)."""
    probe = active()
    rows = probe.heads(layer, paths) if probe is not None else None
    if rows is None or not (rows.q and rows.k and rows.v):
        return None
    path = paths[0] if len(paths) == 1 else "/".join(paths)
    found = layout_of(rows)
    if found is None:
        return ("holds its query, key and value rows in a layout no table names (not [Q | K | V], [q k v] per head "
                "or [q .. q k v] per key/value group)")
    layout, heads, kv_heads, d = found
    if (heads, kv_heads) != (q, kv):
        return (f"is read as {heads} query and {kv_heads} key/value heads, not the config's {q} and {kv}: no table "
                "describes it")
    rows_parallel = attention_rows_parallel(probe, layer, paths)
    assignment = local_attributes(probe, layer, paths, rows_parallel, rows, layout, heads, kv_heads, d, dict(local))
    if isinstance(assignment, list):  # (whatever its names: a nanoGPT-style attention viewing its output at its input's
        # width, `C` of `x.size()`, reads no attribute a rank could hold)
        tried = ", ".join(assignment) or "none read in its forward"
        return (f"is read in layout {layout}, but under no assignment of a rank's head counts and widths to the "
                f"attributes its attention reads ({tried}) does a simulated split read each rank's heads (declare them "
                "in the policy's [attention.local])")
    what = f"fused, layout {layout}" if len(paths) == 1 else "separate query, key and value"
    note("attention", path, f"{what} (probed: {heads} query heads, {kv_heads} key/value heads of {d})")
    return layout, tuple(assignment.items())


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
