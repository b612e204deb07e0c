"""Row-parallel linears: the config's tp plan, DeepSpeed AutoTP's verdict on the rest, and the end of each MLP chain
neither names."""

from __future__ import annotations

from torch import nn

from ...deepspeed_compat import autotp_row_parallel
from ..configs import text_config
from ..layers import layer_kinds
from ..schema import is_linear, layer_classes, names_module, outermost_layer_classes
from .common import _cannot_derive, _linears
from .experts import _unpacked_experts, derive_experts
from .probe import ATTENTION, active
from .verdicts import note


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
    for name, rows in layers.items():
        note("row-parallel linears", name, ", ".join(rows) + " (the config's tp plan, DeepSpeed AutoTP's names, the end of "
             "an MLP chain)")
    layers.update(_flow_rows(model, classes, layers))
    if not layers and not derive_experts(model):
        raise _cannot_derive(model_type, "no row-parallel linear found (neither the config's base_model_tp_plan "
                                         f"nor DeepSpeed AutoTP names one){_what_the_layers_hold(model)}")
    return layers


def _flow_rows(model: nn.Module, classes, named: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """{layer class: row-parallel linears} read from the layers' data flow (`probe.LayerFlow.row_parallel`: the linears
    that write back into what the layer returns from what its other linears computed), where no name says them:
    every one of an outermost layer class no name gives any (OLMo-1's `attn_out` and `ff_out`, directly on its
    block: "cannot derive a policy" before), and the output projection of an attention whose fused projection only
    the probe found (InternLM2's `wo`, after `wqkv`). Where names give some, the rest of the flow's is left to them:
    across the 157 models of the architecture table, adding every one changed 6 verified policies (Gemma 4's per-layer
    projection, read beside an input every rank holds whole, would have been made row-parallel)."""
    from .attention import FUSED_QKV, SEPARATE_QKV, _attention_modules

    probe = active()
    if probe is None:
        return {}
    found: dict[str, tuple[str, ...]] = {}
    for name, kinds in layer_kinds(model).items():
        if name not in classes or name not in outermost_layer_classes(model):
            continue
        rows: set[str] = set()
        for layer in kinds:
            # the projections of the attentions only the probe found (fused, or separate under names no rule knows)
            unnamed = [] if name not in named else [f"{p}.{n}" if p else n for p, _, f, separate in
                                                    _attention_modules(layer) if (f and f not in FUSED_QKV) or (
                                                        separate and separate not in SEPARATE_QKV)
                                                    for n in ((f,) if f else separate)]
            flow = probe.flow(layer) if name not in named or unnamed else None
            if flow is None:
                continue
            if name not in named:
                rows |= set(flow.row_parallel())
                continue
            rows |= {r for r in flow.row_parallel() for p in unnamed
                     if ATTENTION in flow.sources.get(r, ()) and p in flow.sources[r]}
        rows = {r for r in rows if not any(names_module(k, r) for k in named.get(name, ()))}
        if rows:
            found[name] = tuple(sorted({*named.get(name, ()), *rows}))
            note("row-parallel linears", name, ", ".join(sorted(rows)) + " (probed: each writes back into what the "
                 "layer returns from what its other linears computed)")
    return found


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
