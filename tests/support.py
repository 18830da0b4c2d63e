"""What the tests share beyond fixtures: the repository root and running a command of ours."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_module(module: str, *args, cwd, check: bool = False, env: dict | None = None):
    """`python -m module args…` in `cwd` (a tmp folder, never the repository), importing the
    project from ROOT, writing no bytecode.  Returns the CompletedProcess."""
    e = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TQDM_DISABLE": "1", "HOME": str(cwd),
         "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1", "GRADIO_ANALYTICS_ENABLED": "False",
         "NO_PROXY": "127.0.0.1,localhost", "KANJI_FONT_DIRS": os.environ.get("KANJI_FONT_DIRS", "/usr/share/fonts")}
    e.update(env or {})
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=str(cwd), capture_output=True,
                       text=True, env=e)
    if check and r.returncode != 0:
        raise AssertionError(f"python -m {module} {' '.join(map(str, args))} failed:\n{r.stderr}")
    return r


CONTROLS = {"r": 0.5, "seed": 0, "psd": "abs", "alpha": 0.5, "p": 0.5, "path": None}  # every parameter control


def panels(left=("trained", "cosine"), right=("identity", "cosine"), left_params=None, right_params=None) -> dict:
    """The app handlers' keyword values for two panels, (strategy, mode) each, every parameter
    control at its first value unless given (as app.ui.ConfigControls.kwargs names them)."""
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
