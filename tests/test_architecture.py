"""The layout is the architecture: imports run one way,
core/evaluation ← data ← model ← {training, index} ← app ← demo.

Every import in every module (function-level ones too) is read with `ast`;
a package may import only the packages listed for it below.
"""
import ast
from pathlib import Path

import pytest
from support import ROOT

PACKAGES = ("core", "evaluation", "data", "model", "training", "index", "app", "demo")
ALLOWED = {
    "core": set(),
    "evaluation": {"core"},
    "data": {"core"},
    "model": {"core", "evaluation", "data"},
    "training": {"core", "evaluation", "data", "model"},
    "index": {"core", "evaluation", "data", "model"},
    "app": {"core", "evaluation", "model", "index"},
    "demo": {"core", "evaluation", "data", "model", "training", "index", "app"},
}


def project_imports(path: Path) -> set[tuple[str, int]]:
    """(top-level project package, line) of every absolute import in a file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for n in names:
            top = n.split(".")[0]
            if top in PACKAGES:
                out.add((top, node.lineno))
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"package {package} has no modules"
    bad = [f"{f.relative_to(ROOT)}:{line} imports {top}"
           for f in files for top, line in sorted(project_imports(f))
           if top != package and top not in ALLOWED[package]]
    assert not bad, "imports against the one-way layout:\n" + "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from training.trainer import train\n    import app.ui\n")
    assert project_imports(f) == {("training", 2), ("app", 3)}


# ---------------------------------------------------------------- what a module pulls in
def module_file(name: str) -> Path | None:
    """The project file of a dotted module name (a module or a package's __init__), if any."""
    base = ROOT.joinpath(*name.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def imported_modules(name: str, path: Path, tree: ast.AST | None = None) -> set[str]:
    """The dotted names a module imports (its parsed `tree` when given), relative imports
    resolved, function-level ones too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree or ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(x for x in (base, node.module) if x)
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names if module_file(f"{module}.{a.name}")}
    return out


def reached(start: str) -> set[str]:
    """Every module name importing `start` can reach, following the project's own modules (each
    package's __init__ included) and recording the outside ones it names."""
    seen: set[str] = set()
    names: set[str] = set()
    todo = [start]
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            names.add(sub)
            f = module_file(sub)
            if f is not None and sub not in seen:
                seen.add(sub)
                todo.extend(imported_modules(sub, f))
    return names


def test_the_plain_http_endpoint_imports_no_gradio_ui():
    """POST /api/search (app/rest.py) runs on the service alone: neither the UI's modules nor
    Gradio are among what it imports, at any depth."""
    names = reached("app.rest")
    assert {"app.service", "app.rest"} <= names
    ui = sorted(n for n in names if n.split(".")[0] == "gradio" or n in ("app.ui", "app.controls", "app.handlers"))
    assert not ui, f"app.rest reaches {ui}"


def test_the_reach_checker_sees_the_ui():
    names = reached("app.ui")
    assert {"gradio", "app.controls", "app.handlers", "app.service"} <= names


# ---------------------------------------------------------------- no circles inside a package
def runtime_imports(name: str, path: Path) -> set[str]:
    """What `imported_modules` gives, less the imports under `if TYPE_CHECKING:` (never run)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for n in ast.walk(block)}
    pruned = ast.Module(body=[n for n in tree.body if id(n) not in typing_only], type_ignores=[])
    return imported_modules(name, path, pruned)


def module_graph() -> dict[str, set[str]]:
    """Every project module → the modules of its own package that it imports at run time."""
    files = {}
    for package in PACKAGES:
        for f in (ROOT / package).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return {m: {i for i in runtime_imports(m, f) if i in files and i != m and i.split(".")[0] == m.split(".")[0]}
            for m, f in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circles_inside_a_package():
    """Modules of one package import each other one way (function-level imports count; imports
    only a type checker reads do not)."""
    assert circles(module_graph()) == []


def test_the_circle_checker_sees_a_circle(tmp_path):
    assert circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}) == [["a.x", "a.y", "a.z"]]
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
                 "def f():\n    from .c import C\n")
    assert runtime_imports("pkg.m", f) == {"typing", "pkg.c"}


# ---------------------------------------------------------------- inside index: the metric-space layer
def index_imports(folder: str, runtime_only: bool) -> dict[str, set[str]]:
    """Each module under index/<folder> → the index modules it imports (every import, or only
    those run, leaving out `if TYPE_CHECKING:` blocks)."""
    out = {}
    for f in sorted((ROOT / "index" / folder).rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found = runtime_imports(name, f) if runtime_only else imported_modules(name, f)
        out[name] = {m for m in found if m.startswith("index.")}
    return out


def test_the_backends_never_import_the_rerankers():
    """index/backends returns a metric space from index/space, the layer below it and the
    re-rankers; it names nothing of index/rerankers, not even a type."""
    bad = {m: sorted(i for i in found if i.startswith("index.rerankers"))
           for m, found in index_imports("backends", runtime_only=False).items()}
    assert not {m: v for m, v in bad.items() if v}


def test_the_metric_space_layer_sits_below_the_backends_and_the_rerankers():
    above = ("index.backends", "index.rerankers", "index.search_config", "index.analysis", "index.cli")
    bad = {m: sorted(i for i in found if i.startswith(above))
           for m, found in index_imports("space", runtime_only=True).items()}
    assert not {m: v for m, v in bad.items() if v}
    assert any("index.space" in found for found in index_imports("rerankers", runtime_only=True).values())
