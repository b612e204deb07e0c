"""The weight share a run promises: what each rank should hold of the layers' weights, and what it holds.

People shard to fit a model: a rank that silently keeps whole what should have been split (the experts of a
dense-first MoE's later layers, before each layer kind was derived: 75% of the weights per rank at tp 2) has
lost half the reason. So every weight of two or more dimensions under a layer the policy names gets what this
rank should hold of it:

* all of it, by design: under a module the policy keeps whole (`replicated`: a ColumnShard of all its rows),
  or one DeepSpeed's AutoTP keeps whole on purpose (MoE routers, DeepSeek's low-rank projections:
  `deepspeed_compat.autotp_keeps_whole`);
* what our own split chose (a `ColumnShard` of attention heads: with fewer KV heads than ranks, a copy of one
  KV head, 1/kv of the projection);
* else 1/tp of it.

The target is the sum of those over the sum of the full weights. A rank holding more than the target plus
`TOLERANCE` is warned about in one line naming the modules held whole that no design keeps whole ("not placed").
`policy check` measures against the same target.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from ..policy.kinds import is_router

TOLERANCE = 0.05  # of the target: DeepSpeed splits some linears in blocks of 64, which can leave ranks uneven


@dataclass
class WeightShare:
    """This rank's share of the layer weights (elements, so dtype-independent), the target, and what is whole."""

    held: int
    full: int
    target_elements: float
    by_design: dict[str, str] = field(default_factory=dict)  # module path in its layer class -> why it is whole
    not_placed: list[str] = field(default_factory=list)  # module paths in their layer class, held whole unplanned

    @property
    def share(self) -> float:
        return self.held / max(self.full, 1)

    @property
    def target(self) -> float:
        return self.target_elements / max(self.full, 1)

    def over_target(self) -> bool:
        return self.share > self.target * (1 + TOLERANCE)

    def warning(self, tp_size: int) -> str:
        designed = "; ".join(f"{p} ({why})" for p, why in sorted(self.by_design.items())) or "none"
        unplanned = ", ".join(self.not_placed) or "none named (uneven splits)"
        return (f"this rank holds {self.share:.0%} of the layer weights, over the target {self.target:.0%} at tp "
                f"{tp_size} (+{TOLERANCE:.0%}): held whole and not placed: {unplanned}; whole by design: {designed}"
                "; a policy can declare a module whole (`replicated`) or split it (`ds-inference policy suggest`)")


def layer_modules(model: nn.Module, patterns) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module whose class matches one of the policy's layer patterns."""
    return [(path, m) for path, m in model.named_modules()
            if any(fnmatch.fnmatchcase(type(m).__name__, p) for p in patterns)]


def full_sizes(model: nn.Module, patterns) -> dict[str, int]:
    """{parameter path: elements} of every weight (2-D and up) under the layers, before sharding (a skeleton's
    meta parameters have their shapes)."""
    sizes: dict[str, int] = {}
    for path, layer in layer_modules(model, patterns):
        for name, p in layer.named_parameters():
            if p.ndim >= 2:
                sizes.setdefault(f"{path}.{name}", p.numel())
    return sizes


def measure(model: nn.Module, patterns, before: dict[str, int], tp_size: int, policy=None) -> WeightShare:
    """This rank's WeightShare after sharding, against `before` (`full_sizes` of the same model)."""
    from ..deepspeed_compat import autotp_keeps_whole
    from ..policy.schema import under_replicated

    held = full = 0
    target = 0.0
    by_design: dict[str, str] = {}
    not_placed: dict[str, None] = {}
    for path, layer in layer_modules(model, patterns):
        kind = type(layer).__name__
        replicated = [p for pattern, paths in (getattr(policy, "replicated", None) or {}).items()
                      if fnmatch.fnmatchcase(kind, pattern) for p in paths]
        for module_path, module in layer.named_modules():
            for name, p in module.named_parameters(recurse=False):
                key = f"{path}.{module_path}.{name}" if module_path else f"{path}.{name}"
                if p.ndim < 2 or key not in before:
                    continue
                whole, now = before[key], p.numel()
                held, full = held + now, full + whole
                shown = f"{kind}.{module_path}" if module_path else kind
                under = next((r for r in replicated if under_replicated(r, layer, module_path)), None)
                if under is not None:  # named as the policy names it: the module kept whole, not each linear in it
                    expected, why, shown = whole, "replicated by the policy", f"{kind}.{under.partition('@')[0]}"
                elif autotp_keeps_whole(module_path):
                    expected, why = whole, "kept whole by DeepSpeed AutoTP (a router or low-rank projection)"
                elif is_router(module_path, module):
                    expected, why = whole, "a router: every rank routes every token"
                elif type(module).__name__ == "ColumnShard":
                    expected, why = now, ("a copy of its KV heads" if now < whole else "kept whole by the split")
                elif getattr(p, "tensor_slices", None) is not None:  # what experts.split_experts chose
                    expected, why = now, ("a per-expert bias added after the all-reduce's partial sums: whole on "
                                          "the group's first rank, zeros on the others" if now == whole else None)
                else:
                    expected, why = whole / tp_size, None
                target += expected
                if why and now == whole:
                    by_design.setdefault(shown, why)
                elif why is None and tp_size > 1 and now >= whole:
                    not_placed.setdefault(shown, None)
    return WeightShare(held, full, target, by_design, list(not_placed))
