"""Mixture-of-experts blocks: their experts (packed, in two modules, or a list of modules) and their routers."""

from __future__ import annotations

from torch import nn

from ..kinds import (
    experts_in_two_modules,
    is_experts,
    is_packed_experts,
    is_router,
    is_ungated_experts,
    row_packed_experts,
)
from ..layers import layer_kinds
from ..schema import is_linear
from .common import _linears


def _unpacked_experts(module: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """(path, [(path, expert)]) of a list of experts held as modules (NLLB-MoE's `experts.expert_0` ...,
    several modules of one class holding linears), inside a block, else None."""
    for path, m in module.named_modules():
        if path and "expert" in path.rpartition(".")[2] and not _linears(m).keys() & {n for n, _ in m.named_children()}:
            children = [(n, c) for n, c in m.named_children() if _linears(c)]  # NLLB-MoE's holds a Dropout too
            if len(children) > 1 and len({type(c) for _, c in children}) == 1:
                return path, [(f"{path}.{n}", c) for n, c in children]
    return None


def _expert_count(module: nn.Module) -> int | None:
    """The number of experts of a mixture-of-experts block (packed experts' first dimension, or a list of
    expert modules), else None."""
    for _, m in module.named_modules():
        if is_packed_experts(m):
            return m.gate_up_proj.shape[0]
        if is_ungated_experts(m):
            return m.up_proj.shape[0]
        two = experts_in_two_modules(m)
        if two:
            return getattr(m, two[0]).weight.shape[0]
        row_packed = row_packed_experts(m)
        if row_packed:
            return row_packed[0]
    unpacked = _unpacked_experts(module)
    return len(unpacked[1]) if unpacked else None


def _router_modules(block: nn.Module) -> list[str]:
    """Paths (in a mixture-of-experts block) of the outermost routers that are modules of several linears, not one
    linear: Zaya's `gate` (a `down_proj` to the router's width, then `router_mlp.fc1/fc2/out_proj`). Split, its
    `down_proj` was made row-parallel and its MLP cut by rows ("mat1 and mat2 shapes cannot be multiplied (30x16
    and 32x16)" at tp 2, 2026-12-06); each rank must route every token alike, so the whole router stays whole."""
    found: list[str] = []
    for q, m in block.named_modules():
        if (q and not is_linear(m) and "expert" not in q and len(_linears(m)) > 1 and _expert_count(m) is None
                and is_router(q, m) and not any(q.startswith(f"{r}.") for r in found)):
            found.append(q)
    return found


def derive_experts(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{layer class: paths of its packed mixture-of-experts modules} (3-D gate_up_proj and down_proj, or 2-D
    [experts x inner, hidden] parameters: `kinds.row_packed_experts`)."""
    found: dict[str, tuple[str, ...]] = {}
    for name, layers in layer_kinds(model).items():  # every kind: DeepSeek-V3's first layers are dense
        found_paths = [p for layer in layers for p, m in layer.named_modules() if p and is_experts(m)]
        # the outermost: DBRX's `ffn.experts` reads the inner size its `mlp`, which holds the parameters, records too
        paths = tuple(dict.fromkeys(p for p in found_paths if not any(p.startswith(f"{o}.") for o in found_paths)))
        if paths:
            found[name] = paths
    return found
