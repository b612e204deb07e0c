"""The package's shape, read from its source (no import): one folder per step of the flow, none importing a later
step; the library a user's script imports never imports the tools; no two modules import each other at import
time (a cycle, such as the one arguments <-> topology had for one exception class); and, in a process of its own,
that the commands import no torch before their work."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ds_inference_integration"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """The package's modules that `path` imports (every import, or only those run when it is imported)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names = [f"{target}.{a.name}" for a in node.names] + [target]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("ds_inference_integration") and _exists(n)}
    return found - {_module_name(path)}


def _exists(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_library_never_imports_the_tools():
    library = [p for p in _modules() if "tools" not in p.relative_to(PACKAGE).parts]
    assert len(library) > 10
    offenders = {_module_name(p): sorted(i for i in _imports(p, top_level_only=False) if ".tools" in i)
                 for p in library}
    assert not {m: i for m, i in offenders.items() if i}, offenders


# The flow's folders, in order: a step imports the steps before it, never one after it (serve, the last, reuses
# predict's lock-step guard and nothing else of it) (a module may still import
# one of a later step lazily, inside a function, only where this table allows it: none does). `run` (how a rank
# exits, the watchdog, atomic files) is beside the flow: every step may use it, it uses none of them.
FLOW = ("policy", "load", "shard", "predict", "serve")
NEVER = {step: set(FLOW[i + 1:]) for i, step in enumerate(FLOW)}
NEVER["run"] = set(FLOW)


def _folder(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else "top"


def test_each_step_of_the_flow_is_a_folder_that_never_imports_a_later_one():
    """policy/ -> load/ -> shard/ -> predict/, with run/ beside them: every import (at import time or inside a
    function) goes back along the flow, never forward; each folder's __init__ says what its step is."""
    for step in (*FLOW, "run"):
        init = PACKAGE / step / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))), step
    offenders = []
    for path in _modules():
        name = _module_name(path)
        for imported in _imports(path, top_level_only=False):
            if _folder(imported) in NEVER.get(_folder(name), ()):
                offenders.append(f"{name} imports {imported}")
    assert not offenders, offenders
    assert not list(PACKAGE.glob("[a-z]*.py")) or {p.stem for p in PACKAGE.glob("*.py")} <= {
        "__init__", "arguments", "argument_parser", "errors", "topology", "deepspeed_compat", "extras"}, \
        "at the top: the flags, the topology, the errors, DeepSpeed's workarounds, the extras; the rest in a step's folder"


def test_no_import_cycle():
    """No two modules import each other, through any chain: at import time or inside a function (an import moved
    into a function hides a cycle from Python, not from a reader: deepspeed_compat took `layer_kind` from
    policy.schema, which takes `head_grain` from it, until `policy/layers.py`). A submodule's import of a package
    above it (`from . import x`) is not counted: Python has that package half-imported already, by design."""
    graph = {}
    for p in _modules():
        name = _module_name(p)
        graph[name] = {i for i in _imports(p, top_level_only=False) if not name.startswith(i + ".")}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(path[path.index(dep):] + [dep])}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert len(graph) > 20


def test_extras_packages_are_imported_only_through_optional_import():
    """The package's core dependencies are what it imports; an extra's package (metrics, examples, bench) is
    imported only by `extras.optional_import`, so that an install without the extra imports none of it, and a
    command that needs it says which extra in one line (issue #29: `pip install` pulled matplotlib, scipy,
    soundfile, nltk, jiwer, rouge_score, datasets into every training environment)."""
    from ds_inference_integration.extras import EXTRAS

    optional = {p for packages in EXTRAS.values() for p in packages}
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{_module_name(path)}:{node.lineno} {n}" for n in names if n.split(".")[0] in optional]
    assert not offenders, offenders


# What each upstream-shaped example may take from the library: the flag family (the parser, the flags, the loader
# that replaces from_pretrained, the one error class), the Trainer class, and its offline metric (upstream's
# `evaluate.load` fetches a script from the Hub). Anything more is a check or a step upstream's script does not
# have, which a user's copy with the README's changes would then lack: it belongs in the parser or the Trainer.
FLAG_FAMILY = {"ds_inference_integration.DeepSpeedInferenceArguments", "ds_inference_integration.InferenceArgumentParser",
               "ds_inference_integration.InferenceSetupError", "ds_inference_integration.load.loaders.load_model",
               "ds_inference_integration.DeepSpeedInferenceSeq2SeqTrainer"}
EXAMPLES = {
    # and upstream's own check of --max_source_length against a model's absolute positions, in its place
    "run_translation.py": {"ds_inference_integration.predict.metrics.CorpusBleu",
                           "ds_inference_integration.predict.positions.check_lengths_fit"},
    "run_summarization.py": {"ds_inference_integration.predict.metrics.Rouge",
                             "ds_inference_integration.predict.positions.check_lengths_fit"},
    # upstream reads a hub data set with datasets' Audio; this one local manifests (offline), so it checks the
    # clips, its --max_target_length and, where a model has no feature extractor, the model's kind itself
    "run_speech_recognition_seq2seq.py": {"ds_inference_integration.predict.metrics.WordErrorRate",
                                          "ds_inference_integration.predict.positions.check_lengths_fit",
                                          "ds_inference_integration.load.loaders.check_model_kind"},
}


def test_the_upstream_shaped_examples_take_only_the_flag_family_the_trainer_and_their_metric():
    examples = PACKAGE.parent / "examples"
    for name, own in EXAMPLES.items():
        tree = ast.parse((examples / name).read_text(encoding="utf-8"))
        taken = {f"{node.module}.{a.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and (node.module or "").startswith("ds_inference_integration") for a in node.names}
        assert taken <= FLAG_FAMILY | own, f"{name} takes {sorted(taken - FLAG_FAMILY - own)} from the library"


@pytest.mark.launched
def test_the_commands_import_no_torch_before_their_ranks_do():
    """What every `ds-inference` command imports before its own work (the package, the CLI, a server's front, a
    policy check's and a shard's starter, a node's worker) leaves torch out: torch was 1.9 of `ds-inference --help`'s
    2.5 CPU-s, paid again by every front and starter that then starts ranks importing it themselves (a tp-2 policy
    check of the embedded GPT-2 took 9.8-10.4 CPU-s with its ranks' own imports against 13.7-16.7 before, 2026-12-06).
    torch is imported where a dtype, a group or a model is made (`arguments.py`)."""
    import subprocess
    import sys

    fronts = ["ds_inference_integration.tools.cli", "ds_inference_integration.serve.app",
              "ds_inference_integration.serve.worker", "ds_inference_integration.tools.policy_check",
              "ds_inference_integration.tools.shard_command"]
    out = subprocess.run([sys.executable, "-c", f"import sys\nfor m in {fronts}: __import__(m)\n"
                          "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
