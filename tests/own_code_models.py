"""Tiny models that ship their own modeling code (`auto_map`, `trust_remote_code`), written for these tests in the
style of published remote-code families (`tests/own_code/<family>/`: its `configuration_*.py`, `modeling_*.py`, and
`tiny.json`, the tiny config and the Auto classes its `auto_map` names).

`save_own_code(name, root)` writes the model directory a user would download: the code files beside `config.json`
(with `auto_map`) and the safetensors weights, random with the family's own initialisation (seeded), and the embedded
tokenizer the family's `tiny.json` names, if any."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

OWN_CODE = Path(__file__).resolve().parent / "own_code"
TOKENIZERS = Path(__file__).resolve().parents[1] / "examples" / "models"


def families() -> list[str]:
    return sorted(p.parent.name for p in OWN_CODE.glob("*/tiny.json"))


def spec(name: str) -> dict:
    return json.loads((OWN_CODE / name / "tiny.json").read_text())


def save_own_code(name: str, root: Path, dir_name: str | None = None, **overrides) -> Path:
    """`root/name` (or `root/dir_name`): the family's code, config (its tiny values, then `overrides`) and seeded random
    weights."""
    import torch
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    family = spec(name)
    out = Path(root) / (dir_name or name)
    out.mkdir(parents=True, exist_ok=True)
    for code in (OWN_CODE / name).glob("*.py"):
        shutil.copyfile(code, out / code.name)
    config_class = get_class_from_dynamic_module(family["auto_map"]["AutoConfig"], out)
    config = config_class(**{**family["config"], **overrides})
    config.auto_map = dict(family["auto_map"])
    model_class = get_class_from_dynamic_module(family["auto_map"][family["auto_class"]], out)
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(out)
    config_data = json.loads((out / "config.json").read_text())
    config_data["auto_map"] = dict(family["auto_map"])  # every Auto class the family names, as published
    (out / "config.json").write_text(json.dumps(config_data, indent=2) + "\n")
    if family.get("tokenizer"):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(TOKENIZERS / family["tokenizer"] / f, out / f)
    return out


# the families the derivation splits by itself; qknorm_lm names its head counts under its own config attributes: it is
# refused, then checked with the policy file of docs/policies.md's worked example
DERIVED = [f for f in families() if f != "qknorm_lm"]


def save_derived(root: Path) -> dict[str, Path]:
    """{"own_" + family: its directory} of the families the derivation splits by itself (named apart from the zoo's
    models in a check of both: a report names a model by its directory)."""
    return {f"own_{f}": save_own_code(f, root, dir_name=f"own_{f}") for f in DERIVED}
