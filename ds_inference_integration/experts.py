"""Mixture-of-experts layers split across the TP ranks: every expert's MLP split, the router replicated.

transformers 5 packs a layer's experts into two 3-D parameters (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and the
families that share their code): `gate_up_proj` [experts, 2 x inner, hidden] (each expert's gate rows, then its
up rows) and `down_proj` [experts, hidden, inner], applied with `F.linear(x, W[e])`. DeepSpeed splits only
`nn.Linear`s, so these stay whole under it: every rank would hold and compute every expert.

Here each rank keeps, of every expert, the same 1/tp of the inner dimension: its gate rows and the matching up
rows (so `chunk(2)` in the forward still pairs them), and those columns of `down_proj`. Each rank's expert
output is then a partial sum over the inner dimension, and the routing weights scale it linearly, so one
all-reduce of the experts module's output over the TP group gives the unsharded result (a forward hook, with
DeepSpeed's own inference all-reduce, as its row-parallel linears use). The router (a bare weight, or a linear
DeepSpeed skips by name) is not split.

Each split parameter records which rows or columns of the packed tensor it holds (`expert_slices`), read by
shard-aware loading to convert, from the checkpoint's per-expert tensors, only this rank's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .errors import InferenceSetupError

PACKED = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertSlices:
    """Of a packed expert parameter, this rank's part: along `dim` (1: gate_up's rows, 2: down's columns), the
    ranges it keeps, in order (gate_up: this rank's gate rows, then its up rows)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full_shape: tuple[int, ...]


def is_packed_experts(module: nn.Module) -> bool:
    params = module._parameters
    return all(isinstance(params.get(n), torch.Tensor) and params[n].ndim == 3 for n in PACKED)


def split_experts(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    """Keep this rank's 1/tp of every expert's inner dimension (in place; meta tensors stay meta) and all-reduce
    the module's output over `group`."""
    gate_up, down = module.gate_up_proj, module.down_proj
    experts, hidden, inner = down.shape
    if tuple(gate_up.shape) != (experts, 2 * inner, hidden):
        raise InferenceSetupError(
            f"{type(module).__name__}: packed experts of shapes gate_up_proj {list(gate_up.shape)} and down_proj "
            f"{list(down.shape)} are not [experts, 2 x inner, hidden] and [experts, hidden, inner]; write a policy "
            "without `experts` for it")
    if inner % tp_size:
        valid = [d for d in range(1, inner + 1) if inner % d == 0 and d <= 64]
        raise InferenceSetupError(f"{type(module).__name__}: the experts' inner size {inner} is not divisible by "
                                  f"--tp_size {tp_size}; valid tp sizes: {', '.join(map(str, valid))}")
    part = inner // tp_size
    a, b = tp_rank * part, (tp_rank + 1) * part
    rows = ((a, b), (inner + a, inner + b))
    with torch.no_grad():
        local_gate_up = torch.cat([gate_up[:, s:e] for s, e in rows], dim=1)
        local_down = down[:, :, a:b]
    module.gate_up_proj = nn.Parameter(local_gate_up.contiguous(), requires_grad=False)
    module.down_proj = nn.Parameter(local_down.contiguous(), requires_grad=False)
    module.gate_up_proj.expert_slices = ExpertSlices(1, rows, tuple(gate_up.shape))
    module.down_proj.expert_slices = ExpertSlices(2, ((a, b),), tuple(down.shape))
    for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
        if isinstance(getattr(module, attr, None), int) and getattr(module, attr) == inner:
            setattr(module, attr, part)
    if tp_size > 1:
        module.register_forward_hook(_all_reduce_output(group))


def _all_reduce_output(group):
    def hook(module, args, output):
        from deepspeed import comm as dist

        dist.inference_all_reduce(output, group=group)
        return output

    return hook


def experts_modules(layer: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
    from .policy import names_module

    found = []
    for name, module in layer.named_modules():
        if name and any(names_module(p, name) for p in paths):
            if not is_packed_experts(module):
                raise InferenceSetupError(f"experts {name!r} in {type(layer).__name__} holds no packed gate_up_proj "
                                          "and down_proj parameters")
            found.append(module)
    return found
