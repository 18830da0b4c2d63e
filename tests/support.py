"""What the tests share beyond fixtures: the repository root and running a command of ours, in a
process of its own (`run_module`) or through its `main(argv)` in this one (`run_command`)."""
import contextlib
import importlib
import io
import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path

import core

ROOT = Path(__file__).resolve().parents[1]
# where this process imported the product from (the checkout, installed editable or not): the
# commands started by `run_module` import the same code
PRODUCT = Path(core.__file__).resolve().parents[1]

# each command's main(argv), as `python -m PACKAGE` runs it
MAINS = {"training": "training.cli", "index": "index.cli", "app": "app.cli", "demo": "demo.pipeline"}


# bytecode as in this process (tests/conftest.py): only into the venv's pycache prefix, outside the checkout
BYTECODE = {"PYTHONPYCACHEPREFIX": sys.pycache_prefix} if sys.pycache_prefix else {"PYTHONDONTWRITEBYTECODE": "1"}


def run_module(module: str, *args, cwd, check: bool = False, env: dict | None = None):
    """`python -m module args…` in a process of its own, in `cwd` (a tmp folder, never the
    repository), writing no bytecode into the repository.  Returns the CompletedProcess."""
    e = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TQDM_DISABLE": "1", "HOME": str(cwd),
         "PYTHONPATH": str(PRODUCT), "GRADIO_ANALYTICS_ENABLED": "False", "NO_PROXY": "127.0.0.1,localhost",
         "KANJI_FONT_DIRS": os.environ.get("KANJI_FONT_DIRS", "/usr/share/fonts")} | BYTECODE
    e.update(env or {})
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=str(cwd), capture_output=True,
                       text=True, env=e)
    if check and r.returncode != 0:
        raise AssertionError(f"python -m {module} {' '.join(map(str, args))} failed:\n{r.stderr}")
    return r


@contextlib.contextmanager
def _thread_settings_kept():
    """The commands set torch's, FAISS's and BLAS's thread counts for their process (--threads):
    in this one, the next test gets back what it had."""
    import faiss
    import torch
    from threadpoolctl import ThreadpoolController

    pools = ThreadpoolController()
    saved = torch.get_num_threads(), faiss.omp_get_max_threads(), [c.num_threads for c in pools.lib_controllers]
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        faiss.omp_set_num_threads(saved[1])
        for c, n in zip(pools.lib_controllers, saved[2], strict=True):
            c.set_num_threads(n)


def run_command(package: str, *args, cwd, check: bool = False, env: dict | None = None):
    """`python -m package args…` run in this process through the command's `main(argv)` and
    core.cli.run_cli, as `__main__` runs it: in `cwd`, with HOME there and `env` set, its stdout,
    stderr (log lines included) and exit code captured; an uncaught exception is a traceback on
    stderr and exit code 1, as in a process of its own.  What a separate process adds (the start,
    the imports) is checked by one `run_module` test per command.  Returns a CompletedProcess."""
    from core.cli import run_cli

    main = importlib.import_module(MAINS[package]).main
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    saved_log = root.handlers[:], root.level
    # no handlers: the command's own setup_logging installs its handler on the captured stderr
    root.handlers = []
    os.environ.update({"HOME": str(cwd), "TQDM_DISABLE": "1"} | {k: str(v) for k, v in (env or {}).items()})
    os.chdir(cwd)
    try:
        with _thread_settings_kept(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = run_cli(main, argv)
            except SystemExit as e:  # argparse: --help (0) and its own refusals (2)
                rc = e.code if isinstance(e.code, int) else int(e.code is not None)
            except Exception:
                traceback.print_exc()
                rc = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers, root.level = saved_log
    r = subprocess.CompletedProcess([package, *argv], rc, out.getvalue(), err.getvalue())
    if check and r.returncode != 0:
        raise AssertionError(f"python -m {package} {' '.join(argv)} failed:\n{r.stderr}")
    return r


CONTROLS = {"r": 0.5, "seed": 0, "psd": "abs", "alpha": 0.5, "p": 0.5, "path": None}  # every parameter control


def panels(left=("trained", "cosine"), right=("identity", "cosine"), left_params=None, right_params=None) -> dict:
    """The app handlers' keyword values for two panels, (strategy, mode) each, every parameter
    control at its first value unless given (as app.controls.ConfigControls.kwargs names them)."""
    out = {}
    for side, (strategy, mode), given in (("left", left, left_params), ("right", right, right_params)):
        out |= {f"{side}_strategy": strategy, f"{side}_mode": mode}
        out |= {f"{side}_{k}": v for k, v in (CONTROLS | (given or {})).items()}
    return out


def blocks_by_label(demo) -> dict:
    """A built Gradio app's components, grouped by their label (one label may name several)."""
    out: dict = {}
    for b in demo.blocks.values():
        out.setdefault(getattr(b, "label", None), []).append(b)
    return out


# what a rank process of `spawn_ranks` runs: imported once, in the fork server, not in every rank
RANK_PRELOAD = ["torch", "torch.distributed", "training.trainer", "training.distributed", "test_ddp",
                "test_ddp_trainer"]


def spawn_ranks(fn, args: tuple, nprocs: int = 2) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs): `nprocs` fresh processes, each `fn(rank,
    *args)`, as torchrun's ranks are, joined, a rank's exception raised here.  They are forked
    from one fork server per test process (multiprocessing's "forkserver"), a single-threaded
    process started once that has imported torch and the trainer: a rank starts in a fraction of
    a second instead of importing them again (several seconds each).  The command-line path
    (torchrun starting `python -m training`) is tested in tests/e2e/test_ddp_resume.py."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
