"""State-space mixers split by their heads (Mamba2's mixer and the hybrids built on it: Bamba, Falcon-H1,
Nemotron-H, Granite-4 hybrids, Zamba2) or by their channels (Mamba's, and Jamba's).

Such a mixer projects the input once into packed streams, `in_proj` -> [z | x | B | C | dt] (widths I, I, G x N,
G x N, H: I = H heads x P head dim, G groups of B and C with N state features each), runs a depthwise
convolution over [x | B | C], a selective scan per head (A_log, D, dt_bias: one value per head), a gated RMS norm
over each group's I / G features, and `out_proj` back to the model's width. AutoTP would cut `in_proj` by output
rows across the streams, so it is split here, as the attention table splits heads:

* each rank keeps H / tp heads: their rows of z, x and dt, their conv channels, A_log, D, dt_bias and norm weight;
* B and C by group: G / tp groups per rank where tp divides G; where G < tp (G divides tp), each rank keeps a
  copy of the group its heads read, as ranks share a KV head when there are fewer KV heads than ranks;
* `out_proj` keeps the matching input columns, its partial sums all-reduced over the TP group (`RowShard`);
* the gated norm normalises each group over its I / G features: where a group spans ranks (G < tp), its sum of
  squares is all-reduced (`RanksGatedRMSNorm`); else the norm is unchanged, its weight sliced;
* the mixer's own sizes (num_heads, intermediate_size, n_groups, conv_dim) become this rank's: its forward and
  its cache (filled lazily from the tensors) read them.

Mamba's mixer (Mamba-1) has no heads: every one of its I channels is scanned on its own. `in_proj` -> [x | z] (I
each), a depthwise `conv1d` over x, `x_proj` -> [dt (R) | B (N) | C (N)] read from every channel, `dt_proj` back to
I channels, `A_log` [I, N], `D` [I], `out_proj`. Each rank keeps I / tp channels: their rows of x, z and `dt_proj`,
their conv channels, A_log and D rows, and their columns of `x_proj` and `out_proj`, both `RowShard`s: dt, B and C
are sums over every channel, so `x_proj`'s partial sums are all-reduced before the scan (Jamba's norms of dt, B
and C then see the whole values).

A mixer is recognised by its shapes, not its class name (`ssm_layout`): Mamba2's sizes, `in_proj` of
I + (I + 2GN) + H outputs, a depthwise `conv1d` of I + 2GN channels, `A_log`, `D`, `dt_bias` of H; Mamba's
`in_proj` of 2I, `conv1d` of I, `x_proj` of R + 2N, `dt_proj` [I, R], `A_log` [I, N]. Every split parameter
records its part (`slices.TensorSlices`) for shard-aware loading; `ColumnShard` and `RowShard` are not
`nn.Linear`s, so DeepSpeed leaves them alone. The whole layer is then checked against the unsharded one as any
derived split is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .attention import take_rows
from .errors import InferenceSetupError
from .slices import TensorSlices, take

SIZES = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim")
PER_HEAD = ("A_log", "D", "dt_bias")


def _sizes(module: nn.Module) -> tuple[int, ...] | None:
    values = tuple(getattr(module, a, None) for a in SIZES)
    return values if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values) else None


def ssm_layout(module: nn.Module) -> str | None:
    """"mamba2" or "mamba" for a state-space mixer of that layout (see the module docstring), else None."""
    return "mamba2" if _is_mamba2(module) else "mamba" if _is_mamba(module) else None


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
    sizes = _sizes(module)
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


def check_divisible(module: nn.Module, tp_size: int) -> None:
    """One line naming the sizes and the valid tp sizes where this mixer cannot be split over `tp_size` ranks."""
    if ssm_layout(module) == "mamba":
        inner = module.intermediate_size
        if inner % tp_size:
            valid = [t for t in range(1, 65) if inner % t == 0]
            raise InferenceSetupError(f"{type(module).__name__}: {inner} SSM channels do not split over --tp_size "
                                      f"{tp_size}; valid tp sizes: {', '.join(map(str, valid))}")
        return
    heads, _, groups, *_ = _sizes(module)
    if heads % tp_size == 0 and (groups % tp_size == 0 or tp_size % groups == 0):
        return
    valid = [t for t in range(1, heads + 1) if heads % t == 0 and (groups % t == 0 or t % groups == 0)]
    raise InferenceSetupError(f"{type(module).__name__}: {heads} SSM heads in {groups} groups do not split over "
                              f"--tp_size {tp_size}; valid tp sizes: {', '.join(map(str, valid))}")


class RowShard(nn.Module):
    """A linear holding only this rank's input columns: the partial products all-reduced over the TP group, then
    the (whole) bias added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed import comm as dist

        out = F.linear(x, self.weight)
        dist.inference_all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]} (this rank's), out_features={self.weight.shape[0]}"


class RanksGatedRMSNorm(nn.Module):
    """The mixers' gated RMS norm where one group's features span several ranks (fewer groups than ranks): each
    rank's sum of squares over its features, all-reduced in its group's slot of a [..., groups] tensor (one small
    all-reduce over the TP group), divided by the group's whole width. `norm_before_gate` as Falcon-H1's norm; else
    the gate multiplies first (Mamba2's). The weight multiplies after the cast back to the input dtype (Mamba2's
    order) or before it (Falcon-H1's)."""

    def __init__(self, weight: torch.Tensor, eps: float, width: int, slot: int, groups: int, group,
                 norm_before_gate: bool = False, weight_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.variance_epsilon, self.width, self.slot, self.groups, self.group = eps, width, slot, groups, group
        self.norm_before_gate, self.weight_in_fp32 = norm_before_gate, weight_in_fp32

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        from deepspeed import comm as dist

        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        if gate is not None and not self.norm_before_gate:
            x = x * F.silu(gate.to(torch.float32))
        sums = x.new_zeros(*x.shape[:-1], self.groups)
        sums[..., self.slot] = x.pow(2).sum(-1)
        dist.inference_all_reduce(sums, group=self.group)
        x = x * torch.rsqrt(sums[..., self.slot:self.slot + 1] / self.width + self.variance_epsilon)
        if not self.weight_in_fp32:
            return self.weight * x.to(input_dtype)
        x = self.weight * x
        if gate is not None and self.norm_before_gate:
            x = x * F.silu(gate.to(torch.float32))
        return x.to(input_dtype)


def _slice_param(owner: nn.Module, name: str, dim: int, ranges) -> None:
    p = owner._parameters[name]
    with torch.no_grad():
        part = nn.Parameter(take(p.detach(), dim, ranges), requires_grad=False)
    part.tensor_slices = TensorSlices(dim, tuple(ranges), tuple(p.shape))
    owner._parameters[name] = part


def _row_shard(linear: nn.Module, columns, group) -> RowShard:
    row = RowShard(take(linear.weight.detach(), 1, columns), linear.bias, group)
    row.weight.tensor_slices = TensorSlices(1, tuple(columns), tuple(linear.weight.shape))
    return row


def split_ssm_mixer(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    """Keep this rank's heads (Mamba2) or channels (Mamba) of a state-space mixer, in place (meta tensors stay meta;
    see the module docstring)."""
    check_divisible(module, tp_size)
    if ssm_layout(module) == "mamba":
        _split_mamba(module, tp_size, tp_rank, group)
        return
    heads, head_dim, groups, state, inner, conv_dim = _sizes(module)
    local_heads = heads // tp_size
    h0, h1 = tp_rank * local_heads, (tp_rank + 1) * local_heads
    if groups % tp_size == 0:
        local_groups = groups // tp_size
        g0 = tp_rank * local_groups
    else:  # fewer groups than ranks: a copy of the one group this rank's heads read
        local_groups, g0 = 1, tp_rank // (tp_size // groups)
    g1 = g0 + local_groups
    x = ((h0 * head_dim, h1 * head_dim),)
    conv = x + ((inner + g0 * state, inner + g1 * state), (inner + (groups + g0) * state, inner + (groups + g1) * state))
    projected = x + tuple((inner + a, inner + b) for a, b in conv) + ((inner + conv_dim + h0, inner + conv_dim + h1),)
    full_projection = module.in_proj.weight.shape[0]

    module.in_proj = take_rows(module.in_proj, [r for a, b in projected for r in range(a, b)])
    local_conv = _split_conv(module.conv1d, conv)
    for name in PER_HEAD:
        _slice_param(module, name, 0, ((h0, h1),))
    for name, buf in list(module._buffers.items()):  # Falcon-H1's mup_vector: one multiplier per projected feature
        if isinstance(buf, torch.Tensor) and buf.ndim and buf.shape[-1] == full_projection:
            module._buffers[name] = take(buf, buf.ndim - 1, projected)
    module.out_proj = _row_shard(module.out_proj, x, group)
    _split_norm(module, groups, local_groups, g0, inner, x, tp_size, group)
    module.num_heads, module.intermediate_size = local_heads, local_heads * head_dim
    module.n_groups, module.conv_dim = local_groups, local_conv


def _split_conv(conv: nn.Conv1d, ranges) -> int:
    for name in ("weight", "bias"):
        if isinstance(conv._parameters.get(name), torch.Tensor):
            _slice_param(conv, name, 0, ranges)
    conv.in_channels = conv.out_channels = conv.groups = sum(b - a for a, b in ranges)
    return conv.groups


def _split_mamba(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    inner = module.intermediate_size
    part = inner // tp_size
    mine = ((tp_rank * part, (tp_rank + 1) * part),)
    module.in_proj = take_rows(module.in_proj, [r for a, b in mine + ((inner + mine[0][0], inner + mine[0][1]),)
                                                for r in range(a, b)])
    _split_conv(module.conv1d, mine)
    module.x_proj = _row_shard(module.x_proj, mine, group)
    module.dt_proj = take_rows(module.dt_proj, list(range(*mine[0])))
    for name in ("A_log", "D"):
        _slice_param(module, name, 0, mine)
    module.out_proj = _row_shard(module.out_proj, mine, group)
    module.intermediate_size = part


def _split_norm(module: nn.Module, groups: int, local_groups: int, g0: int, inner: int, x, tp_size: int, group) -> None:
    norm = getattr(module, "norm", None)
    if not isinstance(getattr(norm, "weight", None), torch.Tensor):  # Falcon-H1 without mamba_rms_norm: Identity
        return
    if groups % tp_size == 0:  # each group's features on one rank: the norm as it is, its weight and count this rank's
        _slice_param(norm, "weight", 0, x)
        if getattr(norm, "n_groups", None) == groups:  # Falcon-H1's norm counts groups; Mamba2's holds a group size
            norm.n_groups = local_groups
        return
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    if not isinstance(eps, float):
        raise InferenceSetupError(f"{type(module).__name__}: its norm {type(norm).__name__} has no variance_epsilon; "
                                  "keep the mixer whole (`replicated`)")
    ranks = RanksGatedRMSNorm(take(norm.weight.detach(), 0, x), eps, inner // groups, g0, groups, group,
                              norm_before_gate=bool(getattr(norm, "norm_before_gate", False)),
                              weight_in_fp32=hasattr(norm, "norm_before_gate"))
    ranks.weight.tensor_slices = TensorSlices(0, x, tuple(norm.weight.shape))
    module.norm = ranks


def ssm_mixers(layer: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
    """The mixers a policy's `mixers` entries ("PATH" or "PATH@Class") name inside `layer`; one line where an entry
    names a module that is not a Mamba2-style mixer."""
    from .policy import replicated_match

    found = []
    for name, module in layer.named_modules():
        if name and any(replicated_match(p, name, module) for p in paths):
            if not is_ssm_mixer(module):
                raise InferenceSetupError(f"mixers {name!r} in {type(layer).__name__} is {type(module).__name__}, not a "
                                          "state-space mixer of a known layout (Mamba2's: in_proj, conv1d, A_log, D, "
                                          "dt_bias, out_proj; Mamba's: in_proj, conv1d, x_proj, dt_proj, A_log, D, "
                                          "out_proj)")
            found.append(module)
    return found
