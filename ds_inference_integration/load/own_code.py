"""Models that ship their own code: a `config.json` whose `auto_map` names classes in `*.py` files beside the weights
(`{"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}`), which transformers
imports only with `trust_remote_code=True`.

What every entry point does with such a directory, here in one place:

* `check_trust`: without `--trust_remote_code`, one line naming the option and the files that would run, before any
  rank starts where the command starts its own; transformers would ask `Do you wish to run the custom code? [y/N]` on
  every rank's stdin (a terminal waits 15 s per rank; a closed stdin answers no, and the refusal that follows blamed
  the model). Where transformers has classes of its own for the directory's `model_type` (a published family it has
  since taken in: DeepSeek-V2's checkpoints name `deepseek_v2`), it builds those without the option, as it does in one
  process: said in one warning line, and run so.
* `never_ask`: no process of ours reads stdin for it: a load that would ask raises instead.
* `load_config`, `own_model_class`: the config and the model class the Auto classes build with trust given, read
  from `auto_map`, not matched by class name (a remote `DeepseekV2Config` or `PhiConfig` matched transformers' own
  classes of the same name, whose model then failed on the remote config: "no attribute 'mlp_bias'");
* `restore_own_buffers`: transformers 5 builds a model on `meta` and leaves the non-persistent buffers a model's own
  code computes in `__init__` (rotary `inv_freq`) as uninitialised memory unless its `_init_weights` fills them,
  which code written for transformers 4 does not (`from_pretrained` of such a model gave `inv_freq` of -3e21 and 7e22
  in two loads of one directory, 2026-12-07): they are computed again as the model's own `__init__` computes them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from ..errors import InferenceSetupError

OPTION = "--trust_remote_code"
logger = logging.getLogger(__name__)


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _references(auto_map: dict) -> list[str]:
    """Every class reference of an `auto_map` ("module.Class", "repo--module.Class"; a tokenizer's [slow, fast])."""
    found = []
    for value in auto_map.values():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(ref, str) and "." in ref:
                found.append(ref)
    return found


def _file_of(ref: str) -> str:
    repo, _, ref = ref.rpartition("--")
    module = ref.rpartition(".")[0]
    return f"{repo}: {module}.py" if repo else f"{module}.py"


def code_files(model_dir: str | Path) -> list[str]:
    """The code files a directory's `auto_map`s (config.json's, tokenizer_config.json's) would run, in order; [] for a
    model transformers builds itself."""
    model_dir = Path(model_dir)
    refs = [r for name in ("config.json", "tokenizer_config.json")
            for r in _references(_json(model_dir / name).get("auto_map") or {})]
    return list(dict.fromkeys(_file_of(r) for r in refs))


def _built_in(model_dir: Path) -> str | None:
    """The model type, where transformers has a config class of its own for the directory's `model_type` and a
    tokenizer class of its own for its tokenizer (or it has none, or names none of its own code): what transformers
    builds without trust, as in one process; else None."""
    from transformers import CONFIG_MAPPING

    model_type = _json(model_dir / "config.json").get("model_type")
    if model_type not in CONFIG_MAPPING:
        return None
    tokenizer = _json(model_dir / "tokenizer_config.json")
    if _references(tokenizer.get("auto_map") or {}):
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        name = tokenizer.get("tokenizer_class")
        if not name or tokenizer_class_from_name(name) is None:
            return None
    return model_type


def check_trust(model_dir: str | Path, trust: bool, option: str = OPTION) -> None:
    """One `InferenceSetupError` where `model_dir` ships code that only `option` would run (see the module's
    docstring); a warning line where transformers builds its own classes for it instead."""
    if trust or not Path(model_dir, "config.json").is_file():
        return
    files = code_files(model_dir)
    if not files:
        return
    built_in = _built_in(Path(model_dir))
    if built_in:
        logger.warning("%s ships its own code (%s); without %s transformers builds its own classes for model_type "
                       "%r, as it does in one process; pass %s to run the directory's code instead", model_dir,
                       ", ".join(files), option, built_in, option)
        return
    raise InferenceSetupError(f"{model_dir} ships its own modeling code ({', '.join(files)}), which runs only with "
                              f"{option}; valid: {option} (runs that code in every process that loads the model), or "
                              "a model that transformers builds itself")


def never_ask() -> None:
    """No prompt on stdin for code to run, in this process: a load that would ask raises instead (transformers'
    own answer where its prompt's time-out is 0). `check_trust` says it first in one line where it can."""
    from transformers import dynamic_module_utils

    dynamic_module_utils.TIME_OUT_REMOTE_CODE = 0


@contextlib.contextmanager
def importing_code():
    """One process at a time importing a model's code: transformers copies each `.py` file into HF_MODULES_CACHE
    (truncate, then write) when the copy there differs by size or time, and imports it from there, so ranks
    starting together could import a half-written copy."""
    from filelock import FileLock
    from transformers.utils.hub import HF_MODULES_CACHE

    Path(HF_MODULES_CACHE).mkdir(parents=True, exist_ok=True)
    with FileLock(str(Path(HF_MODULES_CACHE) / ".ds_inference_import.lock"), timeout=300):
        yield


def load_config(model_dir: str | Path, trust: bool = False, **kwargs):
    """`AutoConfig.from_pretrained`, trusting the directory's code where `trust` (after `check_trust`)."""
    from transformers import AutoConfig

    check_trust(model_dir, trust)
    never_ask()
    if not trust:
        return AutoConfig.from_pretrained(model_dir, **kwargs)
    with importing_code():
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=True, **kwargs)


def load_tokenizer(model_dir: str | Path, trust: bool = False, **kwargs):
    """`AutoTokenizer.from_pretrained`, trusting the directory's code where `trust`."""
    from transformers import AutoTokenizer

    never_ask()
    if not trust:
        return AutoTokenizer.from_pretrained(model_dir, **kwargs)
    with importing_code():
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True, **kwargs)


def own_model_class(auto_class, config, trust: bool) -> type | None:
    """The class `auto_class` builds for `config` from the model's own code (its `auto_map` entry, trust given), as
    transformers' Auto classes take it (with the generation mixin they add to remote classes); None where
    transformers builds its own class."""
    auto_map = getattr(config, "auto_map", None) or {}
    ref = auto_map.get(getattr(auto_class, "__name__", ""))
    if not trust or not isinstance(ref, str):
        return None
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.models.auto.auto_factory import add_generation_mixin_to_remote_model

    repo, _, ref = ref.rpartition("--")
    with importing_code():
        cls = get_class_from_dynamic_module(ref, repo or config._name_or_path)
    return add_generation_mixin_to_remote_model(cls)


def is_own_code(model_or_class) -> bool:
    """Whether a model (or its class) comes from a directory's own code (transformers' dynamic modules)."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return cls.__module__.startswith("transformers_modules")


def restore_own_buffers(model) -> int:
    """The non-persistent buffers of a model of its own code, computed again as its `__init__` computes them (see the
    module's docstring); returns how many were set. A model of transformers' own classes is left as it is."""
    import torch
    from accelerate import init_empty_weights
    from transformers.initialization import no_init_weights

    if not is_own_code(model):
        return 0
    names = [name for name, _ in model.named_non_persistent_buffers()]
    if not names:
        return 0
    with init_empty_weights(include_buffers=False), no_init_weights(), torch.device("cpu"):
        fresh = type(model)(model.config)  # parameters on meta, not drawn: only the buffers are computed
    made = dict(fresh.named_buffers())
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        old = module._buffers[attr]
        module._buffers[attr] = made[name].to(device=old.device, dtype=old.dtype if old.is_floating_point() else None)
    return len(names)


def from_pretrained(model_cls, model_dir: str | Path, trust: bool = False, **kwargs):
    """`model_cls.from_pretrained` (an Auto class or a model class), the directory's own code trusted where `trust`,
    its non-persistent buffers as its own `__init__` computes them (`restore_own_buffers`)."""
    never_ask()
    if trust:
        with importing_code():
            model = model_cls.from_pretrained(model_dir, trust_remote_code=True, **kwargs)
    else:
        model = model_cls.from_pretrained(model_dir, **kwargs)
    restore_own_buffers(model)
    return model


# A bench command's --trust_remote_code, for itself and every process it starts: its workers read it (`trusted`), and
# the example scripts it runs are given the option
TRUST_ENV = "DS_INFERENCE_TRUST_REMOTE_CODE"


def trust_from_here_on(model_dir: str | Path | None, trust: bool) -> None:
    """`check_trust` of a bench command's model, then its option kept for the processes the command starts."""
    if model_dir is not None:
        check_trust(model_dir, trust)
    if trust:
        os.environ[TRUST_ENV] = "1"


def trusted() -> bool:
    """Whether the bench command that started this process was given --trust_remote_code."""
    return os.environ.get(TRUST_ENV) == "1"
