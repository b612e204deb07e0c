"""Packed projections: a column linear whose output holds two equal halves that the module reads apart and pairs
row by row, for a row-parallel linear that reads half its width (ChatGLM's `dense_h_to_4h`, [gate | up] read by
`torch.chunk(x, 2, -1)`; OLMo's `ff_proj`, [x | gate]; a cross-attention's `kv_proj`, [key | value]). Split by
DeepSpeed's rows, each rank would hold a part of the first half only; each rank keeps its share of each half instead
(`shard/packed.py`). Names say nothing of it (DeepSpeed knows `gate_up_proj` alone): the probe reads it
(`Probe.pairs_halves`, or the key and value rows of `Probe.heads`). Without the probe such a module was kept whole
on every rank ("does not feed a row-parallel linear")."""

from __future__ import annotations

from torch import nn

from ..kinds import packed_mlp_names
from ..layers import layer_kinds
from ..schema import is_linear, names_module, outermost_layer_classes
from .probe import INPUT, active, out_features
from .verdicts import note


def _halves(probe, layer: nn.Module, path: str, reader: str) -> str | None:
    """How `path`'s two halves are read by `reader`'s module, or None where they are not two halves paired."""
    rows = probe.heads(layer, path)
    size = out_features(layer.get_submodule(path))
    if rows is not None:  # read by the attention products: a key and value pair, nothing else
        keys = sorted(i for r in rows.kv_heads() for i in r)
        values = sorted({i for r in rows.v for i in r})
        if not rows.q and keys == list(range(size // 2)) and values == list(range(size // 2, size)):
            return "key | value"
        return None
    return "paired row by row" if probe.pairs_halves(layer, path, reader) else None


def _split_as_mixer(layer: nn.Module, path: str) -> bool:
    """Whether the linear is the first of an MLP `shard/mixers.py` splits already (`kinds.packed_mlp_names`: its own
    forward chunks its output in two: Moonshine's, Moshi's and GraniteMoE's shared MLPs)."""
    owner = path.rpartition(".")[0]
    return bool(owner) and packed_mlp_names(layer.get_submodule(owner)) is not None


def derive_packed(model: nn.Module, layers: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """{layer class: paths of its linears of two halves} (see the module's docstring)."""
    probe = active()
    if probe is None:
        return {}
    found: dict[str, tuple[str, ...]] = {}
    outermost = outermost_layer_classes(model)
    for name, kinds in layer_kinds(model).items():
        if name not in outermost or not layers.get(name):
            continue
        packed: dict[str, str] = {}
        for layer in kinds:
            # by shapes first: the probe runs only where a linear writes twice what a row-parallel one beside it (in
            # the same module) reads
            linears = {p: m for p, m in layer.named_modules() if p and is_linear(m)}
            rows = [(p.rpartition(".")[0], m.weight.shape[1]) for p, m in linears.items()
                    if any(names_module(r, p) for r in layers[name])]
            if not any((p.rpartition(".")[0], out_features(m) // 2) in rows and out_features(m) % 2 == 0
                       for p, m in linears.items()):
                continue
            flow = probe.flow(layer)
            if flow is None:
                continue
            for reader in [p for p in flow.sources if any(names_module(r, p) for r in layers[name])]:
                width = layer.get_submodule(reader).weight.shape[1]
                for path in sorted(flow.sources[reader] - {INPUT, "attention"}):
                    if (path in packed or path in flow.ends or path not in flow.sources or path.endswith("gate_up_proj")
                            or _split_as_mixer(layer, path)):
                        continue  # (DeepSpeed splits a `gate_up_proj` by halves itself)
                    if out_features(layer.get_submodule(path)) == 2 * width:
                        how = _halves(probe, layer, path, reader)
                        if how:
                            packed[path] = how
        if packed:
            found[name] = tuple(sorted(packed))
            for path, how in sorted(packed.items()):
                note("packed projections", f"{name}.{path}", f"two halves ({how}), probed: each rank keeps its share "
                                                             "of each")
    return found
