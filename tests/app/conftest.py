"""What the app's tests share: one service over the tiny index per module, and the re-rankers'
offline caches under each test's folder."""
import pytest

from app.service import RetrievalService


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """The re-rankers' offline caches under the test's folder, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def svc(tiny_index):
    return RetrievalService(tiny_index)
