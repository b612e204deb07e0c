"""What a module is, for the policy (`derive`) and for the splits (`shard/`) alike: packed experts, a
mixture-of-experts router, a state-space or linear-attention mixer and its layout (see shard/mixers.py's
docstring for what each layout is and how it is split). Recognised from the module's own attributes and
shapes, never from its class name alone."""

from __future__ import annotations

import re

import torch
from torch import nn

from .schema import class_source

PACKED = ("gate_up_proj", "down_proj")


def is_packed_experts(module: nn.Module) -> bool:
    params = module._parameters
    return all(isinstance(params.get(n), torch.Tensor) and params[n].ndim == 3 for n in PACKED)


UNGATED = ("up_proj", "down_proj")
_EXPERT_AS_LINEAR = re.compile(r"linear\([^()]*self\.up_proj\[")  # F.linear(x, self.up_proj[e]): [experts, out, in]


def is_ungated_experts(module: nn.Module) -> bool:
    """Experts packed as two 3-D parameters without a gate, `up_proj` [experts, inner, hidden] and `down_proj`
    [experts, hidden, inner], each expert applied with `F.linear(x, W[e])` (NemotronH's MoE: Nemotron 3, and
    Nemotron-3.5-Transcribe's decoder). Not recognised, they were held whole on every rank as bare parameters (57%
    per rank at tp 2 for Nemotron-3.5-Transcribe's tiny model, `policy sweep` 2026-12-07). A module with a third 3-D
    parameter (a gate apart) is not: its gate would stay whole beside a split up."""
    params = {n: p for n, p in module._parameters.items() if isinstance(p, torch.Tensor)}
    if "gate_up_proj" in params or not all(n in params and params[n].ndim == 3 for n in UNGATED):
        return False
    if sum(p.ndim == 3 for p in params.values()) != 2:
        return False
    up, down = params["up_proj"].shape, params["down_proj"].shape
    return (up[0] == down[0] and up[1] == down[2] and up[2] == down[1]
            and bool(_EXPERT_AS_LINEAR.search(class_source(type(module)))))


EXPERT_COUNTS = ("num_experts", "moe_num_experts", "num_local_experts")
EXPERT_INNER = ("ffn_hidden_size", "expert_dim", "moe_intermediate_size", "intermediate_size")


def row_packed_experts(module: nn.Module) -> tuple[int, int, list[str]] | None:
    """(experts, inner size, parameter paths) of experts packed as 2-D parameters that are all [experts x inner,
    hidden], each expert's rows one block (DBRX's `w1`, `v1` and `w2`, the last stored transposed: its forward views
    each as [experts, inner, hidden]), where the module records both counts and holds no linear; else None. Every
    such parameter splits alike, by each expert's inner rows (`shard.experts.split_row_packed_experts`)."""
    def count(names: tuple[str, ...]) -> int | None:
        return next((v for a in names if isinstance(v := getattr(module, a, None), int) and not isinstance(v, bool)
                     and v > 0), None)

    experts, inner = count(EXPERT_COUNTS), count(EXPERT_INNER)
    if experts is None or inner is None or any(isinstance(m, nn.Linear) for m in module.modules()):
        return None
    params = list(module.named_parameters())
    if len(params) < 2 or any(p.ndim != 2 or p.shape[0] != experts * inner for _, p in params):
        return None
    if len({p.shape[1] for _, p in params}) != 1:
        return None
    return experts, inner, [n for n, _ in params]


def experts_in_two_modules(module: nn.Module) -> tuple[str, str] | None:
    """(the [gate | up] child's name, the down child's name) of experts held by two child modules of one 3-D
    `weight` each, [experts, 2 x inner, hidden] and [experts, hidden, inner], the first's output read as halves
    (JetMoE's MoE: `input_linear` and `output_linear`, `JetMoeParallelExperts`, applied with `F.linear(x, W[e])`);
    else None. Not recognised, JetMoE was refused: nothing a rule splits. Its mixture of attention heads holds two
    such modules too, without a gate ([experts, kv width, hidden], [experts, hidden, kv width]): not these."""
    held = {n: c for n, c in module.named_children() if list(c._parameters) == ["weight"]
            and isinstance(c.weight, torch.Tensor) and c.weight.ndim == 3 and not any(True for _ in c.children())}
    if len(held) != 2 or not _CHUNKED_HALVES.search(class_source(type(module))):
        return None
    (a, first), (b, second) = held.items()
    if first.weight.shape[1] != 2 * second.weight.shape[2]:
        (a, first), (b, second) = (b, second), (a, first)
    up, down = first.weight.shape, second.weight.shape
    if up[0] == down[0] and up[1] == 2 * down[2] and up[2] == down[1]:
        return a, b
    return None


def is_experts(module: nn.Module) -> bool:
    """Packed experts of any form: 3-D gate_up_proj and down_proj, 3-D up_proj and down_proj without a gate
    (`is_ungated_experts`), two modules of one 3-D weight each (`experts_in_two_modules`), or 2-D row-packed
    (`row_packed_experts`)."""
    return (is_packed_experts(module) or is_ungated_experts(module) or experts_in_two_modules(module) is not None
            or row_packed_experts(module) is not None)


ROUTER_NAMES = ("gate", "router", "shared_expert_gate", "shared_experts_gate", "expert_bias")


def is_router(path: str, module: nn.Module) -> bool:
    """A mixture-of-experts router or gate (kept whole: each rank must route every token to the same experts),
    by its name in the layer (`mlp.gate`, `block_sparse_moe.router.layer`) or its class (`...TopkRouter`)."""
    parts = path.split(".")
    return (any(p in ROUTER_NAMES for p in parts[-2:]) or "Router" in type(module).__name__
            or type(module).__name__.endswith("Gate"))


PER_HEAD = ("A_log", "D", "dt_bias")  # a mamba2 mixer's parameters with one value per head
SIZES = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim")


def ssm_sizes(module: nn.Module) -> tuple[int, ...] | None:
    values = tuple(getattr(module, a, None) for a in SIZES)
    return values if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values) else None


def ssm_layout(module: nn.Module) -> str | None:
    """"mamba2", "mamba", "delta_net" or "short_conv" for a mixer of that layout (see the module docstring), else
    None."""
    return ("mamba2" if _is_mamba2(module) else "mamba" if _is_mamba(module) else
            "delta_net" if delta_net_sizes(module) else "short_conv" if _is_short_conv(module) else
            "lightning" if _is_lightning(module) else "packed_mlp" if packed_mlp_names(module) else None)


# a forward that reads its first linear's output as two halves: `.chunk(2, dim=-1)` (Moonshine), or a view of its last
# axis as [2, -1] (Moshi's and Kyutai's gating MLPs: `.view(batch_size, sequence_length, 2, -1)`, then [..., 0, :] and
# [..., 1, :]; their MLPs were kept whole on every rank, "no row-parallel linear gathers what fc1, fc2 compute")
_CHUNKED_HALVES = re.compile(r"\.chunk\(\s*2\s*,\s*dim\s*=\s*-1\s*\)|\.view\([^()]*,\s*2\s*,\s*-1\s*\)")


def packed_mlp_names(module: nn.Module) -> tuple[str, str] | None:
    """(the [gate | up] linear's name, the output linear's name) of an MLP of two linears whose first packs gate and
    up as halves (its forward chunks that output in two), else None."""
    linears = {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}
    if len(linears) != 2 or module._parameters or any(p is not None for n, c in module.named_children()
                                                        if n not in linears for p in c.parameters()):
        return None
    (a, first), (b, second) = linears.items()
    if first.weight.shape[0] != 2 * second.weight.shape[1]:
        (a, first), (b, second) = (b, second), (a, first)
    if (first.weight.shape[0] != 2 * second.weight.shape[1] or second.weight.shape[0] != first.weight.shape[1]
            or "gate_up_proj" in a or not _CHUNKED_HALVES.search(class_source(type(module)))):
        return None
    return a, b


LIGHTNING_DECAYS = {"slope_rate": 0, "query_decay": 0, "key_decay": 0, "diagonal_decay": 1}  # buffer: its head axis


def _is_lightning(module: nn.Module) -> bool:
    heads, head_dim = getattr(module, "num_attention_heads", None), getattr(module, "head_dim", None)
    if not (isinstance(heads, int) and isinstance(head_dim, int) and heads > 0 and head_dim > 0):
        return False
    parts = [getattr(module, n, None) for n in ("qkv_proj", "output_gate", "out_proj")]
    norm = getattr(module, "norm", None)
    if not all(isinstance(m, nn.Linear) for m in parts) or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        return False
    width = heads * head_dim
    qkv, gate, out = parts
    decays = [module._buffers.get(n) for n in LIGHTNING_DECAYS]
    return (qkv.weight.shape[0] == 3 * width and gate.weight.shape[0] == width and out.weight.shape[1] == width
            and tuple(norm.weight.shape) == (width,)
            and all(isinstance(b, torch.Tensor) and b.shape[axis] == heads for b, axis in zip(decays, LIGHTNING_DECAYS.values())))


DELTA_SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_dim")
# each layout's input projections and their widths, as functions of (Kh, Vh, dk, dv)
DELTA_PROJECTIONS = {
    "grouped": {"in_proj_qkvz": lambda kh, vh, dk, dv: 2 * kh * dk + 2 * vh * dv, "in_proj_ba": lambda kh, vh, dk, dv: 2 * vh},
    "separate": {"in_proj_qkv": lambda kh, vh, dk, dv: 2 * kh * dk + vh * dv, "in_proj_z": lambda kh, vh, dk, dv: vh * dv,
                 "in_proj_b": lambda kh, vh, dk, dv: vh, "in_proj_a": lambda kh, vh, dk, dv: vh},
}


def delta_net_sizes(module: nn.Module) -> tuple[str, tuple[int, ...]] | None:
    """(projection layout, sizes) of a gated delta net, else None."""
    sizes = tuple(getattr(module, a, None) for a in DELTA_SIZES)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        return None
    kh, vh, dk, dv, key_dim, value_dim, conv_dim = sizes
    conv, out = getattr(module, "conv1d", None), getattr(module, "out_proj", None)
    if (vh % kh or key_dim != kh * dk or value_dim != vh * dv or conv_dim != 2 * key_dim + value_dim
            or not isinstance(conv, nn.Conv1d) or conv.weight.shape[0] != conv_dim or not isinstance(out, nn.Linear)
            or out.weight.shape[1] != value_dim):
        return None
    if not all(isinstance(module._parameters.get(n), torch.Tensor) and tuple(module._parameters[n].shape) == (vh,)
               for n in ("A_log", "dt_bias")):
        return None
    for layout, projections in DELTA_PROJECTIONS.items():
        linears = [getattr(module, n, None) for n in projections]
        if all(isinstance(m, nn.Linear) and m.weight.shape[0] == width(kh, vh, dk, dv)
               for m, width in zip(linears, projections.values())):
            return layout, sizes
    return None


def _is_short_conv(module: nn.Module) -> bool:
    children = dict(module.named_children())
    in_proj, conv, out_proj = (children.get(n) for n in ("in_proj", "conv", "out_proj"))
    if set(children) != {"in_proj", "conv", "out_proj"} or module._parameters:
        return False
    if not (isinstance(in_proj, nn.Linear) and isinstance(conv, nn.Conv1d) and isinstance(out_proj, nn.Linear)):
        return False
    width = conv.weight.shape[0]
    return conv.groups == width and in_proj.weight.shape[0] == 3 * width and out_proj.weight.shape[1] == width


def is_ssm_mixer(module: nn.Module) -> bool:
    return ssm_layout(module) is not None


def _is_mamba(module: nn.Module) -> bool:
    inner, state, rank = (getattr(module, a, None) for a in ("intermediate_size", "ssm_state_size", "time_step_rank"))
    if not all(isinstance(v, int) and v > 0 for v in (inner, state, rank)):
        return False
    parts = [getattr(module, n, None) for n in ("in_proj", "x_proj", "dt_proj", "out_proj")]
    conv, a_log, d = getattr(module, "conv1d", None), module._parameters.get("A_log"), module._parameters.get("D")
    if not all(isinstance(m, nn.Linear) for m in parts) or not isinstance(conv, nn.Conv1d):
        return False
    in_proj, x_proj, dt_proj, out_proj = parts
    return (tuple(in_proj.weight.shape)[0] == 2 * inner and tuple(x_proj.weight.shape) == (rank + 2 * state, inner)
            and tuple(dt_proj.weight.shape) == (inner, rank) and out_proj.weight.shape[1] == inner
            and conv.weight.shape[0] == inner and conv.groups == inner and isinstance(a_log, torch.Tensor)
            and tuple(a_log.shape) == (inner, state) and isinstance(d, torch.Tensor) and tuple(d.shape) == (inner,))


def _is_mamba2(module: nn.Module) -> bool:
    sizes = ssm_sizes(module)
    if sizes is None:
        return False
    heads, head_dim, groups, state, inner, conv_dim = sizes
    in_proj, conv, out_proj = (getattr(module, n, None) for n in ("in_proj", "conv1d", "out_proj"))
    if not (isinstance(in_proj, nn.Linear) and isinstance(conv, nn.Conv1d) and isinstance(out_proj, nn.Linear)):
        return False
    per_head = [module._parameters.get(n) for n in PER_HEAD]
    return (inner == heads * head_dim and conv_dim == inner + 2 * groups * state
            and in_proj.weight.shape[0] == inner + conv_dim + heads and out_proj.weight.shape[1] == inner
            and conv.weight.shape[0] == conv_dim and conv.groups == conv_dim
            and all(isinstance(p, torch.Tensor) and tuple(p.shape) == (heads,) for p in per_head))
