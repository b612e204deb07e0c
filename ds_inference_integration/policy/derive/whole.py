"""Modules kept whole on every rank: what DeepSpeed's split by output rows would compute wrong (a mixer of packed
streams, linears no row-parallel linear gathers, a norm over a split width, bare parameters)."""

from __future__ import annotations

import torch
from torch import nn

from ...deepspeed_compat import autotp_keeps_whole
from ..configs import text_config
from ..kinds import is_experts, is_router, is_ssm_mixer
from ..layers import layer_kinds
from ..schema import is_linear, outermost_layer_classes
from .attention import FUSED_QKV, _attention_modules, _gated_per_head, _narrow_value_heads, _separate_qkv
from .common import BARE_PARAMETERS, _bare_parameters, _feature_scales, _linears, _row_parallel
from .experts import _expert_count, _router_modules
from .heads import head_values


def _unread_own_linears(layer: nn.Module, rows: set[str]) -> list[str]:
    """The layer's own linears (its direct children, not inside its attention or MLP) that DeepSpeed would split by
    output rows although no row-parallel linear of the layer reads that output back: each rank would keep part of
    what the layer uses whole. Gemma 4's per-layer input gate (hidden -> 256, multiplied by the per-layer input the
    model gives each layer whole; then `per_layer_projection` back to hidden): "The size of tensor a (8) must match
    the size of tensor b (16)" at tp 2; Zamba's hybrid layer's `linear` into its whole Mamba layer: "(128) must match
    ... (64)" (2026-12-06). A layer's own MLP (BART's fc1, read by the row-parallel fc2) is split."""
    own = {n: c for n, c in layer.named_children() if is_linear(c)}
    row = {n for n in own if _row_parallel("", n, rows)}
    read = {own[n].weight.shape[1] for n in row}
    return [n for n, c in own.items() if n not in row and c.weight.shape[0] not in read]


def _norm_over(module: nn.Module, widths: set[int]) -> str | None:
    """The name of a norm among a module's children over one of `widths` (what its column-split linears write):
    BitNet's `ffn_sub_norm` over the MLP's inner width, which each rank holds a part of ("The size of tensor a
    (256) must match the size of tensor b (128)" at tp 2, 2026-12-06)."""
    for name, child in module.named_children():
        weight = getattr(child, "weight", None)
        if "norm" in type(child).__name__.lower() and isinstance(weight, torch.Tensor) and weight.ndim == 1 and (
                weight.shape[0] in widths):
            return name
    return None


def _whole_reason(path: str, module: nn.Module, rows: set[str], attention_paths: set[str],
                  heads: tuple[int, int] | None, gathered_elsewhere: set[int] = frozenset(),
                  hidden: int | None = None, packed: set[str] = frozenset()) -> str | None:
    """Why a child module of a layer (at `path` in it) must be kept whole on every rank, or None where AutoTP's
    split (rows named in `rows`, every other linear by output rows) computes it right. (A mixer of a layout
    `shard/mixers.py` knows is split there by its heads or channels, and never asked here.)

    * a mixer with a depthwise convolution of a layout not known: its input projection packs several streams of
      different widths (Mamba2's [z | x | B | C | dt]), which a split by output rows cuts across, and its forward
      reads whole sizes;
    * a module whose linears do not chain as an MLP (each column-split linear's outputs the inputs of a
      row-parallel one): the split would pair the wrong features (MiniMax's lightning attention: a 3 x width
      `qkv_proj` into a 1 x width `out_proj`; GraniteMoE's `input_linear`, [gate | up] in one linear that
      DeepSpeed's GateUpPack handles only under the name `gate_up_proj`).
    DeepSeek's multi-head latent attention (`kv_a_proj_with_mqa`) is DeepSpeed's own record, left to it where a
    row-parallel linear gathers it."""
    if any(isinstance(m, nn.Conv1d) for m in module.modules()):
        return "a mixer with a convolution over its channels: its packed input projection does not split by rows"
    linears = _linears(module)
    if _bare_parameters(module):
        # XLNet's relative attention: q, k, v, o, r as [d_model, heads, d_head] parameters (held whole and not
        # placed: its weight share failed, 53.6% per rank at tp 2, `policy sweep`, 2026-12-06)
        return BARE_PARAMETERS
    # DeepSpeed makes any `down_proj` row-parallel whatever the policy says (deepspeed_compat's note)
    row = {q: m for q, m in linears.items() if _row_parallel(path, q, rows)}
    columns = {q: m for q, m in linears.items() if q not in row}
    if row and any(autotp_keeps_whole(f"{path}.{q}") for q in linears):
        return None  # DeepSpeed's own latent attention; without a row-parallel output (DeepSeek-V4's o_a_proj and
        # o_b_proj) nothing gathers it: the kv_norm of a split kv_proj failed, "(32) must match ... (16)"
    if path in attention_paths:
        if not row:
            return None  # the attention table's, or DeepSpeed's head-aware split
        fused = next((m for q, m in columns.items() if q.rpartition(".")[2] in FUSED_QKV), None)
        separate = _separate_qkv(module, dict(module.named_children()))
        query = module.get_submodule(separate[0]) if separate else None
        width = next(iter(row.values())).weight.shape[1]  # what the output projection reads
        if query is not None and query.weight.shape[0] != width:
            gated = _gated_per_head(module) and query.weight.shape[0] == 2 * width
            if not gated and not _narrow_value_heads(module, separate, width, heads):
                return (f"its query projection ({query.weight.shape[0]} outputs) is not the {width} features its "
                        "output projection reads (a gate packed with it)")
        if fused is None or heads is None:
            return None  # separate q/k/v: the attention table's, or DeepSpeed's head-aware split
        q_heads, kv_heads = heads
        head_dim = fused.weight.shape[0] // (q_heads + 2 * kv_heads)
        if q_heads * head_dim == width:
            return None
        return (f"its fused projection ({fused.weight.shape[0]} outputs) does not hold {q_heads} query and "
                f"{kv_heads} key/value heads of the {width // q_heads} features its output projection reads")
    if not columns:
        return None
    # a parameter of the module itself scaling what a split linear writes (Dory's `suv_gate`, [inner]): DeepSpeed
    # leaves it whole beside the split output ("(128) must match ... (256)"); Dory's attention likewise, below
    scale = next(iter(_feature_scales(module, {m.weight.shape[0] for m in columns.values()} - {hidden})), None)
    if scale:
        return (f"{scale} scales each of the {module._parameters[scale].shape[0]} features a split linear writes, a "
                "parameter DeepSpeed does not split")
    norm = _norm_over(module, {m.weight.shape[0] for m in columns.values()} - {hidden})
    if norm:
        return (f"{norm} normalises the {getattr(module.get_submodule(norm), 'weight').shape[0]} features its linears "
                "split: no rank can compute it from its own features")
    if not row and all(m.weight.shape[0] in gathered_elsewhere for m in columns.values()):
        return None  # an MLP across two modules: BERT's `intermediate.dense`, gathered by the layer's `output.dense`
    if not row:
        return (f"no row-parallel linear gathers what {', '.join(columns)} compute: split by output rows, each "
                "rank would keep part of the module's output")
    fed = {m.weight.shape[1] for m in row.values()}
    # a child module holding no row-parallel linear is judged on its own (`_whole_inside`: kept whole where nothing
    # gathers it), not against this module's row-parallel inputs: X-MOD's language adapter after `output.dense`
    # (128 -> 64 -> 128, on the all-reduced output) kept the whole `output` whole, and `intermediate` split before it
    own = {q for q in columns if "." not in q or any(r.startswith(f"{q.partition('.')[0]}.") for r in row)}
    # a linear of two halves (`packed.py`) feeds one of half its width, its share of each half kept on each rank
    odd = [q for q, m in columns.items() if q in own and m.weight.shape[0] not in fed
           and not ((q.endswith("gate_up_proj") or f"{path}.{q}" in packed) and m.weight.shape[0] // 2 in fed)]
    if odd:
        return (f"{odd[0]} ({columns[odd[0]].weight.shape[0]} outputs) does not feed a row-parallel linear "
                f"({', '.join(str(f) for f in sorted(fed))} inputs): no split by output rows pairs its features")
    return None


def _gathered_widths(layer: nn.Module, rows: set[str], hidden: int | None) -> set[int]:
    """The input widths of the layer's row-parallel linears, but the model's width: what a column-split linear of
    one child module may write for a row-parallel linear of another to gather (BERT's `intermediate.dense`, 4 x
    hidden, read by `output.dense`: judged alone, `intermediate` was kept whole while `output.dense` was split, and
    the sharded forward failed, "mat1 and mat2 shapes cannot be multiplied (30x256 and 128x128)", 2026-12-06; 13
    model types of the BERT family)."""
    return {m.weight.shape[1] for q, m in _linears(layer).items()
            if _row_parallel("", q, rows) and m.weight.shape[1] != hidden}


def _wraps_a_linear(module: nn.Module) -> bool:
    """A module of the model's own around one linear and nothing else that holds parameters (Moshi's `MoshiLinear`,
    Kyutai's: `self_attn.q_proj.linear`)."""
    linears = _linears(module)
    return (len(linears) == 1 and not module._parameters
            and all(not any(True for _ in m.parameters()) for n, m in module.named_children() if n not in linears))


def _wrapped_linears(path: str, module: nn.Module, rows: set[str], read: set[int]) -> set[str]:
    """The names of the module's children that wrap one linear each (`_wraps_a_linear`), to be judged as those
    linears: all of them, where each is row-parallel or writes a width a row-parallel linear of the module reads (or
    the model's); else none. Judged as modules nested in the attention, Moshi's and Kyutai's projections were each
    kept whole on every rank, and the attention with them (Moshi 100% per rank at tp 2, Kyutai 59%; 50% now). All
    or none: a key projection of fewer heads than the query's (grouped-query attention) writes another width, and
    kept whole beside a split query it gave wrong logits (no table describes an attention through its wrappers)."""
    found = {n: c for n, c in module.named_children() if not is_linear(c) and _wraps_a_linear(c)}
    # only a module made of such wrappers, a row-parallel one gathering the others (an attention's projections): a
    # wrapped linear beside a module kept whole (Reformer's `attention.output.dense`, row-parallel by the name of
    # the layer's MLP output, after its whole `self_attention`) reads a whole input, which a split cannot
    others = [c for n, c in module.named_children() if n not in found and not is_linear(c)
              and any(True for _ in c.parameters())]
    row = {n for n, c in found.items() if any(_row_parallel(f"{path}.{n}", q, rows) for q in _linears(c))}
    fits = all(n in row or any(m.weight.shape[0] in read for m in _linears(c).values()) for n, c in found.items())
    return set(found) if fits and not others and row and len(row) < len(found) else set()


def _low_rank_adapter(module: nn.Module, width: int, hidden: int | None) -> bool:
    """Whether the module holds low-rank adapters to `width` and nothing else: linears from the model's width to a
    narrow rank, and from that rank to `width` (Zamba2's `gate_up_proj_adapter_list`, Sequentials of hidden -> 128
    -> 2 x inner, added to `gate_up_proj`'s output). The width is not the model's: a module whose output merely has
    the width of a sibling linear's (the model's, in a tiny model) is not taken for one (DeepSeek-V3.2's indexer)."""
    linears = list(_linears(module).values())
    held = {id(p) for m in linears for p in m.parameters()}
    if not linears or width == hidden or any(id(p) not in held for p in module.parameters()):
        return False
    down = [m for m in linears if m.weight.shape[1] == hidden and m.weight.shape[0] < width]
    up = [m for m in linears if m.weight.shape[0] == width and m.weight.shape[1] < width]
    return bool(down) and bool(up) and len(down) + len(up) == len(linears)


def _whole_inside(path: str, module: nn.Module, rows: set[str], hidden: int | None) -> dict[str, str]:
    """{path: why} of the modules nested in a split module (not linears themselves) whose linears no row-parallel
    linear gathers: DeepSpeed would split each by output rows and every rank would read a part as the whole
    (DeepSeek-V3.2's and GLM-5's `self_attn.indexer`, which scores every token for the sparse attention: "shape
    '[3, 10, 64, 128]' is invalid" at tp 2). Such a module is computed whole on every rank."""
    found = {}
    # what a row-parallel linear of the module reads, but the model's width: an MLP across two of its modules is
    # gathered by the second (Reformer's `feed_forward.dense`, 128 -> 256, read by `feed_forward.output.dense`: kept
    # whole while that was split, "mat1 and mat2 shapes cannot be multiplied (30x256 and 128x128)" at tp 2,
    # `policy sweep`, 2026-12-07), as `_gathered_widths` finds it among the layer's own modules
    read = {m.weight.shape[1] for q, m in _linears(module).items()
            if _row_parallel(path, q, rows) and m.weight.shape[1] != hidden}
    wrapped = _wrapped_linears(path, module, rows, read | {hidden})
    for name, child in module.named_children():
        linears = _linears(child)
        if _bare_parameters(child) and not is_experts(child) and not any(isinstance(m, nn.Embedding)
                                                                         for m in child.modules()):
            # weights DeepSpeed does not split, beside a split module's linears (Ergo's experts as bare [experts,
            # ...] parameters beside its shared expert): held whole, and counted so (an embedding DeepSpeed slices
            # itself: T5's relative attention bias)
            found[f"{path}.{name}"] = BARE_PARAMETERS
            continue
        if not linears or is_linear(child) or is_ssm_mixer(child) or _expert_count(child) is not None:
            continue
        if any(not p for p, *_ in _attention_modules(child)):  # q/k/v gathered by its parent (BigBird's `self`)
            continue
        where = f"{path}.{name}"
        if name in wrapped:
            continue  # a linear in a module of the model's own: judged as that linear
        if all(m.weight.shape[0] in read and not _row_parallel(where, q, rows) for q, m in linears.items()):
            continue
        # a row-parallel linear gathers the module when it writes the model's width back (AutoTP names the
        # indexer's `wk`, the linear before its norm, row-parallel, though it writes one head's features)
        # (and reads something narrower or wider than the model's width: a row-parallel linear that reads the layer's
        # input is not gathering anything; dots3's `indexer.wk`, 128 to 128 where hidden is 128, 2026-12-06)
        gathered = any(_row_parallel(where, q, rows) and m.weight.shape[0] == hidden and m.weight.shape[1] != hidden
                       or autotp_keeps_whole(f"{where}.{q}") for q, m in linears.items())
        if not gathered:
            # its output joins a column-split linear's of the module (Zamba2's low-rank adapters, added to its shared
            # MLP's `gate_up_proj`: kept whole beside the split linear, "(256) must match ... (512)" at tp 2): no
            # rank could add its part of that linear to the whole, so the module is kept whole with it
            beside = [q for q, m in _linears(module).items() if "." not in q and not _row_parallel(path, q, rows)
                      and _low_rank_adapter(child, m.weight.shape[0], hidden)]
            if beside:
                return {path: f"{where} adds its output to {beside[0]}'s, which a split would cut: the module is "
                              "computed whole on every rank"}
            found[where] = ("a module inside a split one whose linears no row-parallel linear gathers: each rank "
                            "computes it whole")
    return found


def _units(module: nn.Module, attention_paths: set[str], prefix: str = ""):
    """(path, module) of what is judged whole or split as one: the layer's children, except that a child holding an
    attention below it beside other modules is judged by its own children, down to the attention (DBRX's
    `norm_attn_norm`: two norms and `attn`; judged as one module, its fused `Wqkv` was taken for an MLP's first
    linear that feeds no row-parallel linear, and nothing of the layer was split, 2026-12-06)."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if path not in attention_paths and any(a.startswith(f"{path}.") for a in attention_paths):
            yield from _units(child, attention_paths, f"{path}.")
        else:
            yield path, child


def derive_whole_modules(model: nn.Module, layers: dict[str, tuple[str, ...]], experts: dict[str, tuple[str, ...]],
                         packed: dict[str, tuple[str, ...]] | None = None
                         ) -> tuple[dict[str, dict[str, str]], dict[str, tuple[str, ...]]]:
    """{layer class: {path: why}} of the modules to keep whole on every rank: mixers AutoTP cannot split
    (`_whole_reason`), and mixture-of-experts routers and gates (each rank must route every token alike:
    a linear of the block, outside its experts, with one output per expert or a single one); and {layer class:
    paths} of the Mamba2-style mixers split by their heads instead (`shard/mixers.py`)."""
    found: dict[str, dict[str, str]] = {}
    text = text_config(model.config)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "d_model", None)
    mixers: dict[str, dict[str, None]] = {}
    mixer_types: dict[tuple[str, str], set[str]] = {}
    heads = head_values(model.config)
    placed = (set(layers) | set(experts)) & outermost_layer_classes(model)
    whole_types: dict[tuple[str, str], set[str]] = {}
    split_types: dict[tuple[str, str], set[str]] = {}
    for name, kinds in layer_kinds(model).items():
        if name not in placed:
            continue  # not a layer the policy names (T5LayerFF inside T5Block: its linears are T5Block's)
        rows = set(layers.get(name, ()))
        for layer in kinds:
            attention_paths = {a[0] for a in _attention_modules(layer)}
            # the projections of an attention on the layer itself (OLMo-1's fused `att_proj`) and a linear of two
            # halves feed what the table and the packed split handle, not a row-parallel linear of their width
            own_projections = {f for p, _, f, separate in _attention_modules(layer) if not p
                               for f in ((f,) if f else separate)} | set((packed or {}).get(name, ()))
            for path in [p for p in _unread_own_linears(layer, rows) if p not in own_projections]:
                found.setdefault(name, {}).setdefault(path, "a linear of the layer itself whose output no row-parallel "
                                                            "linear reads: the layer uses it whole")
            for path, child in _units(layer, attention_paths):
                count = _expert_count(child)
                if count is not None:
                    routers = _router_modules(child)
                    for q in routers:
                        found.setdefault(name, {}).setdefault(f"{path}.{q}", "a router: every rank routes every token")
                    for q, m in _linears(child).items():  # by shape, or by name where it scores more than the
                        # experts (LongCat-Flash's `router.classifier`: its zero-computation experts too)
                        if any(q.startswith(f"{r}.") for r in routers):
                            continue
                        if "expert" not in q.rpartition(".")[0] and (m.weight.shape[0] in (count, 1) or (
                                m.weight.shape[0] > count and is_router(q, m))):
                            found.setdefault(name, {}).setdefault(f"{path}.{q}", "a router: every rank routes "
                                                                                 "every token")
                    continue
                if is_ssm_mixer(child):
                    mixers.setdefault(name, {})[path] = None
                    mixer_types.setdefault((name, path), set()).add(type(child).__name__)
                    continue
                why = _whole_reason(path, child, rows, attention_paths, heads, _gathered_widths(layer, rows, hidden),
                                    hidden, set((packed or {}).get(name, ())))
                if why:
                    found.setdefault(name, {}).setdefault(path, why)
                    whole_types.setdefault((name, path), set()).add(type(child).__name__)
                else:
                    split_types.setdefault((name, path), set()).add(type(child).__name__)
                    for inner, why in _whole_inside(path, child, rows, hidden).items():
                        found.setdefault(name, {}).setdefault(inner, why)
    # a path kept whole in one kind and split in another (NemotronH's `mixer`): name the kind by its class
    for (name, path), types in whole_types.items():
        if (name, path) in split_types or (name, path) in mixer_types:
            why = found[name].pop(path)
            for cls in sorted(types):
                found[name][f"{path}@{cls}"] = why
    for (name, path), types in mixer_types.items():  # likewise a path that is an SSM mixer in some kinds only
        if (name, path) in split_types or (name, path) in whole_types:
            del mixers[name][path]
            mixers[name].update(dict.fromkeys(f"{path}@{cls}" for cls in sorted(types)))
    return found, {name: tuple(paths) for name, paths in mixers.items()}
