"""`python -m training tune` on tiny kanji: a study runs, prunes, stops at its budget, resumes, and
its best config reproduces its best trial; bad search spaces are refused in one line."""
import dataclasses
import json

import pytest
from tiny_kanji import FONTS

from core.cli import run_cli
from core.config import read_config_file
from core.errors import UserError
from training.cli import main
from training.config import TrainConfig
from training.trainer import train
from training.tune import TuneConfig, build_space, parse_duration, tune

SPACE = ("backbone=small_cnn", "mode=frozen", "epochs=3", "embed_dim=8/16", "batch_size=16", "m_per_class=4",
         "loss=proxy_anchor", "regularizer=none", "lr=1e-5..3e-2 log")


def tiny_study(tmp_path, kanji_root, **kw) -> TuneConfig:
    base = dict(dataset="kanji", data_root=kanji_root, num_classes=20, image_size=32, kanji_fonts=FONTS,
                out=str(tmp_path / "study"), cache_dir=str(tmp_path / "cache"), progress=False, budget="0",
                trials=6, space=SPACE, threads=1)
    base.update(kw)
    return TuneConfig(**base)


def states(tmp_path) -> list[str]:
    lines = (tmp_path / "study" / "trials.csv").read_text().splitlines()[1:]
    return [line.split(",")[1] for line in lines]


def test_a_tiny_study_runs_prunes_and_its_best_config_reproduces_the_best_trial(tmp_path, kanji_root, monkeypatch):
    import training.tune

    monkeypatch.setattr(training.tune, "PRUNE_WARMUP_STEPS", 1)  # the tiny runs have 3 epochs
    s = tune(tiny_study(tmp_path, kanji_root))
    assert s["trials"] == 6 and s["complete"] + s["pruned"] == 6
    assert s["pruned"] >= 1  # the median pruner stopped a trial below the earlier ones after an epoch
    out = tmp_path / "study"
    for f in ("best.pt", "best.toml", "trials.md", "trials.csv", "summary.json", "history.png", "history.html",
              "importances.png", "importances.html"):
        assert (out / f).is_file(), f
    assert states(tmp_path).count("pruned") == s["pruned"]
    best = s["best"]
    vals = [float(v.split(",")[2]) for v in (out / "trials.csv").read_text().splitlines()[1:] if v.split(",")[2]]
    assert best["val_map@r"] == pytest.approx(max(vals), abs=1e-4)  # chosen on validation, never on test
    # the config the study writes reproduces the best trial, bit for bit
    cfg = TrainConfig(**read_config_file(TrainConfig, out / "best.toml"))
    assert cfg.embed_dim == best["params"]["embed_dim"] and cfg.lr == best["params"]["lr"]
    again = train(dataclasses.replace(cfg, out=str(tmp_path / "again"), progress=False, threads=1))
    assert again["val"]["map@r"] == best["val_map@r"]
    assert again["test"]["map@r"] == best["test_map@r"]


def test_a_study_stops_at_its_budget_and_the_same_command_continues_it(tmp_path, kanji_root):
    # a budget of 10 ms: the first trial (3 epochs) outlasts it and finishes; no second trial starts
    cfg = tiny_study(tmp_path, kanji_root, budget="0.01s", trials=0)
    s = tune(cfg)
    assert s["trials"] == 1 and s["complete"] == 1 and s["seconds"] >= 0.1
    first = (tmp_path / "study" / "trials.csv").read_text().splitlines()[1]
    # run again with a larger budget (or a trial count): the study goes on from where it stopped
    s2 = tune(dataclasses.replace(cfg, budget="0", trials=3))
    assert s2["trials"] == 3 and (tmp_path / "study" / "trials.csv").read_text().splitlines()[1] == first
    s3 = tune(dataclasses.replace(cfg, budget="0", trials=3))  # nothing left to do: the same study, no new trial
    assert s3["trials"] == 3


def test_an_interrupted_study_resumes_its_cut_trial(tmp_path, kanji_root, monkeypatch):
    import training.trainer as trainer

    real = trainer.Run.fit
    calls = {"n": 0}

    def ctrl_c(epoch):
        raise KeyboardInterrupt

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == 2:  # Ctrl-C during the second trial, after its first epoch
            self.on_epoch_end = ctrl_c
        return real(self)

    monkeypatch.setattr(trainer.Run, "fit", interrupted)
    cfg = tiny_study(tmp_path, kanji_root, trials=3)
    with pytest.raises(KeyboardInterrupt):
        tune(cfg)
    monkeypatch.setattr(trainer.Run, "fit", real)
    s = tune(cfg)
    table = (tmp_path / "study" / "trials.md").read_text()
    assert "re-run of 1" in table
    assert s["trials"] == 4 and s["failed"] == 1 and s["complete"] + s["pruned"] == 3


def test_a_study_of_another_configuration_is_not_replaced_without_overwrite(tmp_path, kanji_root):
    tune(tiny_study(tmp_path, kanji_root, trials=1))
    with pytest.raises(UserError, match="another configuration"):
        tune(tiny_study(tmp_path, kanji_root, trials=1, seed=1))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="not a tuning study"):
        tune(tiny_study(tmp_path, kanji_root, trials=1, out=str(tmp_path / "mine"), overwrite=True))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("space, message", [
    ("loss=proxy_anchor/nosuchloss", "unknown loss 'nosuchloss'"),
    ("lr=0..1e-3", "outside lr's range (0, inf)"),
    ("proxy_anchor.alpha=-1..8", "outside proxy_anchor.alpha's range (0, inf)"),
    ("epochs=0..5", "outside epochs's range [1, inf)"),
    ("mode=frozen/sideways", "'sideways' is not one of"),
    ("nosuch=1..2", "not a setting the tuner varies"),
    ("lr=1e-3..1e-4", "lower end must be below"),
])
def test_a_bad_search_space_is_refused_in_one_error_line(capsys, space, message):
    rc = run_cli(main, ["tune", "--show-space", "--space", space])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and message in err


def test_the_default_space_comes_from_the_declarations_and_every_loss():
    from training.losses import LOSSES
    from training.regularizers import REGULARIZERS

    space = build_space(())
    assert set(space["loss"].choices) == set(LOSSES.names())
    assert set(space["regularizer"].choices) == {"none", *REGULARIZERS.names()}
    assert "efficientnet_lite0" in space["backbone"].choices
    assert (space["lr"].lo, space["lr"].hi, space["lr"].log) == (1e-5, 1e-3, True)
    assert space["proxy_anchor.alpha"].describe() == "8..64 log"
    assert [parse_duration(v) for v in ("90s", "30m", "1.5h", "0")] == [90, 1800, 5400, 0]
    with pytest.raises(UserError):
        parse_duration("soon")
    assert json.dumps({k: d.describe() for k, d in space.items()})  # every dimension describes itself


def test_the_demo_runs_a_study_on_the_users_data_without_touching_the_kanji_runs():
    from demo.pipeline import build_parser, demo_data, demo_tail_config, recipe, tuned_config

    args = build_parser().parse_args(["--dataset", "imagefolder", "--data-root", "/data/icons", "--tune", "30m"])
    data = demo_data(args.num_classes, args.dataset, args.data_root, args.image_size)
    tail = demo_tail_config(data=data)
    assert tail.dataset == "imagefolder" and tail.data_root == "/data/icons"
    assert tail.out.startswith("runs/demo-proxy_anchor-tail2-imagefolder-") and demo_tail_config().out == (
        "runs/demo-proxy_anchor-tail2")
    study = tuned_config(data, args.tune, tail.cache_dir)
    assert study.budget_seconds() == 1800 and study.data_root == "/data/icons" and study.out != "runs/demo-tune"
    assert recipe(TrainConfig(mode="finetune", loss="binomial", epochs=4)).startswith(
        "efficientnet_lite0, fine-tuned, binomial, 4 epochs")
