import pytest


@pytest.fixture(scope="module")
def kanji_root(tmp_path_factory):
    """The tiny kanji set's folder, rendered once per module by the first run that needs it."""
    return str(tmp_path_factory.mktemp("kanji"))
