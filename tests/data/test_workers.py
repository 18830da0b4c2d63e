"""--workers: a count or auto (the cores this process may use, less one; a torchrun rank's share of
them), and how this machine loads images is never taken from a recorded configuration."""
import pytest

from core.errors import UserError
from data.config import DataConfig, with_overrides, worker_count


@pytest.mark.parametrize("cores, ranks, want", [(2, None, 1), (16, None, 15), (16, "4", 3), (2, "2", 0)])
def test_auto_is_the_free_cores_of_this_rank(monkeypatch, cores, ranks, want):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert worker_count("auto") == want


@pytest.mark.parametrize("value, want", [("0", 0), (3, 3), ("abc", None), ("-1", None), (None, None)])
def test_a_count_or_a_refusal(value, want):
    assert worker_count(value) == want


def test_a_bad_value_is_refused_before_anything_is_read():
    with pytest.raises(UserError, match="--workers must be ≥ 0 or auto, got abc"):
        DataConfig(workers="abc").validate()


def test_a_recorded_configuration_never_sets_how_this_machine_loads_images():
    recorded = DataConfig(dataset="kanji", workers="15", eval_batch_size=7)
    here = with_overrides(recorded, {}, "the checkpoint")
    assert here.workers == "auto" and here.eval_batch_size == 128
    assert with_overrides(recorded, {"workers": "0"}, "the checkpoint").workers == "0"


@pytest.mark.parametrize("value", ["abc", "-1"])
def test_index_build_from_an_image_folder_refuses_a_bad_count_in_one_line(tiny_run, tmp_path, value):
    from support import run_command

    cfg, t = tiny_run
    folder = next(p for p in (t / "kanji").rglob("*") if p.is_dir() and any(p.glob("*.png")))
    r = run_command("index", "build", "--checkpoint", t / "run" / "best.pt", "--image-folder", folder.parent,
                    "--out", tmp_path / "idx", "--workers", value, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: --workers must be ≥ 0 or auto, got {value}"]
    assert not (tmp_path / "idx").exists()
