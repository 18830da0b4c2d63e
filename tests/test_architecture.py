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


def imported_modules(name: str, path: Path) -> set[str]:
    """The dotted names a module imports, relative imports resolved, function-level ones too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
