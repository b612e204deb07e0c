"""What a model's repeated layers are made of, read from the modules alone: a leaf of the package (it imports none
of it), so that `policy.schema`, `policy.derive`, `policy.verify` and `deepspeed_compat`'s parse of AutoTP all read
one definition (`deepspeed_compat` took `layer_kind` from `policy.schema`, which takes `head_grain` from it: an
import cycle through an import inside a function)."""

from __future__ import annotations

from torch import nn


def layer_kind(module: nn.Module) -> tuple:
    """What a layer is made of: each submodule's path and class, and each parameter's name and shape. Two layers
    of one class can differ (DeepSeek-V3's, GLM-4-MoE's and dots1's first `first_k_dense_replace` layers hold a
    dense MLP, the rest experts; a hybrid's layers hold attention or a linear-attention mixer by `layer_types`):
    each kind is derived, split and checked on its own."""
    return tuple((path, type(m).__name__, tuple((n, tuple(p.shape)) for n, p in m._parameters.items()
                                                if p is not None))
                 for path, m in module.named_modules())


def layer_kinds(model: nn.Module) -> dict[str, list[nn.Module]]:
    """{layer class name: the first layer of each distinct kind (`layer_kind`) of that class, in model order}."""
    found: dict[str, list[nn.Module]] = {}
    seen: set[tuple] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                kind = (type(child).__name__, layer_kind(child))
                if kind not in seen:
                    seen.add(kind)
                    found.setdefault(type(child).__name__, []).append(child)
    return found
