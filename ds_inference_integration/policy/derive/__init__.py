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

One module a mechanism: `rows.py` (row-parallel linears), `attention.py` (the attention table, and the attentions kept
whole), `experts.py` (mixture-of-experts blocks and their routers), `whole.py` (the other modules kept whole),
`heads.py` (head counts and per-rank attributes), `common.py` (what they share). `derive_policy` here puts them
together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

from torch import nn

from ...errors import InferenceSetupError
from ..layers import layer_kinds
from ..schema import DERIVE, Policy, is_linear, names_module, reading_configured_values, under_replicated
from .attention import derive_attention
from .biases import derive_head_biases, derive_head_inputs
from .experts import derive_experts
from .heads import _head_counts, head_values
from .packed import derive_packed
from .probe import probing
from .rows import derive_row_parallel
from .verdicts import note, recording
from .whole import derive_whole_modules

__all__ = ["DERIVED", "derive_attention", "derive_experts", "derive_policy", "derive_row_parallel",
           "derive_whole_modules", "derived_summary", "head_values", "is_derived", "policy_for_model"]

logger = logging.getLogger(__name__)


# a derived policy's `source`: it has no file
DERIVED = "<derived for {}>"


def is_derived(policy) -> bool:
    """Whether `policy` (a Policy, or None for autotp) was derived from the model, not read from a file."""
    return policy is not None and str(policy.source).startswith(DERIVED.partition("{")[0])


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
    experts, and the modules kept whole; each mechanism's verdict in `Policy.verdicts` (`verdicts.py`). A model of
    classes outside transformers (its own code, a script's) is probed where its names say nothing (`probe.py`);
    transformers' own are derived by the rules of their names alone, checked on every type it generates with: the
    probe changed none of the architecture table's 157 policies but CPM-Ant's (its position bias cut to each rank's
    heads) and XLM's (which ships a file), and cost 12 s of derivation over them against 1 s (2026-12-07)."""
    said = _Said()
    logger.addHandler(said)
    own = not type(model).__module__.startswith("transformers.")
    try:
        with _conv1d_seen_as_linear(model), probing(model) if own else contextlib.nullcontext() as probe, \
                recording() as rows:
            policy = _derive_policy(model)
            if probe is None:
                note("probe", "", "not run: transformers' own classes, whose names the rules know (every type it "
                                  "generates with is checked: docs/sweep.md)")
            elif probe.failure:
                note("probe", "", f"not run through every layer: {probe.failure}; the rules of the names decide there")
    finally:
        logger.removeHandler(said)
    found = {(m, w) for m, w, _ in rows}  # the summary's row of a mechanism that said its own, left out
    return dataclasses.replace(policy, verdicts=tuple(rows) + tuple(("kept whole", "", m) for m in said.messages)
                               + tuple(r for r in _summary(policy) if r[:2] not in found))


class _Said(logging.Handler):
    """The derivation's warnings (every module kept whole on every rank, and why), as verdict rows."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.messages.append(text.split(": ", 1)[1] if ": " in text else text)


def _summary(policy: Policy) -> tuple[tuple[str, str, str], ...]:
    rows = []
    spec = policy.attention
    if spec is not None:
        where = spec.fused_qkv or f"{spec.query}/{spec.key}/{spec.value}"
        layout = f"fused, layout {spec.layout}" if spec.fused_qkv else "separate query, key and value"
        rows.append(("attention", where, f"{layout}; {spec.query_heads} query / {spec.kv_heads} key/value heads"
                                         + (f"; also {', '.join(spec.also)}" if spec.also else "")))
        for attr, value in spec.local:
            rows.append(("per-rank attributes", attr, " + ".join(value) if isinstance(value, tuple) else value))
    for key, text in (("experts", "each expert's MLP split"), ("mixers", "split by heads or channels")):
        for name, paths in getattr(policy, key).items():
            rows.append((key, name, f"{', '.join(paths)}: {text}"))
    return tuple(rows)


def _derive_policy(model: nn.Module) -> Policy:
    model_type = getattr(model.config, "model_type", type(model).__name__)
    layers = derive_row_parallel(model)
    experts = derive_experts(model)
    packed = derive_packed(model, layers)
    whole, mixers = derive_whole_modules(model, layers, experts, packed)
    for name, paths in whole.items():
        logger.warning("%s: kept whole on every rank in %s: %s", model_type, name,
                       "; ".join(f"{p} ({why})" for p, why in paths.items()))
    head_biases = derive_head_biases(model, layers)
    head_inputs = derive_head_inputs(model, layers, head_biases)
    attention, replicated = derive_attention(model, layers, skip={n: {*whole.get(n, ()), *mixers.get(n, ())}
                                                                  for n in sorted({*whole, *mixers})},
                                             biases=head_biases)
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
    packed = {name: tuple(p for p in paths if not any(under_replicated(w, kinds[name][0], p)
                                                      for w in replicated.get(name, ())))
              for name, paths in packed.items()}
    return Policy(source=Path(DERIVED.format(model_type)), description=f"derived from {type(model).__name__}",
                  model_types=(model_type,), head_count_attributes=heads, layers=layers, attention=attention,
                  replicated=replicated, experts=experts, mixers=mixers, packed={n: p for n, p in packed.items() if p},
                  head_biases=head_biases, head_inputs=head_inputs)


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
