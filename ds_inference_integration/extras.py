"""The optional parts of the plugin, the extra that installs each, and the one line a missing one gives.

The library's own imports are its core dependencies (torch, transformers, deepspeed, accelerate,
safetensors, numpy); a training environment that adds the plugin gets nothing else. The metrics, the
example scripts' data and audio reading, and the benchmarks' plots need more, and import it through
`optional_import`, so that a missing package is one `error:` line naming the extra to install, not an
ImportError (`tests/test_layout.py` checks that no module of the package imports an extra's package
any other way)."""

from __future__ import annotations

import importlib

from .errors import InferenceSetupError

PACKAGE = "ds-inference-integration"
# extra -> the importable packages it adds (pyproject.toml's [project.optional-dependencies] installs them;
# `examples` and `bench` include the metrics, `dev` everything)
EXTRAS = {
    "metrics": ("sacrebleu", "rouge_score", "nltk", "jiwer"),
    "examples": ("datasets", "soundfile", "scipy"),
    "bench": ("matplotlib",),
    # pydantic too, in pyproject's [serve]; not listed here because DeepSpeed (a core dependency) installs it always
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
}


def extra_of(module: str) -> str:
    top = module.split(".")[0]
    return next(extra for extra, packages in EXTRAS.items() if top in packages)


def optional_import(module: str, needed_for: str):
    """`importlib.import_module(module)`, or one InferenceSetupError naming the extra that installs it. An
    ImportError from inside an installed package (a broken install) is not a missing extra and is raised as it is."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if e.name is not None and e.name.split(".")[0] != top:
            raise
        raise InferenceSetupError(f"{needed_for} needs {top}, which is not installed; valid: "
                                  f"pip install '{PACKAGE}[{extra_of(module)}]'") from None
