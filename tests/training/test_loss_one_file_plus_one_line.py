""""One file plus one line", for real: a loss registered here, and nowhere else, is listed by
`training train --help` and `training list`, takes typed --loss-param values, and trains."""
import json
from dataclasses import dataclass

import pytest
import torch

from core.params import param
from training.losses import LOSSES, MetricLoss


@dataclass
class ScaledParams:
    scale: float = param(2.0, "factor on the pair loss")


class ScaledPairLoss(MetricLoss):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, embeddings, labels):
        x = torch.nn.functional.normalize(embeddings, dim=1)
        same = (labels[:, None] == labels[None, :]).float()
        return self.scale * ((x @ x.t() - same) ** 2).mean()


def scaled_pair(C, d, p: ScaledParams):
    """Scaled pair: a test-only loss."""
    return ScaledPairLoss(p.scale)


@pytest.fixture
def scaled_registered():
    LOSSES.register("scaled_pair", ScaledParams)(scaled_pair)  # the one line
    try:
        yield "scaled_pair"
    finally:
        LOSSES.unregister("scaled_pair")


def cli(capsys, *argv) -> str:
    from training.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # --help exits 0
        rc = e.code
    assert rc == 0
    return capsys.readouterr().out


def test_new_loss_reaches_help_list_and_training(scaled_registered, tmp_path, capsys):
    from model.checkpoint import read_checkpoint
    from training.cli import build_parser

    assert "list" in build_parser().format_help()
    train_help = " ".join(cli(capsys, "train", "--help").split())
    assert "scaled_pair: Scaled pair: a test-only loss." in train_help
    assert "scaled_pair: scale=2.0" in train_help  # its key under --loss-param
    listing = cli(capsys, "list", "losses")
    assert "scaled_pair" in listing and "scale = 2.0  factor on the pair loss" in listing

    out = tmp_path / "run"
    cli(capsys, "train", "--dataset", "kanji", "--data-root", tmp_path / "kanji", "--num-classes", "12",
        "--image-size", "32", "--kanji-fonts", "ipag,ipam,seto,ukai", "--backbone", "small_cnn",
        "--weights", "none", "--embed-dim", "8", "--epochs", "1", "--batch-size", "8", "--m-per-class", "4",
        "--loss", "scaled_pair", "--loss-param", "scale=3", "--out", out, "--cache-dir", tmp_path / "cache",
        "--no-progress")
    ck = read_checkpoint(out / "best.pt")
    assert ck["extra"]["loss_name"] == "scaled_pair" and ck["extra"]["loss_params"] == {"scale": 3.0}
    assert json.loads((out / "log.jsonl").read_text().splitlines()[0])["train_loss"] > 0


def test_unknown_loss_key_is_refused_with_the_valid_ones(scaled_registered, tmp_path):
    from core.errors import UserError
    from training.config import TrainConfig

    with pytest.raises(UserError, match=r"no parameter 'gamma'; valid: \['scale'\]"):
        TrainConfig(loss="scaled_pair", loss_param=("gamma=1",), out=str(tmp_path / "r")).validate()


def test_unregistering_removes_it_again(capsys):
    assert "scaled_pair" not in cli(capsys, "train", "--help")
