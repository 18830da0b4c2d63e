"""Linear probing before fine-tuning (`--probe-epochs`): the probe is a frozen-neck run, exactly;
its end state is the first selection candidate; a resumed run does not probe again; "auto" means 30
epochs for tail and finetune from pretrained weights and none otherwise, and runs recorded before the
flag existed (no probe) are not mistaken for probed ones."""
import dataclasses
import json

import pytest
import torch
from tiny_kanji import tiny

from model.checkpoint import read_checkpoint
from training.checkpoints import same_identity
from training.config import TrainConfig
from training.trainer import Run, train


def test_the_probe_is_the_frozen_neck_run(tmp_path, kanji_root):
    frozen = tiny(tmp_path, kanji_root, epochs=3, out=str(tmp_path / "frozen"), device="cpu")
    train(frozen)
    run = Run(tiny(tmp_path, kanji_root, mode="finetune", probe_epochs=3, epochs=1, device="cpu"))
    run.setup()
    ref = read_checkpoint(tmp_path / "frozen" / "latest.pt")
    for k in ("neck.linear.weight",):
        torch.testing.assert_close(run.model.state_dict()[k], ref["state_dict"][k], rtol=0, atol=1e-6)
    log = [json.loads(line) for line in (tmp_path / "frozen" / "log.jsonl").read_text().splitlines()]
    assert run.probe_entry["epoch"] == 0 and run.probe_entry["probe_epochs"] == 3
    assert run.probe_entry["val_map@r"] == pytest.approx(log[-1]["val_map@r"], abs=1e-6)
    # the proxies too: the trunk starts training under the frozen run's loss
    torch.testing.assert_close(run.loss.state_dict()["loss.proxies"], ref["extra"]["loss_state"]["loss.proxies"],
                               rtol=0, atol=1e-6)


def test_the_probe_is_logged_as_epoch_0_a_candidate_and_not_repeated_on_resume(tmp_path, kanji_root,
                                                                                monkeypatch):
    cfg = tiny(tmp_path, kanji_root, mode="finetune", probe_epochs=2, epochs=2, device="cpu")

    class Killed(Exception):
        pass

    def die(epoch):
        if epoch == 1:
            raise Killed

    with pytest.raises(Killed):
        train(cfg, on_epoch_end=die)

    def no_probe(*a, **k):
        raise AssertionError("a resumed run probed again")

    monkeypatch.setattr(Run, "probe", no_probe)
    m = train(dataclasses.replace(cfg, resume=True))
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in log] == [0, 1, 2] and log[0]["probe_epochs"] == 2
    assert m["selected_epoch"] == max(log, key=lambda h: h["val_map@r"])["epoch"]  # the probe a candidate too
    assert m["train_seconds"] > 0


def test_auto_probe_epochs_and_old_runs():
    assert TrainConfig(mode="finetune").identity()["probe_epochs"] == 30
    assert TrainConfig(mode="finetune", weights="none").identity()["probe_epochs"] == 0  # from scratch
    assert TrainConfig(train_blocks=2).identity()["probe_epochs"] == 30
    assert TrainConfig(train_blocks=2, weights="none").identity()["probe_epochs"] == 0
    assert TrainConfig(train_blocks=2, probe_epochs=5).identity()["probe_epochs"] == 5
    assert TrainConfig(probe_epochs=5).identity()["probe_epochs"] == 0  # frozen: the whole run is the probe
    for mode, same in (("finetune", False), ("tail", False), ("frozen", True)):
        cfg = TrainConfig(mode=mode)
        old = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "probe_epochs"}  # before the flag
        assert same_identity(old, cfg) is same, mode
        assert same_identity(dataclasses.asdict(cfg), cfg)  # a config.toml's -1 is the mode's default
