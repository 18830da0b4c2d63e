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
