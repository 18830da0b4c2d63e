"""The default tail recipe from pretrained weights: a probe first (the neck and the loss on cached
frozen-trunk features), and the probe's end state is a selection candidate, so a tail run never
selects a model below it on validation, i.e. never below the frozen neck it starts from."""
import dataclasses
import json

import pytest
import torch
from tiny_kanji import tiny

from model.checkpoint import read_checkpoint
from training.config import TrainConfig
from training.trainer import train


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A small_cnn weights file: to the config a pretrained trunk (--weights PATH), as a user's own."""
    from model.backbones.small_cnn import SmallCNN

    path = tmp_path_factory.mktemp("weights") / "small_cnn.pt"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(SmallCNN().state_dict(), path)
    return str(path)


@pytest.fixture(scope="module")
def frozen(tmp_path_factory, kanji_root, weights):
    """The frozen-neck run (30 epochs on the weights' untouched trunk) the tail runs below are held
    against: one run for the module, (metrics, run folder)."""
    t = tmp_path_factory.mktemp("frozen")
    out = t / "frozen"
    return train(tiny(t, kanji_root, weights=weights, epochs=30, out=str(out), device="cpu")), out


def read_log(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_tail_and_finetune_from_pretrained_weights_probe_by_default(weights):
    assert TrainConfig(train_blocks=2).resolved_probe_epochs() == 30
    assert TrainConfig(mode="tail").resolved_probe_epochs() == 30
    assert TrainConfig(mode="finetune").resolved_probe_epochs() == 30
    assert TrainConfig(backbone="small_cnn", weights=weights, train_blocks=1).resolved_probe_epochs() == 30
    assert TrainConfig(backbone="small_cnn", train_blocks=1).resolved_probe_epochs() == 0  # from scratch
    assert TrainConfig(train_blocks=2, weights="none").resolved_probe_epochs() == 0
    assert TrainConfig(train_blocks=2, probe_epochs=0).resolved_probe_epochs() == 0
    assert TrainConfig().resolved_probe_epochs() == 0  # frozen: the whole run is the probe


def test_when_no_tail_epoch_beats_the_probe_the_probe_is_selected(tmp_path, kanji_root, weights, frozen):
    # a trunk learning rate far too high (100) wrecks the trained stages: every tail epoch is worse than the probe
    cfg = tiny(tmp_path, kanji_root, weights=weights, train_blocks=1, epochs=2, backbone_lr_mult=1e5, device="cpu")
    assert cfg.resolved_probe_epochs() == 30  # the default
    m = train(cfg)
    frozen, frozen_out = frozen
    log = read_log(tmp_path / "run")
    assert [h["epoch"] for h in log] == [0, 1, 2]
    assert all(h["val_map@r"] < log[0]["candidate_val_map@r"] for h in log[1:])  # the scenario holds
    assert m["selected_epoch"] == 0
    # the candidate is the probe's best epoch, i.e. the frozen-neck run's selected model
    assert m["val"]["map@r"] == log[0]["candidate_val_map@r"] == frozen["val"]["map@r"]
    assert log[0]["candidate_probe_epoch"] == frozen["selected_epoch"]
    best = read_checkpoint(tmp_path / "run" / "best.pt")
    ref = read_checkpoint(frozen_out / "best.pt")
    torch.testing.assert_close(best["state_dict"]["neck.linear.weight"], ref["state_dict"]["neck.linear.weight"],
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(best["extra"]["loss_state"]["loss.proxies"],
                               ref["extra"]["loss_state"]["loss.proxies"], rtol=0, atol=1e-6)
    init = torch.load(weights, weights_only=True)  # on the untouched trunk
    assert all(torch.equal(best["state_dict"][f"backbone.trunk.{k}"], v) for k, v in init.items())


def test_the_default_tail_never_ends_below_the_frozen_neck_on_validation(tmp_path, kanji_root, weights, frozen):
    frozen, _ = frozen
    tail = train(tiny(tmp_path, kanji_root, weights=weights, train_blocks=1, epochs=3, device="cpu"))
    assert read_log(tmp_path / "run")[0]["probe_epochs"] == 30
    assert tail["val"]["map@r"] >= frozen["val"]["map@r"]


def test_a_tail_run_recorded_before_tail_probes_is_not_reused_as_the_new_default(tmp_path, kanji_root,
                                                                                 weights):
    """A config.toml's -1 ("the mode's default") means the probe that ran (its log's epoch 0, or none),
    not today's default."""
    from training.trainer import finished_run

    cfg = tiny(tmp_path, kanji_root, weights=weights, train_blocks=1, epochs=1, probe_epochs=0, device="cpu")
    train(cfg)
    toml = tmp_path / "run" / "config.toml"
    toml.write_text(toml.read_text().replace("probe_epochs = 0", "probe_epochs = -1"))  # as written back then
    assert "probe_epochs = -1" in toml.read_text()
    assert finished_run(cfg) is not None  # what ran: no probe
    assert finished_run(dataclasses.replace(cfg, probe_epochs=-1)) is None  # the default now probes
