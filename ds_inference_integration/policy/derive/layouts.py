"""Fused attention projections read by probing (`probe.py`): which linear holds the query, key and value rows, in
which layout, and which of the attention's attributes must hold a rank's values once it is split.

* `probed_fused`: the linears of a layer whose rows the attention products read as query, key and value together,
  whatever their names (InternLM2's `wqkv`, OLMo's `att_proj`); `probed_separate`: three linears of one module read
  as query, key and value each (Meta's reference LLaMA's `wq`, `wk`, `wv`), handled as one [Q | K | V].
* `layout_of`: the rows each head reads, against the three layouts a table names: "qkv" ([Q | K | V] blocks: GPT-2,
  Baichuan's `W_pack`, ChatGLM's all query heads then each group's key and value), "per_head" ([q k v] per head:
  BLOOM, GPT-NeoX) and "grouped" ([q .. q k v] per key/value group: Falcon-40B, InternLM2). A layout none of them
  names is refused (the attention kept whole, said).
* `local_attributes`: the attributes of the attention and of the modules inside it that hold no weights (ChatGLM's
  `core_attention`), and of its config, whose values are a head count or width (`ROLES`), each set to a rank's value
  or left as it is: the assignment under which a simulated split (`Probe.split`) reads exactly the rank's heads at
  tp 2 and at the most ranks the heads allow, on the first and last rank. Names alone could not tell them apart
  (ChatGLM's `num_multi_query_groups_per_partition` holds key/value heads, InternLM2's `num_key_value_groups` query
  heads per key/value head: both 2 in a tiny model with 4 heads, and in the published 6B and 7B)."""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap

from torch import nn

from ..head_layout import HeadLayout, fused_rows
from .probe import ATTENTION, HeadRows, Probe, out_features

FUSED_LAYOUTS = ("qkv", "per_head", "grouped")
# a head count or width a rank holds part of; `head_dim` is the same on every rank and never set
ROLES = ("q_heads", "kv_heads", "q_per_kv", "q_width", "kv_width", "qkv_width")
MAX_ASSIGNMENTS = 256  # combinations of ambiguous attributes tried before the attention is kept whole


def probed_fused(probe: Probe, layer: nn.Module) -> dict[str, HeadRows]:
    """{linear path: its `HeadRows`} of the linears holding query, key and value rows together."""
    flow = probe.flow(layer)
    if flow is None:
        return {}
    found = {}
    for path in sorted(flow.scores_both):  # (one linear reaching both the query and the key of the scores)
        rows = probe.heads(layer, path)
        if rows is not None and rows.q and rows.k and rows.v:
            found[path] = rows
    return found


def layout_of(rows: HeadRows) -> tuple[str, int, int, int] | None:
    """(layout, query heads, key/value heads, head dim) of a fused projection's rows, or None for a layout no table
    names (or query heads not grouped over their key/value heads in order)."""
    q, kvs = rows.q, rows.kv_heads()
    heads, kv, d = len(q), len(kvs), len(q[0]) if q else 0
    if not heads or not kv or heads % kv or any(len(r) != d for r in (*q, *rows.k, *rows.v)):
        return None
    per = heads // kv
    group = [h // per for h in range(heads)]
    if len(rows.k) == heads and [kvs.index(r) for r in rows.k] != group:
        return None  # a query head reading another group's key (repeat rather than repeat_interleave)
    values = list({tuple(r): r for r in rows.v}.values())
    if len(values) != kv:
        return None

    def block(start: int) -> list[int]:
        return list(range(start, start + d))

    expected = {
        "qkv": ([block(h * d) for h in range(heads)], [block((heads + g) * d) for g in range(kv)],
                [block((heads + kv + g) * d) for g in range(kv)]),
        "grouped": ([block((h // per) * (per + 2) * d + (h % per) * d) for h in range(heads)],
                    [block(g * (per + 2) * d + per * d) for g in range(kv)],
                    [block(g * (per + 2) * d + (per + 1) * d) for g in range(kv)]),
    }
    if kv == heads:
        expected["per_head"] = ([block(h * 3 * d) for h in range(heads)], [block(h * 3 * d + d) for h in range(heads)],
                                [block(h * 3 * d + 2 * d) for h in range(heads)])
    for layout in FUSED_LAYOUTS:
        if layout in expected and expected[layout] == (q, kvs, values) and rows.size == (heads + 2 * kv) * d:
            return layout, heads, kv, d
    return None


def _read_in_forward(cls: type) -> tuple[set[str], set[str]]:
    """The attributes (of the module, of its config) a class's methods other than `__init__` read, its own and its
    bases' (OLMo's sequential block reads its heads in its base class's attention)."""
    own, config = set(), set()
    for base in cls.__mro__:
        if base.__module__.startswith("torch.") or base is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            continue
        _read_in(tree, own, config)
    return own, config


def _read_in(tree: ast.AST, own: set[str], config: set[str]) -> None:
    for method in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name != "__init__"]:
        for node in ast.walk(method):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                own.add(node.attr)
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                    and node.value.attr == "config"):
                config.add(node.attr)


def full_values(heads: int, kv: int, d: int) -> dict[str, int]:
    """Each role's value in the unsplit attention (a rank's at tp 1)."""
    return HeadLayout(heads, kv, 1, 0).local_values(d)


def _candidates(owner: nn.Module, full: dict[str, int], d: int) -> dict[str, list]:
    """{attribute path relative to `owner`: the roles its value could be} for every attribute the owner and the
    modules inside it that hold no weights read in their forward, and the config attributes they read; a tuple or
    list of ints (OLMo's `fused_dims`) is one attribute of a role per element."""
    by_value: dict[int, list[str]] = {}
    for role, value in full.items():
        if role in ROLES and value not in (d, 1):  # a head's width and a count of one are every rank's
            by_value.setdefault(value, []).append(role)
    found: dict[str, list] = {}
    modules = [("", owner)] + [(p, m) for p, m in owner.named_modules()
                               if p and not any(True for _ in m.parameters()) and not isinstance(m, nn.ModuleList)]
    for prefix, module in modules:
        own, config = _read_in_forward(type(module))
        for name in sorted(own):
            value = module.__dict__.get(name)
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(value, int) and not isinstance(value, bool) and value in by_value:
                found[path] = list(by_value[value])
            elif (isinstance(value, (tuple, list)) and value and all(isinstance(v, int) and v in by_value for v in value)
                  and sum(value) in (full["qkv_width"], full["q_width"] + full["kv_width"])):
                found[path] = [tuple(by_value[v][0] if full["q_width"] != v else "q_width" for v in value)]
        conf = module.__dict__.get("config")
        for name in sorted(config):
            value = getattr(conf, name, None) if conf is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value in by_value and not prefix:
                found[f"config.{name}"] = list(by_value[value])
    return found


def _resolve(owner: nn.Module, path: str) -> tuple[nn.Module, str]:
    """(module, attribute) of an attribute path relative to `owner` ("core_attention.x", "config.n_heads")."""
    if path.startswith("config."):
        return owner, path
    prefix, _, name = path.rpartition(".")
    return (owner.get_submodule(prefix) if prefix else owner), name


def _value(role, values: dict[str, int]):
    return tuple(values[r] for r in role) if isinstance(role, tuple) else values[role]


def tp_sizes(heads: int, kv: int) -> list[int]:
    """The tp sizes a probe simulates: 2, the most the query heads allow, and where the key/value heads are fewer
    than that, their count and twice it (split, then copied)."""
    sizes = {2, heads} | ({kv, 2 * kv} if 1 < kv < heads else set())
    return sorted(t for t in sizes if 1 < t <= heads and heads % t == 0 and (kv % t == 0 or t % kv == 0))


def _reads_its_heads(probe: Probe, layer: nn.Module, paths: tuple[str, ...], owner: nn.Module,
                     rows_parallel: list[str], full_rows: HeadRows, layout: str, heads: int, kv: int, d: int,
                     assignment: dict) -> bool:
    """Whether, with `assignment` ({attribute path: role or None}) set to each rank's values, a simulated split of the
    projections at `paths` (one fused linear, or separate query, key and value linears numbered as one [Q | K | V])
    reads exactly the rank's heads, at every `tp_sizes` on the first and the last rank."""
    linears = [layer.get_submodule(p) for p in paths]
    sizes = [out_features(m) for m in linears]
    starts = [sum(sizes[:i]) for i in range(len(paths))]
    for tp in tp_sizes(heads, kv):
        for rank in (0, tp - 1):
            hl = HeadLayout(heads, kv, tp, rank)
            values = hl.local_values(d)
            rows = fused_rows(layout, full_rows.size, hl)[0]
            shapes = {}
            for p, m, a, n in zip(paths, linears, starts, sizes):
                mine = sum(a <= r < a + n for r in rows)
                shapes[p] = (mine, m.weight.shape[-1] if type(m).__name__ != "Conv1D" else m.weight.shape[0])
            for row in rows_parallel:
                target = layer.get_submodule(row)
                shapes[row] = (out_features(target), target.weight.shape[1] * values["q_heads"] // heads)
            settings = {_resolve(owner, p): _value(role, values) for p, role in assignment.items() if role is not None}
            try:
                with probe.split(layer, shapes, settings):
                    got = probe.heads(layer, paths, rows, probe.rank_inputs(layer, heads, hl.q_heads()), sizes)
            except (AttributeError, TypeError):  # an attribute that cannot be set (a config's property)
                return False
            if got is None:
                return False
            want_q = [full_rows.q[h] for h in hl.q_heads()]
            kv_of = [full_rows.kv_heads().index(full_rows.k[h]) if len(full_rows.k) == heads else h // (heads // kv)
                     for h in range(heads)]
            want_k = [full_rows.kv_heads()[kv_of[h]] for h in hl.q_heads()]
            if got.q != want_q or got.kv_heads() != list({tuple(r): r for r in want_k}.values()):
                return False
            if len(got.k) == len(got.q) and got.k != want_k:
                return False
            # a model that repeats its key/value heads for their query heads must still repeat them: one local
            # key/value head broadcast over the query heads hid a wrong repeat count (reference LLaMA's `n_rep` set to
            # the key/value heads, 1 at tp 2 where 2 is right: wrong once a rank holds two key/value heads)
            if any(len(full) == heads and len(part) != len(got.q) for full, part in ((full_rows.k, got.k),
                                                                                    (full_rows.v, got.v))):
                return False
    return True


def local_attributes(probe: Probe, layer: nn.Module, paths: tuple[str, ...], rows_parallel: list[str],
                     full_rows: HeadRows, layout: str, heads: int, kv: int, d: int, start: dict[str, str]
                     ) -> dict | list[str]:
    """{attribute path relative to the attention (the fused linear's parent): role} under which a split of this
    fused projection reads each rank's heads (see the module's docstring), or, where no assignment does, the list of
    the attributes tried. `start` (names the table's usual rules give: `heads.LOCAL_ATTRIBUTES`) is tried first and
    kept where it works; otherwise the fewest changes that work."""
    owner_path = paths[0].rpartition(".")[0]
    owner = layer.get_submodule(owner_path) if owner_path else layer
    candidates = _candidates(owner, full_values(heads, kv, d), d)
    for p, role in start.items():
        candidates.setdefault(p, [role])

    def works(assignment: dict) -> bool:
        return _reads_its_heads(probe, layer, paths, owner, rows_parallel, full_rows, layout, heads, kv, d, assignment)

    if start and works(dict(start)):
        return dict(start)
    names = sorted(candidates)
    options = [[None, *candidates[n]] for n in names]
    tried = 0
    for changes in range(len(names) + 1):  # the fewest attributes changed first
        for chosen in itertools.combinations(range(len(names)), changes):
            for roles in itertools.product(*(options[i][1:] for i in chosen)):
                tried += 1
                if tried > MAX_ASSIGNMENTS:
                    return names
                assignment = {names[i]: role for i, role in zip(chosen, roles)}
                if works(assignment):
                    return assignment
    return names


def attention_rows_parallel(probe: Probe, layer: nn.Module, paths: tuple[str, ...]) -> list[str]:
    """The layer's row-parallel linears that read what the attention computes from `paths` (its output projection)."""
    flow = probe.flow(layer)
    if flow is None:
        return []
    return [p for p in flow.row_parallel() if ATTENTION in flow.sources.get(p, ())
            and set(paths) & flow.sources[p]]


def probed_separate(probe: Probe, layer: nn.Module) -> dict[str, tuple[str, str, str]]:
    """{module path: (query, key, value) linear names} of the attentions whose query, key and value come from three
    linears of one module, whatever their names (Meta's reference LLaMA's `wq`, `wk`, `wv`): each linear's rows read
    by the products as one role alone."""
    flow = probe.flow(layer)
    if flow is None:
        return {}
    roles: dict[str, dict[str, str]] = {}
    for path in sorted(flow.attention - flow.scores_both):
        rows = probe.heads(layer, path)
        held = [r for r in ("q", "k", "v") if rows is not None and getattr(rows, r)]
        if len(held) == 1:
            owner, _, name = path.rpartition(".")
            roles.setdefault(owner, {}).setdefault(held[0], name)
    return {owner: (r["q"], r["k"], r["v"]) for owner, r in roles.items() if len(r) == 3}
