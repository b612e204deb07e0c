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

Each split parameter records which rows or columns of the packed tensor it holds (`tensor_slices`), read by
shard-aware loading to convert, from the checkpoint's per-expert tensors, only this rank's part.

The other layouts split alike, by each expert's inner rows: 2-D row-packed experts (DBRX), experts without a gate
(NemotronH's `up_proj` and `down_proj`) and experts held by two modules of their own (JetMoE's `input_linear` and
`output_linear`); `kinds.is_experts` recognises each.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InferenceSetupError
from ..load.slices import record, take
from ..policy.kinds import experts_in_two_modules, is_experts, is_packed_experts, is_ungated_experts


def expert_layout(module: nn.Module) -> tuple[bool, bool]:
    """(transposed, interleaved) of a packed experts module, from transformers' own record where its
    `use_experts_implementation` decorator left one (`is_transposed`, `is_concatenated` on the instance: GPT-OSS
    is transposed and interleaved, [gate_0, up_0, gate_1, ...]), else from the shapes: gate_up_proj
    [experts, 2 x inner, hidden] with down_proj [experts, hidden, inner] (Mixtral, Qwen-MoE, OLMoE), or
    [experts, hidden, 2 x inner] with [experts, inner, hidden] (Llama 4), [gate | up] halves. One
    `InferenceSetupError` naming the shapes and the layouts known otherwise."""
    gate_up, down = module.gate_up_proj.shape, module.down_proj.shape
    standard = gate_up[1] == 2 * down[2] and gate_up[2] == down[1]
    transposed = gate_up[2] == 2 * down[1] and gate_up[1] == down[2]
    recorded = getattr(module, "is_transposed", None)
    if isinstance(recorded, bool) and (transposed if recorded else standard):
        return recorded, getattr(module, "is_concatenated", True) is False
    if standard != transposed:
        return transposed, False
    raise InferenceSetupError(
        f"{type(module).__name__}: packed experts of shapes gate_up_proj {list(gate_up)} and down_proj {list(down)} "
        "are in no known layout; known: [experts, 2 x inner, hidden] with [experts, hidden, inner], and "
        "[experts, hidden, 2 x inner] with [experts, inner, hidden] (gate and up as halves, or interleaved where "
        "transformers records `is_concatenated=False`); write a policy without `experts` for it")


def split_experts(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    """Keep this rank's 1/tp of every expert's inner dimension (in place; meta tensors stay meta) and all-reduce
    the module's output over `group`. Per-expert biases: gate_up's split with it; down's (added after the
    partial product, so once per rank) kept on the first rank of the group and zero on the others."""
    if is_ungated_experts(module):
        return split_ungated_experts(module, tp_size, tp_rank, group)
    if experts_in_two_modules(module):
        return split_experts_in_two_modules(module, tp_size, tp_rank, group)
    if not is_packed_experts(module):
        return split_row_packed_experts(module, tp_size, tp_rank, group)
    transposed, interleaved = expert_layout(module)
    gate_up, down = module.gate_up_proj, module.down_proj
    inner = down.shape[1] if transposed else down.shape[2]
    part = _part(module, inner, tp_size)
    a, b = tp_rank * part, (tp_rank + 1) * part
    # gate_up's inner axis: rows of this rank's gate then its up (halves), or its [gate, up] pairs (interleaved)
    rows = ((2 * a, 2 * b),) if interleaved else ((a, b), (inner + a, inner + b))
    up_dim, down_dim = (2, 1) if transposed else (1, 2)

    with torch.no_grad():
        local_gate_up, local_down = take(gate_up, up_dim, rows), take(down, down_dim, ((a, b),))
    module.gate_up_proj = nn.Parameter(local_gate_up, requires_grad=False)
    module.down_proj = nn.Parameter(local_down, requires_grad=False)
    record(module.gate_up_proj, up_dim, rows, tuple(gate_up.shape))
    record(module.down_proj, down_dim, ((a, b),), tuple(down.shape))
    bias = module._parameters.get("gate_up_proj_bias")
    if isinstance(bias, torch.Tensor):
        with torch.no_grad():
            module.gate_up_proj_bias = nn.Parameter(take(bias, 1, rows), requires_grad=False)
        record(module.gate_up_proj_bias, 1, rows, tuple(bias.shape))
    bias = module._parameters.get("down_proj_bias")
    if isinstance(bias, torch.Tensor) and tp_rank > 0:
        with torch.no_grad():
            module.down_proj_bias = nn.Parameter(torch.zeros_like(bias), requires_grad=False)
        record(module.down_proj_bias, 1, (), tuple(bias.shape))  # no part: zeros
    _inner_size_is(module, inner, part)
    _reduce_output(module, tp_size, group)


def split_ungated_experts(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    """Experts without a gate (`kinds.is_ungated_experts`: up_proj [experts, inner, hidden], down_proj [experts,
    hidden, inner]): each rank keeps, of every expert, the same 1/tp of the inner rows of up_proj and those columns
    of down_proj, its output a partial sum all-reduced as `split_experts`'s."""
    up, down = module.up_proj, module.down_proj
    inner = up.shape[1]
    part = _part(module, inner, tp_size)
    mine = ((tp_rank * part, (tp_rank + 1) * part),)
    with torch.no_grad():
        module.up_proj = nn.Parameter(take(up, 1, mine), requires_grad=False)
        module.down_proj = nn.Parameter(take(down, 2, mine), requires_grad=False)
    record(module.up_proj, 1, mine, tuple(up.shape))
    record(module.down_proj, 2, mine, tuple(down.shape))
    _inner_size_is(module, inner, part)
    _reduce_output(module, tp_size, group)


def split_experts_in_two_modules(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    """Experts held by two child modules (`kinds.experts_in_two_modules`: JetMoE's `input_linear` [experts, 2 x inner,
    hidden] and `output_linear` [experts, hidden, inner]): each rank keeps, of every expert, its gate rows and the
    matching up rows of the first, those columns of the second; the module's own bias added to the output ([hidden],
    after the experts' partial sums) stays on the group's first rank, zero on the others; the output all-reduced as
    `split_experts`'s."""
    first, second = (getattr(module, n) for n in experts_in_two_modules(module))
    up, down = first.weight, second.weight
    inner = down.shape[2]
    part = _part(module, inner, tp_size)
    a, b = tp_rank * part, (tp_rank + 1) * part
    rows = ((a, b), (inner + a, inner + b))
    with torch.no_grad():
        first.weight = nn.Parameter(take(up, 1, rows), requires_grad=False)
        second.weight = nn.Parameter(take(down, 2, ((a, b),)), requires_grad=False)
    record(first.weight, 1, rows, tuple(up.shape))
    record(second.weight, 2, ((a, b),), tuple(down.shape))
    for child, sizes in ((first, {"output_size": 2 * inner}), (second, {"input_size": inner})):
        for attr, full in sizes.items():
            if getattr(child, attr, None) == full:
                setattr(child, attr, full * part // inner)
    hidden = up.shape[2]
    for name, bias in list(module._parameters.items()):
        if isinstance(bias, torch.Tensor) and bias.ndim == 1 and bias.shape[0] == hidden and tp_rank > 0:
            with torch.no_grad():
                setattr(module, name, nn.Parameter(torch.zeros_like(bias), requires_grad=False))
            record(getattr(module, name), 0, (), tuple(bias.shape))  # no part: zeros
    _reduce_output(module, tp_size, group)


def _inner_size_is(module: nn.Module, inner: int, part: int) -> None:
    """The module's own record of its experts' inner size, where it keeps one, made this rank's."""
    for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
        if isinstance(getattr(module, attr, None), int) and getattr(module, attr) == inner:
            setattr(module, attr, part)


def _part(module: nn.Module, inner: int, tp_size: int) -> int:
    """Each rank's share of the experts' inner size; one `InferenceSetupError` where tp does not divide it."""
    if inner % tp_size:
        valid = [d for d in range(1, inner + 1) if inner % d == 0 and d <= 64]
        raise InferenceSetupError(f"{type(module).__name__}: the experts' inner size {inner} is not divisible by "
                                  f"--tp_size {tp_size}; valid tp sizes: {', '.join(map(str, valid))}")
    return inner // tp_size


def _reduce_output(module: nn.Module, tp_size: int, group) -> None:
    """The experts module's output, a partial sum over the inner dimension on each rank, all-reduced over `group`."""
    if tp_size > 1:
        module.all_reduce_dtype = None  # the output's own; reduction.reduce_in_fp32 sets fp32
        module.register_forward_hook(_all_reduce_output(group))


def split_row_packed_experts(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    """Experts packed as 2-D [experts x inner, hidden] parameters (`kinds.row_packed_experts`: DBRX's w1, v1, w2):
    each rank keeps, of every expert, the same 1/tp of its inner rows in each of them (gate and up rows pair, and
    the transposed down's rows are the inner columns it reads), so each rank's output is a partial sum over the
    inner dimension, all-reduced as `split_experts`'s. Every `inner` size recorded in the module becomes this
    rank's (DBRX views each parameter as [-1, ffn_hidden_size, hidden]: with the full size it read half the
    experts)."""
    from ..policy.kinds import EXPERT_INNER, row_packed_experts

    experts, inner, names = row_packed_experts(module)
    part = _part(module, inner, tp_size)
    rows = tuple((e * inner + tp_rank * part, e * inner + (tp_rank + 1) * part) for e in range(experts))
    for name in names:
        owner, _, attr = name.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        full = getattr(holder, attr)
        with torch.no_grad():
            setattr(holder, attr, nn.Parameter(take(full, 0, rows), requires_grad=False))
        record(getattr(holder, attr), 0, rows, tuple(full.shape))
    for sub in module.modules():
        for attr in EXPERT_INNER:
            if getattr(sub, attr, None) == inner and not isinstance(getattr(sub, attr), bool):
                setattr(sub, attr, part)
    _reduce_output(module, tp_size, group)


def _all_reduce_output(group):
    def hook(module, args, output):
        from deepspeed import comm as dist

        if module.all_reduce_dtype is None or output.dtype == module.all_reduce_dtype:
            dist.inference_all_reduce(output, group=group)
            return output
        wide = output.to(module.all_reduce_dtype)
        dist.inference_all_reduce(wide, group=group)
        return wide.to(output.dtype)

    return hook


def experts_modules(layer: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
    from ..policy.schema import names_module

    found = []
    for name, module in layer.named_modules():
        if name and any(names_module(p, name) for p in paths):
            if not is_experts(module):
                raise InferenceSetupError(f"experts {name!r} in {type(layer).__name__} holds no packed experts; valid: "
                                          "3-D gate_up_proj and down_proj, 3-D up_proj and down_proj, two modules of "
                                          "one 3-D weight each, or 2-D [experts x inner, hidden] parameters")
            found.append(module)
    return found
