"""Small helpers every mechanism of the derivation reads: a module's linears, whether a linear is row-parallel, the
refusal of a model no rule fits, and parameters that are not linears."""

from __future__ import annotations

import torch
from torch import nn

from ...errors import InferenceSetupError
from ..schema import is_linear, names_module


def _cannot_derive(model_type: str, why: str, suggest: bool = True) -> InferenceSetupError:
    how = ("`ds-inference policy suggest MODEL_DIR > my_policy.toml`, edit it, then --injection_policy my_policy.toml"
           if suggest else "in a policy file (docs/policies.md, \"A model with its own code\"), then --injection_policy "
                           "FILE")
    return InferenceSetupError(f"cannot derive a policy for model_type {model_type!r}: {why}; write one: {how}")


def _linears(module: nn.Module) -> dict[str, nn.Module]:
    return {p: m for p, m in module.named_modules() if p and is_linear(m)}


def _row_parallel(where: str, q: str, rows: set[str]) -> bool:
    """Whether the linear at `q` inside the layer's module at `where` ("" for the layer itself) is row-parallel:
    named by the layer's rows, or a `down_proj`, which DeepSpeed makes row-parallel whatever the policy says
    (deepspeed_compat's note)."""
    return "down_proj" in q or any(names_module(r, f"{where}.{q}" if where else q) for r in rows)


def _feature_scales(module: nn.Module, widths: set[int]) -> list[str]:
    """The module's own 1-D parameters of one of `widths` (a value per feature a split linear writes: Dory's `sqk`,
    `s_gate`, `suv_gate`), which neither DeepSpeed nor a table splits."""
    return [n for n, t in module._parameters.items() if isinstance(t, torch.Tensor) and t.ndim == 1
            and t.shape[0] in widths]


BARE_PARAMETERS = "its weights are bare parameters, not linears: DeepSpeed splits linears only"


def _bare_parameters(module: nn.Module) -> bool:
    """Whether the module holds weights (2-D or more) and no linear, nor is one."""
    return not _linears(module) and not is_linear(module) and any(p.ndim >= 2 for p in module.parameters())
