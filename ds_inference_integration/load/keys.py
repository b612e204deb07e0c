"""Which checkpoint tensor fills each parameter of a skeleton (`plan_keys`): the names renamed as
`from_pretrained` renames them, packed experts assembled from their per-expert tensors (`PackedSource`), Conv1D
weights marked as stored transposed, what the checkpoint lacks (initialised as `from_pretrained` does), and the
persistent buffers it holds; or the reason the checkpoint does not fit shard-aware loading."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .checkpoint import SafetensorsCheckpoint
from .skeleton import names_by_param, not_deferred, owners_of

PACKED_KEY = "<packed>"  # KeyPlan.key_of's key for a parameter built from several checkpoint tensors


@dataclass
class PackedSource:
    """A parameter transformers builds at load from several checkpoint tensors (packed experts): `keys[j][e]` is
    source pattern j's tensor of expert e; the parameter is those stacked over experts (MergeModulelist, dim 0),
    the patterns then concatenated along dim 1 (Concatenate: gate then up) when there are several."""

    keys: list[list[str]]

    def shape(self, ckpt: SafetensorsCheckpoint) -> tuple[int, ...]:
        first = tuple(ckpt.shape(self.keys[0][0]))
        return (len(self.keys[0]), sum(ckpt.shape(k[0])[0] for k in self.keys), *first[1:])


def _packing(converter) -> bool:
    """The conversions read here: experts stacked (MergeModulelist dim 0), then gate and up joined (Concatenate
    dim 1) or not; transformers applies them to every packed-experts family (conversion_mapping.py)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


class NeedsConversion(str):
    """A reason a checkpoint does not fit shard-aware reading: a tensor transformers converts at load (Ergo's
    `gate_kernel`, Kimi-Linear's convolutions), not only slices. `--loading auto` loads such a checkpoint full, and
    `policy check` does as it does, by this type rather than the reason's words."""


def _checkpoint_names(model: nn.Module, ckpt: SafetensorsCheckpoint
                      ) -> tuple[dict[str, str], dict[str, PackedSource], str | None]:
    """Model name -> checkpoint key, renamed the way `from_pretrained` renames them (transformers' own
    key renamings and base-model prefix); packed experts -> their per-expert tensors; a reason instead when a
    key needs another conversion."""
    import re

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta_state = dict(model.state_dict())
    out: dict[str, str] = {}
    parts: dict[str, dict[tuple[int, int], str]] = {}
    for key in ckpt.entries:
        name, pattern = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                          meta_state)
        if pattern is not None:
            converter = next((c for c in converters if pattern in getattr(c, "source_patterns", ())), None)
            expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
            if converter is None or not _packing(converter) or expert is None:
                return {}, {}, NeedsConversion(f"checkpoint tensor {key} needs conversion ({pattern}), not only slicing")
            parts.setdefault(name, {})[(converter.source_patterns.index(pattern), int(expert.group(1)))] = key
            continue
        out.setdefault(name, key)
    packed = {}
    for name, found in parts.items():
        patterns = sorted({j for j, _ in found})
        experts = sorted({e for _, e in found})
        if any((j, e) not in found for j in patterns for e in experts) or experts != list(range(len(experts))):
            return {}, {}, f"checkpoint tensors of {name} do not cover every expert of every part"
        packed[name] = PackedSource([[found[(j, e)] for e in experts] for j in patterns])
    return out, packed, None


@dataclass
class KeyPlan:
    key_of: dict[str, str]  # parameter name -> checkpoint key
    transposed: set[str]  # Conv1D weights, stored [in, out]
    missing: set[str]  # replicated parameters the checkpoint lacks (the model initialises them)
    buffers: dict[str, str]  # persistent buffers the checkpoint has
    packed: dict[str, PackedSource] = field(default_factory=dict)  # parameter name -> its per-expert tensors


def plan_keys(model: nn.Module, ckpt: SafetensorsCheckpoint) -> tuple[KeyPlan | None, str | None]:
    """Map every parameter of a skeleton to a checkpoint tensor of the right shape.
    Returns (plan, None) or (None, a reason why the checkpoint does not fit)."""
    key_by_name, packed, reason = _checkpoint_names(model, ckpt)
    if reason:
        return None, reason
    plan = KeyPlan({}, set(), set(), {})
    for name, source in packed.items():
        want = tuple(dict(model.named_parameters(remove_duplicate=False))[name].shape)
        if source.shape(ckpt) != want:
            return None, f"checkpoint tensors of {name} make shape {list(source.shape(ckpt))}, the model wants {list(want)}"
        key_by_name[name] = PACKED_KEY + name
        plan.packed[PACKED_KEY + name] = source
    for module_name, module in model.named_modules(remove_duplicate=False):
        if type(module).__name__ == "Conv1D":
            plan.transposed.add(f"{module_name}.weight" if module_name else "weight")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    params = dict(model.named_parameters(remove_duplicate=False))
    owners = owners_of(model)
    for group in names_by_param(model).values():
        found = next((key_by_name[n] for n in group if n in key_by_name), None)
        if found is None:
            if not not_deferred(None, owners[id(params[group[0]])]):
                return None, f"the checkpoint has no tensor for {group[0]}"
            plan.missing.update(group)
            continue
        if not found.startswith(PACKED_KEY) and tuple(ckpt.shape(found)) != shapes[group[0]]:
            return None, (f"checkpoint tensor {found} has shape {list(ckpt.shape(found))}, the model wants "
                          f"{list(shapes[group[0]])}")
        for name in group:
            plan.key_of[name] = found
    persistent = set(model.state_dict().keys())
    for name, buf in model.named_buffers():
        if name in persistent and name in key_by_name and tuple(ckpt.shape(key_by_name[name])) == tuple(buf.shape):
            plan.buffers[name] = key_by_name[name]
    return plan, None
