"""CGML (paper 002) and the skewed mean (paper 003) against the papers and independent computations.

  * CGML's X′ and X″ are each a full --batch-size batch by default (our reading of the paper's
    minibatch of 13 classes × 10 as each of them): the metric loss sees batches as large as a plain
    run's, in a real step and a real trainer run; `cgml.batches=split` gives half-size batches exactly;
  * the step's graph-consistency term is ‖S′X′ − S″X″‖_F computed in numpy, and its weighted value is
    logged next to the metric loss;
  * the skewed mean's `max_proxy_cos` is the numpy maximum off-diagonal proxy cosine over all proxies,
    every proxy-loss run logs it per epoch, and a large skewed-mean weight lowers it.
"""
import json

import numpy as np
import pytest
import torch

from training.regularizers.skewed_mean import SkewedMeanParams, SkewedMeanRegularizer, max_proxy_cosine
from training.samplers import epoch_batches

FONTS = ("ipag", "ipam", "seto", "ukai", "kouzan-sousyo", "ume-gothic")
LABELS = np.repeat(np.arange(10), [5, 3, 4, 6, 2, 5, 5, 4, 3, 7])


# ------------------------------------------------------------------ CGML: batch composition
def test_full_pairs_are_two_class_aligned_batches_of_batch_size():
    for b in epoch_batches(LABELS, 16, 2, "full", np.random.RandomState(0)):
        x1, x2 = LABELS[b[:16]], LABELS[b[16:]]
        assert len(b) == 32 and list(x1) == list(x2) and len(set(x1)) == 8
    assert [len(b) for b in epoch_batches(LABELS, 16, 2, True, np.random.RandomState(0))] == [32] * 3  # True: full


def test_split_draws_the_recorded_half_batches_exactly():
    """The indices split batches (each of X′ and X″ half of --batch-size) draw for these arguments, as recorded
    when split was the only option: the measured split-batch rows stay reproducible."""
    old = [[7, 6, 17, 14, 21, 23, 33, 32, 7, 6, 16, 17, 21, 24, 31, 32],
           [16, 15, 7, 6, 11, 9, 20, 23, 15, 12, 7, 5, 10, 8, 24, 21],
           [11, 9, 17, 12, 43, 40, 3, 4, 10, 8, 13, 14, 37, 42, 2, 3]]
    assert [b.tolist() for b in epoch_batches(LABELS, 16, 2, "split", np.random.RandomState(7))] == old
    # under 2 ranks, rank r draws the same pairs and keeps the r-th half of the classes of X′ and of X″
    for r in range(2):
        assert [b.tolist() for b in epoch_batches(LABELS, 16, 2, "split", np.random.RandomState(7), r, 2)] == [
            b[4 * r: 4 * r + 4] + b[8 + 4 * r: 8 + 4 * r + 4] for b in old]


def _build_step(regs=("cgml",), reg_weight=(0.5,), reg_param=(), loss="binomial", n_classes=8, embed_dim=8):
    from model.backbones import build_backbone
    from model.network import EmbeddingModel
    from training.config import TrainConfig
    from training.losses import build_loss
    from training.regularizers import build_regularizers
    from training.step import Step, build_optimizer

    cfg = TrainConfig(embed_dim=embed_dim, lr=1e-3, loss=loss, regularizer=tuple(regs),
                      reg_weight=tuple(reg_weight), reg_param=tuple(reg_param))
    torch.manual_seed(0)
    backbone = build_backbone("small_cnn", "none")
    model = EmbeddingModel(backbone, cfg.embed_dim)
    loss_mod, _ = build_loss(cfg.loss, n_classes, cfg.embed_dim)
    built = build_regularizers(cfg, loss_mod, backbone.dim)
    for p in backbone.parameters():
        p.requires_grad_(False)
    opt = build_optimizer(cfg, model, loss_mod, built, 0)
    return Step(model, loss_mod, built, opt, cfg.grad_clip), model, loss_mod, backbone.dim


def _numpy_gc(a: np.ndarray, b: np.ndarray, sigma: float) -> float:
    def graph(x):
        return np.exp(-((x[:, None, :] - x[None, :, :]) ** 2).sum(-1) / sigma)

    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float(np.linalg.norm(graph(a) @ a - graph(b) @ b, "fro"))


@pytest.mark.parametrize("batches,half", [("full", 16), ("split", 8)])
def test_cgml_step_loss_batches_and_graph_term_against_numpy(batches, half):
    B, M = 16, 4
    step, model, loss, trunk = _build_step(reg_param=("cgml.sigma=0.7", f"cgml.batches={batches}"))
    assert step.paired == batches
    seen = []
    loss.register_forward_pre_hook(lambda mod, args: seen.append(len(args[0])))
    y = np.repeat(np.arange(8), 6)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, trunk, generator=g)[y] + 0.7 * torch.randn(len(y), trunk, generator=g)
    idx = epoch_batches(y, B, M, step.paired, np.random.RandomState(0))[0]
    assert len(idx) == 2 * half
    with torch.no_grad():  # the embeddings the step will see, before its update
        emb = model.neck(x[idx]).double().numpy()
    parts = step(lambda t: t, x[idx], torch.from_numpy(y[idx]), torch.Generator().manual_seed(0))
    assert seen == [half, half]  # the metric loss on X′ and on X″, each `half` embeddings
    want = _numpy_gc(emb[:half], emb[half:], 0.7)
    assert parts["L_GC"] == pytest.approx(want, rel=1e-5)
    assert parts["cgml"] == pytest.approx(0.5 * want, rel=1e-5)  # the weighted term, logged beside "loss"
    assert parts["loss"] > 0


def _tiny_cfg(tmp_path, root, **kw):
    from training.config import TrainConfig

    base = dict(dataset="kanji", data_root=root, num_classes=16, image_size=32, kanji_fonts=FONTS,
                backbone="small_cnn", weights="none", embed_dim=8, epochs=1, batch_size=16, m_per_class=4,
                out=str(tmp_path / "run"), cache_dir=str(tmp_path.parent / "cache-fid"), progress=False,
                lr=1e-3, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def kanji_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("kanji-fid"))


def _log(cfg) -> list[dict]:
    with open(f"{cfg.out}/log.jsonl") as f:
        return [json.loads(line) for line in f]


def _train_recording_loss_sizes(cfg, monkeypatch):
    import training.trainer as trainer

    seen, real = [], trainer.build_loss

    def recording(*a, **k):
        loss, params = real(*a, **k)
        loss.register_forward_pre_hook(lambda mod, args: seen.append(len(args[0])))
        return loss, params

    monkeypatch.setattr(trainer, "build_loss", recording)
    trainer.train(cfg)
    return seen, _log(cfg)


@pytest.mark.parametrize("regs,params,want", [
    ((), (), 16),                                 # the plain arm: --batch-size per loss call
    (("cgml",), (), 16),                          # CGML, full batches: X′ and X″ each --batch-size
    (("cgml",), ("cgml.batches=split",), 8),      # split batches: half each
])
def test_trainer_metric_loss_batch_size(tmp_path, kanji_root, monkeypatch, regs, params, want):
    cfg = _tiny_cfg(tmp_path, kanji_root, loss="binomial", regularizer=regs, reg_param=params)
    seen, log = _train_recording_loss_sizes(cfg, monkeypatch)  # (only training steps call the loss)
    assert seen and set(seen) == {want}
    if regs:
        assert len(seen) % 2 == 0  # two metric-loss calls a step
        # the epoch log shows the metric loss, the weighted graph term and the unweighted one
        e = log[0]
        assert e["train_loss"] > 0 and e["train_L_GC"] > 0
        assert e["train_cgml"] == pytest.approx(0.002 * e["train_L_GC"], rel=1e-6)  # λ = 0.002, the default


# ------------------------------------------------------------------ skewed mean: max proxy cosine
def _numpy_max_cos(P: np.ndarray) -> float:
    Pn = P / np.linalg.norm(P, axis=1, keepdims=True)
    S = Pn @ Pn.T
    np.fill_diagonal(S, -np.inf)
    return float(S.max())


def test_max_proxy_cosine_is_the_numpy_off_diagonal_max():
    rng = np.random.default_rng(0)
    P = rng.normal(size=(23, 5))
    want = _numpy_max_cos(P)
    for chunk in (1, 4, 7, 23, 100):  # exact whatever the row chunks
        assert float(max_proxy_cosine(torch.tensor(P), chunk=chunk)) == pytest.approx(want, abs=1e-6)
    # a subset: the same evenly spaced rows every call
    rows = np.round(np.linspace(0, 22, 6)).astype(int)
    assert float(max_proxy_cosine(torch.tensor(P), limit=6)) == pytest.approx(_numpy_max_cos(P[rows]), abs=1e-6)


def test_skewed_mean_diagnostic_covers_all_proxies_not_the_sampled_ones():
    from training.regularizers import BatchContext

    torch.manual_seed(0)
    P = torch.nn.functional.normalize(torch.randn(40, 6), dim=1)
    P[39] = torch.nn.functional.normalize(P[38] + 0.01 * torch.randn(6), dim=0)  # the closest pair
    reg = SkewedMeanRegularizer(1.0, SkewedMeanParams(max_proxies=4), None, 6, 6)
    e = torch.randn(2, 6)
    ctx = BatchContext(labels=torch.tensor([0, 1]), embeddings=e, neck=e, trunk=e, backbone=e, loss=None,
                       neck_layer=torch.nn.Identity(), generator=torch.Generator().manual_seed(0), proxies=P)
    terms = reg.terms(ctx)
    assert float(terms["max_proxy_cos"]) == pytest.approx(_numpy_max_cos(P.numpy()), abs=1e-6)
    assert float(terms["max_proxy_cos"]) > 0.99


def test_large_skewed_mean_weight_lowers_the_max_proxy_cosine(tmp_path, kanji_root):
    from model.checkpoint import read_checkpoint
    from training.trainer import train

    def max_cos_per_epoch(name, **kw):
        cfg = _tiny_cfg(tmp_path / name, kanji_root, loss="proxy_anchor", epochs=3, seed=1, **kw)
        train(cfg)
        log = _log(cfg)
        assert len(log) == 3 and all("train_max_proxy_cos" in h for h in log)  # with or without the term
        # the last epoch's value is that of the proxies the run ended with
        P = read_checkpoint(f"{cfg.out}/latest.pt")["extra"]["loss_state"]["loss.proxies"].double().numpy()
        assert log[-1]["train_max_proxy_cos"] == pytest.approx(_numpy_max_cos(P), abs=1e-5)
        return [h["train_max_proxy_cos"] for h in log]

    plain = max_cos_per_epoch("plain")
    off = max_cos_per_epoch("w0", regularizer=("skewed_mean",), reg_weight=(0.0,))
    on = max_cos_per_epoch("w10", regularizer=("skewed_mean",), reg_weight=(10.0,))
    assert off == pytest.approx(plain, abs=1e-6)  # weight 0 is the plain run (the term adds nothing, draws nothing)
    assert on[-1] < off[-1] - 0.2, (on, off)
