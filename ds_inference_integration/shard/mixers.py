"""State-space mixers split by their heads (Mamba2's mixer and the hybrids built on it: Bamba, Falcon-H1,
Nemotron-H, Granite-4 hybrids, Zamba2), linear-attention mixers split by their heads (the gated delta nets of
Qwen3-Next and Qwen3.5, MiniMax's lightning attention), or mixers split by their channels (Mamba's, and Jamba's;
LFM2's short convolution).

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

A gated delta net (`delta_net`): Kh key heads of dk features, Vh = r x Kh value heads of dv; q, k (Kh heads) and v
(Vh heads) through a depthwise conv of [Q | K | V], the delta rule per value head with its key head, z gating a
per-head norm, `out_proj` from Vh x dv. Each rank keeps Vh / tp value heads and the key heads they read (a copy
where Kh < tp, as with KV heads): their rows of the input projections, in the layout each family packs them
(Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` per key head: [q k v_1..v_r z_1..z_r] and [b_1..b_r a_1..a_r];
Qwen3.5's separate `in_proj_qkv` [Q | K | V], `in_proj_z`, `in_proj_b`, `in_proj_a`), their conv channels,
A_log and dt_bias, and their `out_proj` columns; the norm is per head, unchanged.

MiniMax's lightning attention (`lightning`): `qkv_proj` -> [q k v] per head, a decay per head (`slope_rate` and the
decays built from it: persistent buffers), an RMS norm over every head's output together, a sigmoid `output_gate`,
`out_proj`. Each rank keeps H / tp heads: their rows of `qkv_proj` and `output_gate`, their decays, their
`out_proj` columns; the norm's sum of squares is all-reduced (`RanksGatedRMSNorm` with one group, no gate).

An MLP whose first linear packs [gate | up] as halves, read with `.chunk(2, dim=-1)` (`packed_mlp`: Moonshine's
decoder `fc1`, GraniteMoE's shared `input_linear`; DeepSpeed's own GateUpPack handles only linears named
`gate_up_proj`, auto_tp.py `_replace`, and splits any other by output rows, pairing one rank's gates with another
rank's ups): each rank keeps I / tp of the inner features, their gate rows and the matching up rows, and those
columns of the second linear, a `RowShard`.

LFM2's short convolution: `in_proj` -> [B | C | x] (D = the model's width each), y = C * conv(B * x) per channel,
`out_proj`. Each rank keeps D / tp channels: their rows of B, C and x, their conv channels, their `out_proj` columns.

A mixer is recognised by its shapes, not its class name (`ssm_layout`): Mamba2's sizes, `in_proj` of
I + (I + 2GN) + H outputs, a depthwise `conv1d` of I + 2GN channels, `A_log`, `D`, `dt_bias` of H; Mamba's
`in_proj` of 2I, `conv1d` of I, `x_proj` of R + 2N, `dt_proj` [I, R], `A_log` [I, N]; the short convolution's
`in_proj` of 3D, a depthwise `conv` of D, `out_proj` from D, nothing else. Every split parameter
records its part (`slices.TensorSlices`) for shard-aware loading; `ColumnShard` and `RowShard` are not
`nn.Linear`s, so DeepSpeed leaves them alone. The whole layer is then checked against the unsharded one as any
derived split is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import InferenceSetupError
from ..load.slices import record, take
from ..policy.kinds import LIGHTNING_DECAYS, PER_HEAD, delta_net_sizes, is_ssm_mixer, packed_mlp_names, ssm_layout, ssm_sizes
from .attention import take_rows


def check_divisible(module: nn.Module, tp_size: int) -> None:
    """One line naming the sizes and the valid tp sizes where this mixer cannot be split over `tp_size` ranks."""
    layout = ssm_layout(module)
    if layout in ("mamba", "short_conv", "packed_mlp"):
        inner = (module.conv1d.weight.shape[0] if layout == "mamba" else module.conv.weight.shape[0]
                 if layout == "short_conv" else getattr(module, packed_mlp_names(module)[1]).weight.shape[1])
        if inner % tp_size:
            valid = [t for t in range(1, 65) if inner % t == 0]
            raise InferenceSetupError(f"{type(module).__name__}: {inner} channels do not split over --tp_size "
                                      f"{tp_size}; valid tp sizes: {', '.join(map(str, valid))}")
        return
    if ssm_layout(module) == "delta_net":
        _, (groups, heads, *_) = delta_net_sizes(module)
    elif ssm_layout(module) == "lightning":
        heads, groups = module.num_attention_heads, 1
    else:
        heads, _, groups, *_ = ssm_sizes(module)
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
    record(part, dim, tuple(ranges), tuple(p.shape))
    owner._parameters[name] = part


def _row_shard(linear: nn.Module, columns, group) -> RowShard:
    row = RowShard(take(linear.weight.detach(), 1, columns), linear.bias, group)
    record(row.weight, 1, tuple(columns), tuple(linear.weight.shape))
    return row


def split_ssm_mixer(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    """Keep this rank's heads or channels of a mixer, in its layout's way, in place (meta tensors stay meta; see the
    module docstring)."""
    check_divisible(module, tp_size)
    SPLITS[ssm_layout(module)](module, tp_size, tp_rank, group)


def _split_mamba2(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    heads, head_dim, groups, state, inner, conv_dim = ssm_sizes(module)
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


def _split_delta_net(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    layout, (kh, vh, dk, dv, key_dim, value_dim, _) = delta_net_sizes(module)
    r = vh // kh  # value heads per key head
    v0, v1 = tp_rank * vh // tp_size, (tp_rank + 1) * vh // tp_size
    keys = range(v0 // r, (v1 - 1) // r + 1)  # the key heads this rank's value heads read

    def values_of(k: int) -> range:  # this rank's value heads of key head k, counted within its group
        return range(max(v0, k * r) - k * r, min(v1, (k + 1) * r) - k * r)

    def spans(base: int, heads, width: int) -> list[tuple[int, int]]:
        return [(base + h * width, base + (h + 1) * width) for h in heads]

    q_k = spans(0, keys, dk) + spans(key_dim, keys, dk)
    v = spans(2 * key_dim, range(v0, v1), dv)
    if layout == "grouped":  # per key head k: [q k v_1..v_r z_1..z_r] and [b_1..b_r a_1..a_r]
        block, rows_qkvz, rows_ba = 2 * dk + 2 * r * dv, [], []
        for k in keys:
            mine = values_of(k)
            rows_qkvz += spans(k * block, (0, 1), dk) + spans(k * block + 2 * dk, mine, dv)
            rows_qkvz += spans(k * block + 2 * dk + r * dv, mine, dv)
            rows_ba += [(k * 2 * r + j, k * 2 * r + j + 1) for j in mine] + [(k * 2 * r + r + j, k * 2 * r + r + j + 1)
                                                                            for j in mine]
        rows = {"in_proj_qkvz": rows_qkvz, "in_proj_ba": rows_ba}
    else:  # [Q | K | V], z, b and a each by value head
        rows = {"in_proj_qkv": q_k + v, "in_proj_z": spans(0, range(v0, v1), dv), "in_proj_b": [(v0, v1)],
                "in_proj_a": [(v0, v1)]}
    for name, ranges in rows.items():
        setattr(module, name, take_rows(getattr(module, name), [i for a, b in ranges for i in range(a, b)]))
    local_conv = _split_conv(module.conv1d, q_k + v)
    for name in ("A_log", "dt_bias"):
        _slice_param(module, name, 0, ((v0, v1),))
    module.out_proj = _row_shard(module.out_proj, ((v0 * dv, v1 * dv),), group)
    module.num_k_heads, module.num_v_heads = len(keys), v1 - v0
    module.key_dim, module.value_dim, module.conv_dim = len(keys) * dk, (v1 - v0) * dv, local_conv


def _split_lightning(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    heads, dim = module.num_attention_heads, module.head_dim
    part = heads // tp_size
    h0, h1 = tp_rank * part, (tp_rank + 1) * part
    mine = ((h0 * dim, h1 * dim),)
    module.qkv_proj = take_rows(module.qkv_proj, list(range(3 * h0 * dim, 3 * h1 * dim)))  # [q k v] per head
    module.output_gate = take_rows(module.output_gate, list(range(*mine[0])))
    for name, axis in LIGHTNING_DECAYS.items():
        buf = module._buffers[name]
        local = take(buf, axis, ((h0, h1),))
        record(local, axis, ((h0, h1),), tuple(buf.shape))  # persistent: loading reads this part
        module._buffers[name] = local
    norm = module.norm
    eps = getattr(norm, "variance_epsilon", None)
    if not isinstance(eps, float):
        raise InferenceSetupError(f"{type(module).__name__}: its norm {type(norm).__name__} has no variance_epsilon; "
                                  "keep the mixer whole (`replicated`)")
    ranks = RanksGatedRMSNorm(take(norm.weight.detach(), 0, mine), eps, heads * dim, 0, 1, group)
    record(ranks.weight, 0, mine, tuple(norm.weight.shape))
    module.norm = ranks
    module.out_proj = _row_shard(module.out_proj, mine, group)
    module.num_attention_heads = part


def _split_packed_mlp(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    packed, out = packed_mlp_names(module)
    inner = getattr(module, out).weight.shape[1]
    part = inner // tp_size
    a = tp_rank * part
    setattr(module, packed, take_rows(getattr(module, packed), [*range(a, a + part), *range(inner + a, inner + a + part)]))
    setattr(module, out, _row_shard(getattr(module, out), ((a, a + part),), group))


def _split_short_conv(module: nn.Module, tp_size: int, tp_rank: int, group) -> None:
    width = module.conv.weight.shape[0]
    part = width // tp_size
    a = tp_rank * part
    mine = ((a, a + part),)
    module.in_proj = take_rows(module.in_proj, [r for k in range(3) for r in range(k * width + a, k * width + a + part)])
    _split_conv(module.conv, mine)
    module.out_proj = _row_shard(module.out_proj, mine, group)


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
    record(ranks.weight, 0, x, tuple(norm.weight.shape))
    module.norm = ranks


SPLITS = {"mamba2": _split_mamba2, "mamba": _split_mamba, "delta_net": _split_delta_net, "lightning": _split_lightning,
          "short_conv": _split_short_conv, "packed_mlp": _split_packed_mlp}


def ssm_mixers(layer: nn.Module, paths: tuple[str, ...], skip: set[int] = frozenset()) -> list[nn.Module]:
    """The mixers a policy's `mixers` entries ("PATH" or "PATH@Class") name inside `layer`; one line where an entry
    names a module that is not a mixer of a known layout. Modules whose ids are in `skip` (kept whole) are left."""
    from ..policy.schema import replicated_match

    found, where = [], []
    for name, module in layer.named_modules():  # parents first: an entry "conv" names LFM2's mixer, not its `conv.conv`
        if any(name.startswith(f"{w}.") for w in where):
            continue
        if name and any(replicated_match(p, name, module) for p in paths):
            where.append(name)
            if id(module) in skip:  # inside a module the policy keeps whole
                continue
            if not is_ssm_mixer(module):
                raise InferenceSetupError(f"mixers {name!r} in {type(layer).__name__} is {type(module).__name__}, not a "
                                          "state-space mixer of a known layout (Mamba2's: in_proj, conv1d, A_log, D, "
                                          "dt_bias, out_proj; Mamba's: in_proj, conv1d, x_proj, dt_proj, A_log, D, "
                                          "out_proj; a gated delta net: in_proj_qkvz and in_proj_ba, or in_proj_qkv, "
                                          "in_proj_z, in_proj_b and in_proj_a, conv1d, A_log, dt_bias, out_proj; a "
                                          "short convolution: in_proj, conv, out_proj; a lightning attention: "
                                          "qkv_proj, output_gate, norm, out_proj, slope_rate; an MLP of a [gate | up] "
                                          "linear and an output linear)")
            found.append(module)
    return found
