"""Per-head biases made outside the layers: a module of the model's own, outside every layer, holding a parameter or
buffer with one entry per head, whose output every layer's attention reads (JAIS's `relative_pe`: ALiBi slopes as a
[heads, 1] parameter, the bias [heads, queries, keys] made once and added to each layer's scores). Left whole, each
rank added every head's bias to its own heads' scores ("The size of tensor a (2) must match the size of tensor b (4)"
at tp 2). Each rank keeps its heads' part of the module's tensors and its head count attributes are set to its own
(`shard/biases.py`), whatever the module is called; DeepSpeed slices only a method named `get_alibi_mask`. The probe
tells that the module's output reaches the attention after its scores (`Probe.biases`): a rotary
table of as many frequencies as heads reaches the products' operands instead.

A bias for every head may also be made by the model's own forward, by code that no module holds (MPT's remote code
builds its ALiBi [1, heads, 1, keys] in the model's forward and passes it to each block as `attn_bias`): the layers'
inputs holding one entry per head on an axis that the attention adds after its scores (`Probe.head_inputs`) are
named in the policy's `head_inputs`, and each rank's layers cut them to its heads as they arrive
(`shard/biases.py`). Not where DeepSpeed already cuts such a bias, by the names of the methods it replaces."""

from __future__ import annotations

from torch import nn

from ..layers import layer_kinds
from ..schema import is_linear, outermost_layer_classes
from .heads import head_values
from .probe import active
from .verdicts import note

# (owner attribute, method) DeepSpeed's engine replaces by a head-sliced one (`InferenceEngine.build_alibi_tensor`,
# `build_attn_bias`): a bias they make arrives at the layers already cut
DEEPSPEED_SLICED = (("transformer", "build_alibi_tensor"), ("transformer", "build_mpt_alibi_tensor"),
                    ("transformer", "_attn_bias"), ("model", "get_alibi_mask"))


def head_axis(t, heads: int) -> int | None:
    """The first axis of `t` with one entry per head, or None."""
    return next((i for i, n in enumerate(t.shape) if n == heads), None)


def derive_head_biases(model: nn.Module, layers: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """Paths of the modules outside the layers making a per-head bias the layers read (see the module's docstring)."""
    probe = active()
    counts = head_values(model.config)
    if probe is None or counts is None or counts[0] < 2:
        return ()
    heads = counts[0]
    inside = {id(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for layer in lst for m in layer.modules()}
    candidates = []
    for path, module in model.named_modules():
        if not path or id(module) in inside or is_linear(module) or isinstance(module, (nn.Embedding, nn.ModuleList)):
            continue
        own = [*module._parameters.values(), *module._buffers.values()]
        if any(t is not None and t.ndim >= 1 and head_axis(t, heads) is not None for t in own):
            candidates.append(path)
    if not candidates:
        return ()
    outermost = outermost_layer_classes(model)
    first = next((kinds[0] for name, kinds in layer_kinds(model).items() if name in outermost and name in layers), None)
    found = tuple(sorted(probe.biases(first, candidates))) if first is not None else ()
    for path in found:
        note("per-head biases", path, f"makes a bias for each of the {heads} heads that the layers read (probed): each "
                                      "rank keeps its heads' part")
    return found


def derive_head_inputs(model: nn.Module, layers: dict[str, tuple[str, ...]], biases: tuple[str, ...]
                       ) -> dict[str, dict[str, int]]:
    """Per layer class: the inputs holding a bias for every head, by keyword name (or positional index), with their
    head axis (see the module's docstring); none where `head_biases` or DeepSpeed already cut the bias they carry."""
    probe = active()
    counts = head_values(model.config)
    if probe is None or counts is None or counts[0] < 2 or biases:
        return {}
    sliced = [f"{owner}.{method}" for owner, method in DEEPSPEED_SLICED
              if hasattr(getattr(model, owner, None), method)]
    if sliced:
        note("per-head biases", sliced[0], "made by a method DeepSpeed replaces by one cutting it to a rank's heads")
        return {}
    found = {}
    for name, kinds in layer_kinds(model).items():
        if name in layers:
            inputs = probe.head_inputs(kinds[0], counts[0])
            if inputs:
                found[name] = inputs
                note("per-head biases", name, f"input(s) {', '.join(f'{k} (axis {a})' for k, a in inputs.items())} "
                                              f"hold a bias for each of the {counts[0]} heads (probed): each rank's "
                                              "layers cut them to its heads")
    return found
