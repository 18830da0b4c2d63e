"""The product is imported as installed (`pip install -e .`, what make test sets up)."""
import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TQDM_DISABLE", "1")
# no __pycache__ written into the repository by the tests: bytecode is written only where the
# venv's pycache prefix sends it, outside the checkout (scripts/bootstrap.sh), and then always, so
# that the libraries' modules are compiled once, not at every start
sys.dont_write_bytecode = not sys.pycache_prefix

import pytest

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


@pytest.fixture(scope="session")
def milvus_server(tmp_path_factory):
    """A real Milvus server on 127.0.0.1 (tests/milvus_server.py), one per test process, started
    by the first test that asks for it; every test that needs it is skipped, with the reason,
    where it cannot start."""
    pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus: pip install -r requirements-milvus.txt")
    from milvus_server import MilvusServer, NoServer

    server = MilvusServer(tmp_path_factory.mktemp("milvus-server-data"))
    try:
        server.start()
    except NoServer as e:
        pytest.skip(str(e))
    except OSError as e:   # its binary does not run here
        pytest.skip(f"the Milvus server cannot run here: {e}")
    yield server
    server.stop()


@pytest.fixture(autouse=True, scope="session")
def _quick_milvus_polls():
    """pymilvus waits for an index, a flush and a load by polling the server every 0.5 s (0.2 s
    for a load); the tests' collections are ready within milliseconds, so they poll every 20 ms."""
    try:
        from pymilvus.client import grpc_handler
    except ImportError:
        yield
        return
    import time

    class QuickTime:  # the time module, but a sleep of at most 20 ms
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds):
            time.sleep(min(seconds, 0.02))

    grpc_handler.time = QuickTime()
    yield
    grpc_handler.time = time
