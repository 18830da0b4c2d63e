"""The project installs (`pip install -e .`): pyproject.toml declares its build, the dependencies of
requirements*.txt and a console script per command; nothing edits sys.path to find the product."""
import ast
import importlib
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support import BYTECODE, MAINS, ROOT, run_command

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = {"dml-train": "training", "dml-index": "index", "dml-app": "app", "dml-demo": "demo"}


def test_pyproject_builds_the_top_level_packages_with_the_requirements_files():
    assert PYPROJECT["build-system"]["build-backend"] and PYPROJECT["build-system"]["requires"]
    project = PYPROJECT["project"]
    assert set(project["dynamic"]) == {"dependencies", "optional-dependencies"}
    hook = PYPROJECT["tool"]["hatch"]["metadata"]["hooks"]["requirements_txt"]
    assert hook["files"] == ["requirements.txt"]  # one list: the pinned requirements
    assert hook["optional-dependencies"] == {"test": ["requirements-test.txt"], "milvus": ["requirements-milvus.txt"]}
    # every top-level package of the layout, and only those (tests/ and bench/ are not installed)
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert sorted(PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]) == packages
    assert project["license-files"] == ["LICENSE"] and (ROOT / "LICENSE").read_text().startswith("MIT License")


@pytest.mark.parametrize("script, package", SCRIPTS.items())
def test_each_console_script_is_its_commands_main(script, package, tmp_path):
    assert PYPROJECT["project"]["scripts"][script] == f"{package}.__main__:console"
    entry = importlib.import_module(f"{package}.__main__")  # importing it runs nothing
    assert entry.main is importlib.import_module(MAINS[package]).main
    r = run_command(package, "--help", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("usage: ") and r.stderr == ""


def test_installed_console_scripts_answer_help(tmp_path):
    """The console scripts pip made (make test installs the project editable): each calls its
    command's `console` (whose `main` answers --help above), and one runs in a process of its own."""
    try:
        dist = importlib.metadata.distribution("dml-retrieval")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("dml-retrieval is not installed in this interpreter (pip install -e .)")
    assert {e.name for e in dist.entry_points if e.group == "console_scripts"} == set(SCRIPTS)
    bindir = Path(sys.executable).parent
    for script, package in SCRIPTS.items():
        assert f"from {package}.__main__ import console" in (bindir / script).read_text(), script
    env = {"PATH": str(bindir), "HOME": str(tmp_path)} | BYTECODE
    r = subprocess.run([bindir / "dml-index", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("usage: "), r.stderr


def sys_path_edits(path: Path) -> list[int]:
    """Lines of a file that touch sys.path."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
            and isinstance(n.value, ast.Name) and n.value.id == "sys"]


def test_bench_and_tests_import_the_installed_product_without_sys_path_edits():
    files = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    assert {f.name for f in files} >= {"common.py", "conftest.py", "support.py"}
    assert {str(f.relative_to(ROOT)): sys_path_edits(f) for f in files if sys_path_edits(f)} == {}


def test_bench_readme_lists_every_script():
    listed = re.findall(r"^\| `(\w+\.py)` \|", (ROOT / "bench" / "README.md").read_text(), re.M)
    scripts = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name != "common.py")
    assert sorted(listed) == scripts


def test_run_command_gives_a_process_view_and_leaves_this_process_as_it_was(tmp_path):
    """tests/support.run_command: exit code, stdout and stderr (log lines included) as `python -m`
    would give them; cwd, environment, thread counts and logging handlers restored after."""
    import logging
    import os

    import torch

    r = run_command("training", "evaluate", "--ks", "0", "--embeddings", "a", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "error: python -m training evaluate: argument --ks: --ks values must be ≥ 1\n"
    # (the first call imported what the commands import; some of it sets variables at import)
    before = os.getcwd(), dict(os.environ), torch.get_num_threads(), logging.getLogger().handlers[:]
    r = run_command("index", "search", "--index", tmp_path / "missing", "--features", "q.npy", "--threads", "1",
                    cwd=tmp_path, env={"DML_PROBE": "1"})
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1
    assert (os.getcwd(), dict(os.environ), torch.get_num_threads(), logging.getLogger().handlers) == before
