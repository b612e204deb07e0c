"""The package's shape, read from its source (no import): the library a user's script imports never imports the
tools, and no two modules import each other at import time (a cycle, such as the one arguments <-> topology had
for one exception class)."""

import ast
from pathlib import Path

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


def test_no_import_cycle():
    """Imports run when a module is imported, between the package's modules; a submodule's import of a package
    above it (`from . import x`) is not counted: Python has that package half-imported already, by design."""
    graph = {}
    for p in _modules():
        name = _module_name(p)
        graph[name] = {i for i in _imports(p, top_level_only=True) if not name.startswith(i + ".")}
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
