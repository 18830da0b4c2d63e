"""Paper 004's regime: the trunk trains while the neck W stays at its initialisation."""

import pytest
import torch
from torch import nn

from model.checkpoint import load_model
from training.config import TrainConfig
from training.trainer import train

FONTS = ("ipag", "ipam", "seto", "ukai")


def tiny(tmp_path, **kw):
    base = dict(dataset="kanji", data_root=str(tmp_path / "kanji"), num_classes=12, image_size=32, kanji_fonts=FONTS,
                backbone="small_cnn", weights="none", embed_dim=8, epochs=2, batch_size=8, m_per_class=4,
                cache_dir=str(tmp_path / "cache"), progress=False, lr=1e-3, mode="finetune")
    base.update(kw)
    return TrainConfig(**base)


def initial_W(cfg) -> torch.Tensor:
    """The neck the run starts from: the same seeded build, done independently here."""
    from model.backbones import build_backbone
    from model.network import EmbeddingModel
    from training.trainer import torch_seeded

    with torch_seeded(cfg.seed):
        model = EmbeddingModel(build_backbone(cfg.backbone, weights=cfg.weights), cfg.embed_dim)
        if cfg.neck_init == "pytorch":
            model.neck.linear.reset_parameters()
    return model.W.clone()


@pytest.mark.parametrize("init", ["orthogonal", "pytorch"])
def test_neck_lr_mult_zero_keeps_W_at_its_initialisation_while_the_trunk_trains(tmp_path, init):
    cfg = tiny(tmp_path, out=str(tmp_path / "frozen_neck"), neck_lr_mult=0.0, neck_init=init)
    cfg.validate()
    train(cfg)
    model, _ = load_model(tmp_path / "frozen_neck" / "best.pt")
    assert torch.equal(model.W, initial_W(cfg))
    # the trunk did move
    from model.backbones import build_backbone
    from training.trainer import torch_seeded
    with torch_seeded(cfg.seed):
        fresh = build_backbone(cfg.backbone, weights=cfg.weights)
    moved = [
        not torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.backbone.state_dict().values(), strict=True)
        if a.dtype.is_floating_point
    ]
    assert any(moved)


def test_pytorch_neck_init_has_paper_004s_trace_scale():
    # nn.Linear's init draws W ~ U(−1/√in, 1/√in): E tr(WᵀW) = rows/3, whatever `in` is (paper 004: 42.72 for 128 rows)
    torch.manual_seed(0)
    lin = nn.Linear(1024, 128, bias=False)
    W = lin.weight.detach().double()
    M = W.t() @ W
    assert float(torch.trace(M)) == pytest.approx(128 / 3, rel=0.01)
    # E‖WWᵀ‖²_F = rows/9 on the diagonal + rows(rows−1)/(9·in) off it
    assert float((M**2).sum()) == pytest.approx(128 / 9 + 128 * 127 / (9 * 1024), rel=0.03)


def test_neck_lr_mult_negative_is_refused(tmp_path):
    from core.errors import UserError

    with pytest.raises(UserError, match="neck-lr-mult"):
        tiny(tmp_path, neck_lr_mult=-1.0).validate()


def test_demo_paper_regime_config_is_paper_004s_regime():
    from demo.pipeline import build_parser, demo_paper_config, demo_tail_config

    cfg = demo_paper_config()
    cfg.validate()
    assert cfg.resolved_mode() == "finetune" and cfg.neck_lr_mult == 0 and cfg.neck_init == "pytorch"
    # the same data and loss as the demo's own model: the comparison changes only the regime
    assert cfg.data_config() == demo_tail_config().data_config() and cfg.loss == demo_tail_config().loss
    assert build_parser().parse_args(["--paper-regime"]).paper_regime


def test_a_held_neck_with_a_loss_without_parameters_skips_the_probe(tmp_path, monkeypatch):
    """Triplet has no proxies: with the neck held, a probe has nothing to train (it would build an optimizer
    over no parameters); the run goes straight to the trunk."""
    import training.trainer as trainer

    calls = []
    monkeypatch.setattr(trainer.Run, "probe", lambda self, source, epochs: calls.append(epochs))
    cfg = tiny(tmp_path, out=str(tmp_path / "triplet"), loss="triplet", neck_lr_mult=0.0, probe_epochs=2, epochs=1)
    train(cfg)
    assert calls == []
    cfg = tiny(
        tmp_path,
        out=str(tmp_path / "pa"),
        loss="proxy_anchor",
        neck_lr_mult=0.0,
        probe_epochs=2,
        epochs=1,
        overwrite=True,
    )
    train(cfg)  # the stub's None stands for "no probe entry"
    assert calls == [2]  # proxies to train: the probe runs


def test_a_skipped_probe_is_the_resolved_probe_so_the_run_is_reused(tmp_path):
    """The resolved probe of a held neck with Triplet is 0, what the run records: the same config
    reuses the run instead of refusing it as a different one."""
    from training.trainer import train_or_reuse

    held = dict(loss="triplet", neck_lr_mult=0.0, probe_epochs=2)
    assert tiny(tmp_path, **held).resolved_probe_epochs() == 0
    assert tiny(tmp_path, **(held | {"loss": "proxy_anchor"})).resolved_probe_epochs() == 2
    assert tiny(tmp_path, **(held | {"neck_lr_mult": 1.0})).resolved_probe_epochs() == 2
    cfg = tiny(tmp_path, out=str(tmp_path / "t"), loss="triplet", neck_lr_mult=0.0, probe_epochs=3, epochs=1)
    assert cfg.resolved_probe_epochs() == 0
    first, reused = train_or_reuse(cfg)
    again, reused_again = train_or_reuse(cfg)
    assert not reused and reused_again and again["test"] == first["test"]
