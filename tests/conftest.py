import os
import sys
from pathlib import Path

import subprocess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TQDM_DISABLE", "1")
sys.dont_write_bytecode = True  # no __pycache__ written into the repository by the tests

import pytest  # noqa: E402


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

TINY_FONTS = ("ipag", "ipam", "seto", "ukai")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny trained model (small CNN on 12 kanji classes) shared by index and app tests."""
    from training.config import TrainConfig
    from training.trainer import train

    t = tmp_path_factory.mktemp("tiny_run")
    cfg = TrainConfig(dataset="kanji", data_root=str(t / "kanji"), num_classes=12, image_size=32,
                      kanji_fonts=TINY_FONTS, backbone="small_cnn", weights="none", embed_dim=8, epochs=1,
                      batch_size=8, m_per_class=4, out=str(t / "run"), cache_dir=str(t / "cache"),
                      progress=False)
    train(cfg)
    return cfg, t


@pytest.fixture(scope="session")
def tiny_index(tiny_run):
    """An index over the tiny model's test split (6 classes × 4 fonts)."""
    from pathlib import Path

    from index.build import build_from_dataset

    cfg, t = tiny_run
    out = t / "index"
    if not (out / "manifest.json").exists():
        build_from_dataset(Path(cfg.out) / "best.pt", cfg.data_config(), out, progress=False)
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped with the reason where there is none "
                            "(run them alone with `pytest -m cuda`)")
