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
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .arguments import InferenceSetupError

POLICY_DIR = Path(os.environ.get("DS_INFERENCE_POLICY_DIR", Path(__file__).resolve().parent.parent / "policies"))
_TOP_KEYS = {"description", "model_types", "head_count_attributes", "layers"}
_LAYER_KEYS = {"row_parallel"}
# Attributes DeepSpeed's own head-aware split reads when no policy names them.
_GENERIC_HEAD_ATTRIBUTES = ("num_attention_heads", "num_heads", "n_head", "encoder_attention_heads",
                            "decoder_attention_heads", "num_key_value_heads")


@dataclass(frozen=True)
class Policy:
    source: Path
    description: str
    model_types: tuple[str, ...]
    head_count_attributes: tuple[str, ...]
    layers: dict[str, tuple[str, ...]]  # class-name glob -> row-parallel module paths

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
        raise InferenceSetupError(f"--injection_policy {str(path)!r} is not a file; valid: auto, autotp, or a policy file path")
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
    parsed_layers = {}
    for pattern, entry in layers.items():
        if not isinstance(entry, dict) or set(entry) - _LAYER_KEYS or "row_parallel" not in entry:
            raise _schema_error(path, f"[layers.{pattern}] must hold exactly: row_parallel = [...]")
        parsed_layers[pattern] = _str_list(path, f"layers.{pattern}.row_parallel", entry["row_parallel"])
    return Policy(
        source=path,
        description=str(data.get("description", "")),
        model_types=_str_list(path, "model_types", data.get("model_types")),
        head_count_attributes=_str_list(path, "head_count_attributes", data.get("head_count_attributes", []), True),
        layers=parsed_layers,
    )


def available_policies() -> dict[str, Path]:
    """model_type -> policy file, for every file under `policies/`."""
    found: dict[str, Path] = {}
    for path in sorted(POLICY_DIR.glob("*.toml")):
        for model_type in load_policy(path).model_types:
            found[model_type] = path
    return found


def resolve_policy(spec: str, model_type: str) -> Policy | None:
    """The policy for `--injection_policy spec`: None means DeepSpeed AutoTP."""
    if spec == "autotp":
        return None
    if spec == "auto":
        known = available_policies()
        if model_type not in known:
            raise InferenceSetupError(
                f"no policy for model_type {model_type!r}; model types with a policy: {', '.join(sorted(known))}; "
                "or pass --injection_policy autotp or a policy file"
            )
        return load_policy(known[model_type])
    return load_policy(spec)


def check_head_counts(policy: Policy | None, config: object, tp_size: int) -> None:
    """Every head count the policy names (or the config's usual ones) must divide by tp."""
    model_type = getattr(config, "model_type", "?")
    names = policy.head_count_attributes if policy else _GENERIC_HEAD_ATTRIBUTES
    for attr in names:
        value = getattr(config, attr, None)
        if value is None:
            if policy:
                raise InferenceSetupError(
                    f"policy {policy.source}: {model_type} config has no head-count attribute {attr!r}"
                )
            continue
        if value % tp_size:
            valid = [d for d in range(1, value + 1) if value % d == 0]
            raise InferenceSetupError(
                f"{model_type}: {attr}={value} is not divisible by --tp_size {tp_size}; "
                f"valid tp sizes: {', '.join(map(str, valid))}"
            )


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _deepspeed_key(path: str) -> str:
    """DeepSpeed's name for a linear: its immediate parent's attribute and its own ('.x' for a direct child)."""
    parts = path.split(".")
    return f"{parts[-2]}.{parts[-1]}" if len(parts) > 1 else f".{parts[-1]}"


def _layer_classes(model: nn.Module) -> dict[str, type]:
    """Classes of modules held in a ModuleList (the repeated layers), by name."""
    found: dict[str, type] = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                found.setdefault(type(child).__name__, type(child))
    return found


def build_injection_policy(policy: Policy, model: nn.Module) -> dict[type, tuple[str, ...]]:
    """Validate `policy` against the real model; return DeepSpeed's `injection_policy` dict."""
    model_name = type(model).__name__
    classes = _layer_classes(model)
    result: dict[type, tuple[str, ...]] = {}
    for pattern, names in policy.layers.items():
        matched = [cls for name, cls in classes.items() if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise InferenceSetupError(
                f"policy {policy.source}: layer class {pattern!r} matches nothing in {model_name}; "
                f"layer classes there: {', '.join(sorted(classes)) or 'none'}"
            )
        for cls in matched:
            modules = {
                path: m
                for inst in model.modules() if type(inst) is cls
                for path, m in inst.named_modules() if path
            }
            linears = sorted(p for p, m in modules.items() if _is_linear(m))
            keys = []
            for name in names:
                hits = [p for p in modules if p == name or p.endswith("." + name)]
                if not hits:
                    raise InferenceSetupError(
                        f"policy {policy.source}: {name!r} names no module inside {cls.__name__} of {model_name}; "
                        f"linears there: {', '.join(sorted(set(linears)))}"
                    )
                not_linear = [p for p in hits if not _is_linear(modules[p])]
                if not_linear:
                    raise InferenceSetupError(
                        f"policy {policy.source}: {name!r} in {cls.__name__} is {type(modules[not_linear[0]]).__name__}, "
                        f"not a linear; linears there: {', '.join(linears)}"
                    )
                keys.extend(_deepspeed_key(p) for p in hits)
            keys = tuple(sorted(set(keys)))
            # DeepSpeed matches by key alone: a key must not also catch a linear the policy did not name.
            named = {p for name in names for p in linears if p == name or p.endswith("." + name)}
            extra = [p for p in linears if _deepspeed_key(p) in keys and p not in named]
            if extra:
                raise InferenceSetupError(
                    f"policy {policy.source}: in {cls.__name__}, {extra[0]!r} would also be made row-parallel "
                    f"(DeepSpeed matches by parent.name); name it explicitly or rename the policy entry"
                )
            result[cls] = keys
    return result
