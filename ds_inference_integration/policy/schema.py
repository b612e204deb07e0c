"""Injection policies: declarative TOML files under `policies/`, one per architecture family.

A policy names, per layer class (a glob over class names), the linears whose output needs an
all-reduce (row-parallel); every other linear inside the layer is split column-wise. Names are
module paths relative to the layer, matched as whole-component suffixes ("fc2",
"SelfAttention.o"); the loader turns each matched module into DeepSpeed's `parent.linear` key
(".fc2" for a direct child), so the leading-dot trap cannot bite.

    description = "T5 / mT5 encoder-decoder"
    model_types = ["t5", "mt5"]
    head_count_attributes = ["num_heads"]      # config attributes that must divide by tp
    [layers.T5Block]
    row_parallel = ["SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo"]

`replicated = ["self_attn"]` in a layer's table keeps every linear under those modules whole on every rank (an
entry "PATH@Class" only where the module there is of that class, for a layer class of several kinds; no
split, no all-reduce): for an attention no rank can compute from its own heads (FSMT views its output at the
input's width; OLMo-2 normalises the whole query projection), while the rest of the layer is split.
`experts = ["mlp.experts"]` names packed mixture-of-experts modules, each expert's MLP split (`shard/experts.py`).
`mixers = ["mixer"]` names Mamba2-style state-space mixers (also "PATH@Class"), each split by its heads (`shard/mixers.py`).
`packed = ["mlp.dense_h_to_4h"]` names linears whose output packs two equal halves that the module reads apart and
pairs (ChatGLM's [gate | up], OLMo's [x | gate], a cross-attention's [key | value]): each rank keeps its share of
each half (`shard/packed.py`), matching the row-parallel linear that reads them.
`head_inputs = { attn_bias = -3 }` names inputs of the layer's forward (a keyword, or a positional index "1") that hold
a bias for every head, made by the model's own forward (MPT's ALiBi [1, heads, 1, keys]), with their head axis counted
from the end: each rank's layers cut them to its heads as they arrive (`shard/biases.py`).

At the top level, `head_biases = ["transformer.relative_pe"]` names modules outside the layers (paths from the model)
that make a bias for every head, which every layer's attention adds to its scores (JAIS's ALiBi slopes): each rank
keeps its heads' part of their parameters and buffers, and their head counts are set to its own (`shard/biases.py`).
`[attention.local]` may name an attribute of a module inside the attention ("core_attention.hidden_size_per_partition")
and give a list for a tuple attribute (`fused_dims = ["q_width", "kv_width", "kv_width"]`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import inspect
import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InferenceSetupError
from .configs import text_config

if TYPE_CHECKING:  # torch where a model is looked at (arguments.py says why not at import)
    from torch import nn

# how a fused QKV projection orders its rows (shard/attention.py splits each)
FUSED_LAYOUTS = ("qkv", "per_head", "grouped")


def _shipped_policy_dir() -> Path:
    """The shipped policies: the package `ds_inference_integration.policies` (the top-level policies/ directory,
    mapped there by pyproject.toml, so an installed wheel has them); a checkout used through PYTHONPATH alone,
    without an install, has them beside the package."""
    from importlib import resources

    try:
        return Path(str(resources.files("ds_inference_integration.policies")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "policies"


POLICY_DIR = Path(os.environ.get("DS_INFERENCE_POLICY_DIR") or _shipped_policy_dir())
_TOP_KEYS = {"description", "model_types", "match", "head_count_attributes", "layers", "attention", "head_biases"}
_LAYER_KEYS = {"row_parallel", "replicated", "experts", "mixers", "packed", "head_inputs"}
_ATTENTION_KEYS = {"query_heads", "kv_heads", "fused_qkv", "layout", "query", "key", "value", "local", "also"}
_LOCAL_VALUES = {"q_heads", "kv_heads", "q_width", "kv_width", "q_per_kv", "head_dim", "qkv_width"}
DERIVE = "derive"  # resolve_policy's answer for a model type with no policy file: derive one from the model
# Attributes DeepSpeed's own head-aware split reads when no policy names them.
_GENERIC_HEAD_ATTRIBUTES = ("num_attention_heads", "num_heads", "n_head", "encoder_attention_heads",
                            "decoder_attention_heads")


@dataclass(frozen=True)
class AttentionSpec:
    """Fused-QKV and multi-/grouped-query attention, split by `shard/attention.py` rather than DeepSpeed.

    `fused_qkv` (+ `layout` "qkv", "per_head" or "grouped") names a fused projection; `query`/`key`/`value` name
    separate ones (split here only when there are fewer KV heads than ranks). `local` maps attributes
    of the attention module to per-rank values (q_heads, kv_heads, q_width, kv_width, q_per_kv, head_dim);
    `config.<attribute>` is an attribute of the module's own config (Phi-3 reads `self.config.num_attention_heads`),
    set on a copy of that config which only this module holds.
    """

    query_heads: str | int  # a config attribute, or a fixed number
    kv_heads: str | int
    fused_qkv: str | None = None
    layout: str = "qkv"
    query: str | None = None
    key: str | None = None
    value: str | None = None
    local: tuple[tuple[str, str], ...] = ()
    # other attention modules of the layer, by path, with the same projection names and head counts, split by
    # the same table (T5Gemma's and Moonshine's cross attention beside their self attention)
    also: tuple[str, ...] = ()

    def variants(self) -> list["AttentionSpec"]:
        """This table, and one for each module in `also` (its paths moved under that module)."""
        names = (self.fused_qkv, self.query, self.key, self.value)
        found = [self]
        for other in self.also:
            moved = [None if n is None else f"{other}.{n.rpartition('.')[2]}" for n in names]
            found.append(dataclasses.replace(self, fused_qkv=moved[0], query=moved[1], key=moved[2], value=moved[3],
                                             also=()))
        return found


@dataclass(frozen=True)
class Policy:
    source: Path
    description: str
    model_types: tuple[str, ...]
    head_count_attributes: tuple[str, ...]
    layers: dict[str, tuple[str, ...]]  # class-name glob -> row-parallel module paths
    match: tuple[tuple[str, object], ...] = ()  # config attribute == value, to choose between files
    attention: AttentionSpec | None = None
    replicated: dict[str, tuple[str, ...]] = field(default_factory=dict)  # class-name glob -> modules kept whole
    experts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # class-name glob -> packed experts modules
    mixers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # class-name glob -> SSM mixers split by heads
    packed: dict[str, tuple[str, ...]] = field(default_factory=dict)  # class-name glob -> linears of two halves
    # class-name glob -> {input of its forward: head axis from the end}, a bias for every head cut as it arrives
    head_inputs: dict[str, dict[str, int]] = field(default_factory=dict)
    head_biases: tuple[str, ...] = ()  # modules outside the layers making a bias per head, sliced to a rank's heads
    # each mechanism's verdict (a derived policy's: `derive/verdicts.py`), not part of what the policy is
    verdicts: tuple[tuple[str, str, str], ...] = field(default=(), compare=False)

    def matches(self, config: object) -> bool:
        return all(getattr(config, k, None) == v for k, v in self.match)

    @property
    def name(self) -> str:
        return self.source.stem


def _schema_error(path: Path, what: str) -> InferenceSetupError:
    return InferenceSetupError(f"policy file {path}: {what}")


def _str_list(path: Path, key: str, value: object, allow_empty: bool = False) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or (not value and not allow_empty):
        raise _schema_error(path, f"'{key}' must be a {'' if allow_empty else 'non-empty '}list of strings, got {value!r}")
    return tuple(value)


def load_policy(path: str | Path) -> Policy:
    """Parse and schema-check one policy file."""
    path = Path(path)
    if not path.is_file():
        raise InferenceSetupError(f"--injection_policy {str(path)!r} is not a file; "
                                  "valid: auto, autotp, derive, or a policy file path")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise _schema_error(path, f"not valid TOML: {e}") from None
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise _schema_error(path, f"unknown key(s) {sorted(unknown)}; valid keys: {sorted(_TOP_KEYS)}")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise _schema_error(path, "needs a [layers.<ClassName>] table with row_parallel = [...]")
    parsed_layers, replicated, experts, mixers, packed, head_inputs = {}, {}, {}, {}, {}, {}
    for pattern, entry in layers.items():
        if not isinstance(entry, dict) or set(entry) - _LAYER_KEYS or "row_parallel" not in entry:
            raise _schema_error(path, f"[layers.{pattern}] must hold row_parallel = [...] (and may hold "
                                      "replicated, experts, mixers, packed = [...] and head_inputs = {...}), nothing else")
        parsed_layers[pattern] = _str_list(path, f"layers.{pattern}.row_parallel", entry["row_parallel"], True)
        if "replicated" in entry:
            replicated[pattern] = _str_list(path, f"layers.{pattern}.replicated", entry["replicated"])
        if "experts" in entry:
            experts[pattern] = _str_list(path, f"layers.{pattern}.experts", entry["experts"])
        if "mixers" in entry:
            mixers[pattern] = _str_list(path, f"layers.{pattern}.mixers", entry["mixers"])
        if "packed" in entry:
            packed[pattern] = _str_list(path, f"layers.{pattern}.packed", entry["packed"])
        if "head_inputs" in entry:
            head_inputs[pattern] = _head_inputs(path, pattern, entry["head_inputs"])
        if not parsed_layers[pattern] and not any(pattern in d for d in (replicated, experts, mixers, packed,
                                                                         head_inputs)):
            raise _schema_error(path, f"'layers.{pattern}.row_parallel' must be a non-empty list of strings, got []")
    match = data.get("match", {})
    if not isinstance(match, dict):
        raise _schema_error(path, f"'match' must be a table of config attribute = value, got {match!r}")
    return Policy(
        source=path,
        description=str(data.get("description", "")),
        model_types=_str_list(path, "model_types", data.get("model_types")),
        head_count_attributes=_str_list(path, "head_count_attributes", data.get("head_count_attributes", []), True),
        layers=parsed_layers,
        replicated=replicated,
        experts=experts,
        mixers=mixers,
        packed=packed,
        head_inputs=head_inputs,
        head_biases=_str_list(path, "head_biases", data.get("head_biases", []), allow_empty=True),
        match=tuple(sorted(match.items())),
        attention=_parse_attention(path, data.get("attention")),
    )


def _head_inputs(path: Path, pattern: str, value: object) -> dict[str, int]:
    """`head_inputs = { attn_bias = -3, "1" = -1 }`: input (keyword, or positional index) -> head axis from the end."""
    if not isinstance(value, dict) or not value or not all(
            isinstance(a, int) and not isinstance(a, bool) and a < 0 and k and (not k[0].isdigit() or k.isdigit())
            for k, a in value.items()):
        raise _schema_error(path, f"'layers.{pattern}.head_inputs' must be a table of input = head axis, each input a "
                                  "keyword of the layer's forward or a positional index (\"1\"), each axis counted "
                                  f"from the end (-1, -2, ...), got {value!r}")
    return dict(value)


def _parse_attention(path: Path, data: object) -> AttentionSpec | None:
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) - _ATTENTION_KEYS:
        raise _schema_error(path, f"[attention] keys must be among {sorted(_ATTENTION_KEYS)}")
    for key in ("query_heads", "kv_heads"):
        if not isinstance(data.get(key), (str, int)) or isinstance(data.get(key), bool):
            raise _schema_error(path, f"[attention] needs {key} = \"<config attribute>\" or a number")
    if bool(data.get("fused_qkv")) == bool(data.get("key")):
        raise _schema_error(path, "[attention] needs either fused_qkv = \"...\" or query/key/value = \"...\"")
    if data.get("key") and not (data.get("query") and data.get("value")):
        raise _schema_error(path, "[attention] with key = ... also needs query = ... and value = ...")
    if data.get("layout", "qkv") not in FUSED_LAYOUTS:
        raise _schema_error(path, f"[attention] layout {data.get('layout')!r} is unknown; "
                                  f"valid: {', '.join(FUSED_LAYOUTS)}")
    local = data.get("local", {})
    # `config.num_attention_heads = ...` (or `core_attention.x = ...`) unquoted is a nested table in TOML: the same
    # entry as the quoted key
    def flat(table: dict, prefix: str = "") -> dict:
        return {k: v for key, value in table.items()
                for k, v in (flat(value, f"{prefix}{key}.").items() if isinstance(value, dict)
                             else [(f"{prefix}{key}", value)])}

    local = {k: tuple(v) if isinstance(v, list) else v for k, v in flat(local).items()}
    bad = {k: v for k, v in local.items()
           if not all(isinstance(x, str) and x in _LOCAL_VALUES for x in (v if isinstance(v, tuple) else (v,)))
           or (isinstance(v, tuple) and not v)
           or "config" in k.split(".")[1:] or (k.startswith("config.") and k.count(".") > 1)}
    if bad:
        raise _schema_error(path, f"[attention.local] entries {bad} are unknown; valid: an attribute of the attention "
                                  "module, of a module inside it (core_attention.<attribute>) or config.<attribute>, "
                                  f"each = one of {sorted(_LOCAL_VALUES)} (or a list of them, for a tuple)")
    return AttentionSpec(
        query_heads=data["query_heads"], kv_heads=data["kv_heads"], fused_qkv=data.get("fused_qkv"),
        layout=data.get("layout", "qkv"), query=data.get("query"), key=data.get("key"), value=data.get("value"),
        local=tuple(local.items()),
        also=_str_list(path, "attention.also", data.get("also", []), allow_empty=True),
    )


def shipped_policies() -> list[Policy]:
    return [load_policy(path) for path in sorted(POLICY_DIR.glob("*.toml"))]


def available_policies() -> dict[str, Path]:
    """model_type -> policy file(s), for every file under `policies/` (first file if several)."""
    found: dict[str, Path] = {}
    for policy in shipped_policies():
        for model_type in policy.model_types:
            found.setdefault(model_type, policy.source)
    return found


def policy_for_config(config: object) -> Policy | None:
    """The shipped policy for this config's model_type (and `match`), if any."""
    model_type = getattr(config, "model_type", None)
    for policy in shipped_policies():
        if model_type in policy.model_types and policy.matches(config):
            return policy
    return None


def resolve_policy(spec: str, config: object) -> Policy | str | None:
    """The policy for `--injection_policy spec`: a Policy, None for DeepSpeed AutoTP, or DERIVE for `derive` and
    when `auto` finds no file for this model type (a policy is then derived from the model itself)."""
    if spec == "autotp":
        return None
    if spec == DERIVE:  # derive even where a file exists: what `policy check --policy derive` compares
        return DERIVE
    if spec == "auto":
        return policy_for_config(config) or DERIVE
    return load_policy(spec)


ALLOW_GLOBAL = "allow_global_per_layer_attribute_access"


@contextlib.contextmanager
def configured_values(config: object):
    """While it runs, a heterogeneous config's per-layer attributes read as their configured value (the one every
    layer without an override has), not as transformers 5's `AmbiguousGlobalPerLayerAttributeError`; each layer's
    own counts are read from its modules where they are split (`shard.inject.layer_heads`). Gemma 4 with its own
    key/value head count in the full-attention layers raised it from the policy's derivation, and would from
    DeepSpeed's own read of `num_key_value_heads` (2026-12-06)."""
    configs = {id(c): c for c in (config, text_config(config))
               if getattr(c, "is_heterogeneous", False)}
    before = {i: c.__dict__.get(ALLOW_GLOBAL) for i, c in configs.items()}
    quiet = logging.getLogger("transformers.integrations.heterogeneity.configuration_utils")
    level = quiet.level
    for c in configs.values():
        c.__dict__[ALLOW_GLOBAL] = True  # what the flag's setter does
    if configs:
        quiet.setLevel(logging.ERROR)  # its "Reading global config value" warning: this is the configured value
    try:
        yield
    finally:
        for i, c in configs.items():
            if before[i] is None:
                c.__dict__.pop(ALLOW_GLOBAL, None)
            else:
                c.__dict__[ALLOW_GLOBAL] = before[i]
        quiet.setLevel(level)



def reading_configured_values(func):
    """`func(model_or_config, ...)` run under `configured_values` of its first argument's config."""
    @functools.wraps(func)
    def run(first, *args, **kwargs):
        with configured_values(getattr(first, "config", first)):
            return func(first, *args, **kwargs)
    return run


def config_value(config: object, attr: str):
    """A head count from the config, or from its text config where the top one has none (T5Gemma keeps its
    counts in its encoder and decoder configs; `get_text_config()` is the decoder's)."""
    value = getattr(config, attr, None)
    if value is None:
        value = getattr(text_config(config), attr, None)
    return value


def check_head_counts(policy: Policy | str | None, config: object, tp_size: int) -> None:
    """Every head count the policy names (or the config's usual ones) must divide by tp."""
    from ..deepspeed_compat import head_grain

    model_type = getattr(config, "model_type", "?")
    policy = policy if isinstance(policy, Policy) else None
    names = policy.head_count_attributes if policy else _GENERIC_HEAD_ATTRIBUTES
    with configured_values(config):
        values = {attr: config_value(config, attr) for attr in names}
    for attr in names:
        value = values[attr]
        if value is None:
            if policy:
                raise InferenceSetupError(
                    f"policy {policy.source}: {model_type} config has no head-count attribute {attr!r}"
                )
            continue
        grain = head_grain(model_type)
        if value % (tp_size * grain):
            valid = [d for d in range(1, value + 1) if value % (d * grain) == 0]
            split = f" x {grain} (DeepSpeed splits its fused qkv_proj in {grain} blocks per rank)" if grain > 1 else ""
            raise InferenceSetupError(
                f"{model_type}: {attr}={value} is not divisible by --tp_size {tp_size}{split}; "
                f"valid tp sizes: {', '.join(map(str, valid)) or 'none'}"
            )


def policy_for_run(spec: str, config: object, tp_size: int) -> Policy | str | None:
    """`resolve_policy` then `check_head_counts`: what a script calls once, before the model loads."""
    policy = resolve_policy(spec, config)
    check_head_counts(policy, config, tp_size)
    return policy


def names_module(name: str, path: str) -> bool:
    """Whether a policy entry `name` names the module at `path` inside a layer: a whole-component suffix."""
    return path == name or path.endswith("." + name)


def replicated_match(entry: str, path: str, module: nn.Module) -> bool:
    """Whether a `replicated` entry names the module at `path` inside its layer: "PATH" names any module there,
    "PATH@Class" only one of that class (a per-kind entry: NemotronH's `mixer` is a Mamba2 mixer in some layers,
    an attention in others, so `mixer@NemotronHMamba2Mixer`)."""
    where, _, cls = entry.partition("@")
    return names_module(where, path) and (not cls or type(module).__name__ == cls)


def under_replicated(entry: str, layer: nn.Module, path: str) -> bool:
    """Whether the module at `path` in `layer` is, or is inside, the module a `replicated` entry names."""
    parts = path.split(".") if path else []
    return any(replicated_match(entry, ".".join(parts[:i]), layer.get_submodule(".".join(parts[:i])))
               for i in range(1, len(parts) + 1))


@functools.lru_cache(maxsize=None)
def class_source(cls: type) -> str:
    """The class's own code ("" where Python has none to give), read once per class: how a module's forward reads
    what it computes (a view, a chunk) where its shapes alone do not tell."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def is_linear(module: nn.Module) -> bool:
    from torch import nn

    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _deepspeed_key(path: str) -> str:
    """DeepSpeed's name for a linear: its immediate parent's attribute and its own ('.x' for a direct child)."""
    parts = path.split(".")
    return f"{parts[-2]}.{parts[-1]}" if len(parts) > 1 else f".{parts[-1]}"


def layer_classes(model: nn.Module) -> dict[str, type]:
    """Classes of modules held in a ModuleList (the repeated layers), by name."""
    from torch import nn

    found: dict[str, type] = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                found.setdefault(type(child).__name__, type(child))
    return found


def outermost_layer_classes(model: nn.Module) -> set[str]:
    """Names of the layer classes not held inside another layer (T5Block, not the T5LayerFF in its `layer`
    list): the units DeepSpeed's AutoTP parses and a policy names."""
    from torch import nn

    inner: set[int] = set()
    names: set[str] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and id(module) not in inner:
            for child in module:
                names.add(type(child).__name__)
                inner.update(id(m) for m in child.modules() if m is not child)
    nested = {type(child).__name__ for lst in model.modules() if isinstance(lst, nn.ModuleList) and id(lst) in inner
              for child in lst}
    return names - nested


def build_injection_policy(policy: Policy, model: nn.Module) -> dict[type, tuple[str, ...]]:
    """Validate `policy` against the real model; return DeepSpeed's `injection_policy` dict."""
    model_name = type(model).__name__
    classes = layer_classes(model)
    result: dict[type, tuple[str, ...]] = {}
    for pattern, names in policy.layers.items():
        matched = [cls for name, cls in classes.items() if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise InferenceSetupError(
                f"policy {policy.source}: layer class {pattern!r} matches nothing in {model_name}; "
                f"layer classes there: {', '.join(sorted(classes)) or 'none'}"
            )
        for cls in matched:
            # not what the policy keeps whole: a row name that also names a linear inside it (BigBird's
            # `output.dense`, its attention's `attention.output.dense` kept whole) is DeepSpeed's only outside it
            kept = [e for pat, entries in policy.replicated.items() if fnmatch.fnmatchcase(cls.__name__, pat)
                    for e in entries]
            modules = {
                path: m
                for inst in model.modules() if type(inst) is cls
                for path, m in inst.named_modules() if path and not any(under_replicated(e, inst, path) for e in kept)
            }
            linears = sorted(p for p, m in modules.items() if is_linear(m))
            keys = []
            for name in names:
                hits = [p for p in modules if names_module(name, p)]
                if not hits:
                    raise InferenceSetupError(
                        f"policy {policy.source}: {name!r} names no module inside {cls.__name__} of {model_name}; "
                        f"linears there: {', '.join(sorted(set(linears)))}"
                    )
                not_linear = [p for p in hits if not is_linear(modules[p])]
                if not_linear:
                    raise InferenceSetupError(
                        f"policy {policy.source}: {name!r} in {cls.__name__} is {type(modules[not_linear[0]]).__name__}, "
                        f"not a linear; linears there: {', '.join(linears)}"
                    )
                keys.extend(_deepspeed_key(p) for p in hits)
            keys = tuple(sorted(set(keys)))
            # DeepSpeed matches by key alone: a key must not also catch a linear the policy did not name.
            named = {p for name in names for p in linears if names_module(name, p)}
            extra = [p for p in linears if _deepspeed_key(p) in keys and p not in named]
            if extra:
                raise InferenceSetupError(
                    f"policy {policy.source}: in {cls.__name__}, {extra[0]!r} would also be made row-parallel "
                    f"(DeepSpeed matches by parent.name); name it explicitly or rename the policy entry"
                )
            result[cls] = keys
    return result


def policy_to_toml(policy: Policy) -> str:
    """A policy file's text (what `ds-inference policy suggest` prints); `load_policy` reads it back unchanged."""
    def q(v: object) -> str:
        return str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)

    lines = [f"description = {q(policy.description)}", f"model_types = [{', '.join(map(q, policy.model_types))}]",
             f"head_count_attributes = [{', '.join(map(q, policy.head_count_attributes))}]"]
    if policy.match:
        lines.append("match = { " + ", ".join(f"{k} = {q(v)}" for k, v in policy.match) + " }")
    if policy.head_biases:
        lines.append(f"head_biases = [{', '.join(map(q, policy.head_biases))}]")
    for pattern, names in policy.layers.items():
        lines += ["", f"[layers.{q(pattern)}]", f"row_parallel = [{', '.join(map(q, names))}]"]
        for key in ("replicated", "experts", "mixers", "packed"):
            if getattr(policy, key).get(pattern):
                lines.append(f"{key} = [{', '.join(map(q, getattr(policy, key)[pattern]))}]")
        if policy.head_inputs.get(pattern):
            lines.append("head_inputs = { " + ", ".join(f"{q(k) if k.isdigit() else k} = {a}"
                                                        for k, a in policy.head_inputs[pattern].items()) + " }")
    spec = policy.attention
    if spec is not None:
        lines += ["", "[attention]", f"query_heads = {q(spec.query_heads)}", f"kv_heads = {q(spec.kv_heads)}"]
        if spec.fused_qkv:
            lines += [f"fused_qkv = {q(spec.fused_qkv)}", f"layout = {q(spec.layout)}"]
        else:
            lines += [f"{k} = {q(getattr(spec, k))}" for k in ("query", "key", "value")]
        if spec.local:
            # a key with a dot ("config.num_attention_heads") is quoted, or TOML would read it as a nested table
            def value(v) -> str:
                return f"[{', '.join(map(q, v))}]" if isinstance(v, tuple) else q(v)

            lines.append("local = { " + ", ".join(f"{q(k) if '.' in k else k} = {value(v)}" for k, v in spec.local)
                         + " }")
        if spec.also:
            lines.append("also = [" + ", ".join(q(a) for a in spec.also) + "]")
    return "\n".join(lines) + "\n"


def policy_identity(policy: Policy) -> str:
    """A content hash of everything in a policy that changes how a model is split: model types, match, head
    counts, layers and the whole [attention] table (not its description or file path)."""
    import dataclasses
    import hashlib
    import json

    fields = {k: v for k, v in dataclasses.asdict(policy).items() if k not in ("source", "description", "verdicts")}
    if fields.get("attention") and not fields["attention"]["also"]:
        del fields["attention"]["also"]  # a table without `also` keeps the identity it had before the key existed
    for key in ("mixers", "packed", "head_biases", "head_inputs"):  # likewise a policy without them
        if not fields[key]:
            del fields[key]
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
