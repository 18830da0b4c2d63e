"""The index CLI: every flag explained with its default, strategy flags from the registry,
`list`, and build settings from a TOML file that flags override."""
import argparse
import json

import numpy as np
import pytest

from core.errors import UserError
from index.cli import build_parser, main
from index.refinements import REFINEMENTS


def subcommands(parser):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_flag_has_help_and_shows_its_default():
    for name, sp in subcommands(build_parser()).items():
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help, f"{name} {a.option_strings}: no help"
            if a.default not in (None, False):
                assert "default" in a.help, f"{name} {a.option_strings}: default {a.default!r} not shown"


def test_strategy_flags_are_generated_from_the_registry():
    search = subcommands(build_parser())["search"]
    flags = {a.dest: a for a in search._actions}
    assert flags["strategy"].default == "trained"
    for e in REFINEMENTS.entries():  # every strategy and every one of its parameters
        assert e.name in flags["strategy"].help
        for param in e.param_defaults():
            assert e.name in flags[param].help and "default" in flags[param].help
    assert flags["path"].option_strings == ["--metric-matrix"]  # a field's own flag name
    assert "(diagonal, diagonal-psd, random, random-psd; default: 0.5)" in flags["r"].help


def test_list_prints_every_strategy_with_its_parameters(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for e in REFINEMENTS.entries():
        assert f"{e.name:<20} {e.doc}" in out
    assert "r = 0.5  restraint degree" in out and "alpha = 0.5" in out


@pytest.fixture
def features(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "F.npy", np.abs(rng.normal(size=(30, 8))).astype(np.float32))
    np.save(tmp_path / "L.npy", np.repeat(np.arange(6), 5))
    return tmp_path


def test_build_reads_a_config_file_and_flags_override_it(features, capsys):
    t = features
    cfg = t / "build.toml"
    cfg.write_text(f'out = "{t / "from_file"}"\nfeatures = "{t / "F.npy"}"\nlabels = "{t / "L.npy"}"\n'
                   'normalize = true\n[data]\nworkers = 1\n')
    assert main(["build", "--config", str(cfg)]) == 0
    man = json.loads((t / "from_file" / "manifest.json").read_text())
    assert man["count"] == 30 and man["normalize"] is True
    assert main(["build", "--config", str(cfg), "--out", str(t / "flagged"), "--no-normalize"]) == 0
    man = json.loads((t / "flagged" / "manifest.json").read_text())
    assert man["count"] == 30 and man["normalize"] is False
    capsys.readouterr()
    bad = t / "bad.toml"
    bad.write_text('outt = "x"\n')
    with pytest.raises(UserError, match="unknown setting 'outt'; valid: .*'out'"):
        main(["build", "--config", str(bad)])
    with pytest.raises(UserError, match="give --out"):
        main(["build", "--features", str(t / "F.npy"), "--labels", str(t / "L.npy")])


def test_evaluate_default_run_is_narrow_and_flags_narrow_it_further(tiny_run, tmp_path, capsys):
    """The default run: coarse grid, one seed, test + val; --strategies/--grid/--seeds/--splits
    change exactly what is evaluated; bad values are refused before anything is written."""
    from index.refinements import coarse, grid

    cfg, _ = tiny_run
    ck = str(tiny_run[0].out) + "/best.pt"
    assert main(["evaluate", "--checkpoint", ck, "--out", str(tmp_path / "a"), "--no-progress",
                 "--cache-dir", str(tmp_path / "c")]) == 0
    res = json.loads((tmp_path / "a" / "strategies.json").read_text())
    assert res["grid"] == "coarse" and res["val"] is not None
    random_rows = [r for r in res["test_runs"] if r["strategy"] == "random"]
    assert len(random_rows) == len(coarse(grid("random")["r"]))  # one seed per r
    assert {r["params"]["seed"] for r in random_rows} == {0}

    assert main(["evaluate", "--checkpoint", ck, "--out", str(tmp_path / "b"), "--no-progress",
                 "--cache-dir", str(tmp_path / "c"), "--strategies", "trained,identity,random", "--grid", "full",
                 "--seeds", "2", "--splits", "test"]) == 0
    res = json.loads((tmp_path / "b" / "strategies.json").read_text())
    assert res["val"] is None and res["grid"] == "full"
    assert {r["strategy"] for r in res["test_runs"]} == {"trained", "identity", "random"}
    assert len([r for r in res["test_runs"] if r["strategy"] == "random"]) == 2 * len(grid("random")["r"])

    for bad in (["--seeds", "0"], ["--grid", "fine"], ["--strategies", "nope"], ["--splits", "test,train"]):
        with pytest.raises(SystemExit) as e:
            main(["evaluate", "--checkpoint", ck, "--out", str(tmp_path / "z"), *bad])
        assert e.value.code == 2, bad
        assert not (tmp_path / "z").exists()
        assert "error:" in capsys.readouterr().err
