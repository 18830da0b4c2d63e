"""`training train` refuses a bad configuration or --out before it writes anything (in-process;
the subprocess versions are in tests/e2e/test_training_cli.py)."""
import pytest

from core.cli import run_cli
from training.cli import main

TINY = ("--dataset", "kanji", "--num-classes", "12", "--image-size", "32", "--kanji-fonts", "ipag,ipam,seto,ukai",
        "--backbone", "small_cnn", "--weights", "none", "--embed-dim", "8", "--batch-size", "8",
        "--m-per-class", "4", "--no-progress")


def train_cli(tmp_path, capsys, *args) -> tuple[int, str]:
    argv = ["train", *TINY, "--data-root", str(tmp_path / "kanji"), "--cache-dir", str(tmp_path / "cache"),
            *map(str, args)]
    try:
        rc = run_cli(main, argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.fixture
def user_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("best.pt", "latest.pt"):
        (run_dir / name).write_bytes(b"the user's run")
    return run_dir


@pytest.mark.parametrize("bad,msg", [
    (("--batch-size", "0"), "--batch-size must be ≥ 1, got 0"),
    (("--epochs", "-1"), "--epochs must be ≥ 1, got -1"),
    (("--m-per-class", "0"), "--m-per-class must be ≥ 1, got 0"),
    (("--batch-size", "10"), "batch size 10 must be a multiple of m_per_class 4"),
    (("--neck-lr-mult", "-1"), "--neck-lr-mult must be ≥ 0"),
    (("--weight-decay", "-0.1"), "--weight-decay must be ≥ 0"),
    (("--grad-clip", "-1"), "--grad-clip must be ≥ 0"),
    (("--warmup-epochs", "-1"), "--warmup-epochs must be ≥ 0"),
    (("--probe-epochs", "-2"), "--probe-epochs must be ≥ 0 (or -1: the mode's default), got -2"),
    (("--reg-weight", "0.1"), "--reg-weight has 1 values for 0 regularizer(s)"),
    (("--regularizer", "nir,nir"), "regularizer listed twice"),
    (("--loss", "triplet", "--regularizer", "nir"), "regularizer 'nir' acts on class proxies; loss 'triplet' has none"),
    (("--regularizer", "nir", "--reg-param", "nir.depth=3"), "no parameter 'depth'; valid: ['blocks', 'hidden'"),
    (("--reg-param", "cgml.sigma=2"), "names a regularizer that is not in --regularizer"),
    (("--loss-param", "gamma=1"), "no parameter 'gamma'; valid: ['alpha', 'margin']"),
    (("--image-size", "8"), "--image-size must be 0"),
    (("--cache-dir", ""), "--cache-dir must name a folder"),
    (("--workers", "abc"), "--workers must be ≥ 0 or auto, got abc"),
    ((), "already holds a training run; pass --resume to continue it or --overwrite to replace it"),
    (("--resume", "--overwrite"), "give --resume or --overwrite, not both"),
])
def test_train_refuses_before_writing(tmp_path, capsys, user_run, bad, msg):
    rc, err = train_cli(tmp_path, capsys, "--out", user_run, *bad)
    assert rc == 2 and err.startswith("error: ") and msg in err and len(err.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in user_run.iterdir()} == {"best.pt": b"the user's run",
                                                                  "latest.pt": b"the user's run"}
    assert not (tmp_path / "cache").exists() and not (tmp_path / "kanji").exists()


def test_a_folder_that_is_not_a_run_is_never_written_into(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    rc, err = train_cli(tmp_path, capsys, "--out", mine, "--overwrite")
    assert rc == 2 and "holds files that are not a training run" in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    rc, err = train_cli(tmp_path, capsys, "--out", tmp_path / "file")
    assert rc == 2 and "is a file, not a run folder" in err


def test_list_prints_every_registry_with_parameters(capsys):
    assert run_cli(main, ["list"]) == 0
    out = capsys.readouterr().out
    for head in ("backbones:", "data sets:", "losses:", "regularizers:"):
        assert head in out
    assert "small_cnn" in out and "kanji" in out and "alpha = 32.0  scale α" in out
    assert "sigma = 1.0  RBF graph bandwidth σ" in out
    assert run_cli(main, ["list", "regularizers"]) == 0
    assert capsys.readouterr().out.startswith("regularizers:\n  cgml")
