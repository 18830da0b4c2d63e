"""The four regularizers against independent computations, and their composition in training."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from core.errors import UserError
from model.flows import FlowSpec, build_flow, flow_forward
from training.regularizers import BatchContext
from training.regularizers.cgml import graph_consistency
from training.regularizers.determinant import tangent_augment
from training.regularizers.skewed_mean import SkewedMeanParams, SkewedMeanRegularizer, lse_mean, power_mean
from training.samplers import paired_class_batches


def flow_inverse(flow, y, context=None):
    """x from y = flow(x): an independent check of the flows' forward pass."""
    transform = flow(context).transform if context is not None else flow().transform
    return transform.inv(y)


def randomize(flow, std=0.3):
    torch.manual_seed(1)
    for p in flow.parameters():
        if p.dim() > 0:
            torch.nn.init.normal_(p, std=std)
    return flow.double()


# ------------------------------------------------------------------ flows (determinant, NIR)
@pytest.mark.parametrize("kind,d", [("realnvp", 8), ("nice", 8), ("realnvp", 5), ("glow", 6)])
def test_flow_logdet_equals_autograd_jacobian(kind, d):
    ctx_dim = 3 if kind == "glow" else 0
    f = randomize(build_flow(FlowSpec(kind, d, 4, (16, 16), context=ctx_dim)))
    x = torch.randn(3, d, dtype=torch.float64)
    c = torch.randn(3, ctx_dim, dtype=torch.float64) if ctx_dim else None
    _, ladj, _ = flow_forward(f, x, c)
    for i in range(3):
        ci = c[i: i + 1] if c is not None else None
        J = torch.autograd.functional.jacobian(lambda v, ci=ci: flow_forward(f, v, ci)[0], x[i: i + 1]).reshape(d, d)
        assert float(ladj[i]) == pytest.approx(float(torch.linalg.slogdet(J)[1]), abs=1e-8)
    assert torch.allclose(ladj, torch.zeros(3, dtype=torch.float64)) == (kind == "nice")  # NICE: volume-preserving


@pytest.mark.parametrize("kind,d", [("realnvp", 8), ("nice", 8), ("realnvp", 5), ("glow", 6)])
def test_flow_forward_equals_zukos_own_transform(kind, d):
    """Our layer-by-layer pass (strided split, interleaved merge) against zuko's call_and_ladj."""
    ctx_dim = 3 if kind == "glow" else 0
    f = randomize(build_flow(FlowSpec(kind, d, 4, (16, 16), context=ctx_dim)))
    x = torch.randn(7, d, dtype=torch.float64)
    c = torch.randn(7, ctx_dim, dtype=torch.float64) if ctx_dim else None
    y, ladj, _ = flow_forward(f, x, c)
    want_y, want_ladj = (f(c) if c is not None else f()).transform.call_and_ladj(x)
    torch.testing.assert_close(y, want_y, rtol=0, atol=1e-12)
    torch.testing.assert_close(ladj, want_ladj, rtol=0, atol=1e-12)


def test_plus_one_variant_is_exact_for_one_coupling_layer():
    f = randomize(build_flow(FlowSpec("realnvp", 6, 1, (16, 16))))
    x = torch.randn(1, 6, dtype=torch.float64)
    _, _, plus = flow_forward(f, x, plus_one=True)
    J = torch.autograd.functional.jacobian(lambda v: flow_forward(f, v)[0], x).reshape(6, 6)
    want = torch.log(torch.diagonal(J).abs() + 1).sum()
    assert float(plus[0]) == pytest.approx(float(want), abs=1e-9)


def test_nir_residual_invertible_logdet_and_gradients_reach_proxies():
    from training.losses import build_loss
    from training.regularizers.nir import NIRParams, NIRRegularizer

    torch.manual_seed(0)
    loss, _ = build_loss("proxy_anchor", 5, 6)
    # the official flow; the nll variant, so that at weight 1 the term is the mean NLL
    reg = NIRRegularizer(1.0, NIRParams(blocks=3, hidden=16, layers=3, variant="nll"), loss, 6, 32)
    for p in reg.flow.parameters():
        if p.dim() > 0:
            torch.nn.init.normal_(p, std=0.2)
    x = torch.nn.functional.normalize(torch.randn(4, 6), dim=1)
    c = loss.class_proxies()[torch.tensor([0, 1, 2, 3])]
    z, ladj = reg.residual(x, c)
    back = flow_inverse(reg.flow, z, c)
    assert (back - x).abs().max() < 1e-4
    J = torch.autograd.functional.jacobian(lambda v: reg.residual(v, c[:1])[0], x[:1]).reshape(6, 6)
    assert float(ladj[0]) == pytest.approx(float(torch.linalg.slogdet(J.double())[1]), abs=1e-4)
    nll = reg.nll(torch.randn(4, 6), torch.tensor([0, 1, 2, 3]), loss.class_proxies())
    assert torch.isfinite(nll).all()
    emb = torch.randn(4, 6)
    ctx = BatchContext(labels=torch.tensor([0, 1, 1, 3]), embeddings=emb, neck=emb, trunk=emb, backbone=emb,
                       loss=loss, neck_layer=torch.nn.Identity(), generator=torch.Generator(),
                       proxies=loss.class_proxies())
    terms = reg.terms(ctx)
    assert set(terms) == {"nir", "nir_nll"} and float(terms["nir"]) == pytest.approx(float(terms["nir_nll"]))
    terms["nir"].backward()
    g = loss.proxy_parameters()[0].grad
    assert g is not None and g[[0, 1, 3]].abs().sum() > 0 and g[[2, 4]].abs().sum() == 0


def test_tangent_augmentation_stays_on_sphere_and_moves_towards_a_same_class_partner():
    torch.manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(6, 5), dim=1)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    xt = tangent_augment(x, y, 0.4)
    assert torch.allclose(xt.norm(dim=1), torch.ones(6), atol=1e-6)
    for i in range(0, 6, 2):  # each pair's partner is the other member
        j = i + 1
        assert (xt[i] @ x[j]) > (x[i] @ x[j])
    xt0 = tangent_augment(x, y, 0.0)
    assert torch.allclose(xt0, x, atol=1e-6)


# ------------------------------------------------------------------ CGML
def test_graph_consistency_zero_permutation_invariant_and_numpy():
    rng = np.random.default_rng(0)
    a = torch.tensor(rng.normal(size=(12, 4)))
    b = torch.tensor(rng.normal(size=(12, 4)))
    assert float(graph_consistency(a, a, 1.0)) == pytest.approx(0.0, abs=1e-12)
    perm = torch.randperm(12)
    assert float(graph_consistency(a[perm], b[perm], 0.7)) == pytest.approx(float(graph_consistency(a, b, 0.7)))
    A, B = a.numpy(), b.numpy()

    def S(X, s):
        D = ((X[:, None, :] - X[None, :, :]) ** 2).sum(-1)
        return np.exp(-D / s)

    want = np.linalg.norm(S(A, 0.7) @ A - S(B, 0.7) @ B, "fro")
    assert float(graph_consistency(a, b, 0.7)) == pytest.approx(want, rel=1e-10)


def test_paired_sampler_is_class_aligned():
    labels = np.repeat(np.arange(10), 5)
    batches = paired_class_batches(labels, n_classes=4, n_per_class=3, steps=20, rng=np.random.default_rng(0))
    for b in batches:
        assert len(b) == 24
        x1, x2 = labels[b[:12]], labels[b[12:]]
        assert list(x1) == list(x2) and len(set(x1)) == 4
        assert all(len(set(x1[i: i + 3])) == 1 for i in range(0, 12, 3))
    # the halves are drawn independently: not always the same instances
    assert any(set(b[:12]) != set(b[12:]) for b in batches)


# ------------------------------------------------------------------ skewed means
def test_skewed_means_reach_max_min_and_mean_at_their_limits():
    a = torch.tensor([0.1, 0.5, -0.3, 0.9], dtype=torch.float64)
    assert float(lse_mean(a, 1e4)) == pytest.approx(0.9, abs=1e-3)
    assert float(lse_mean(a, -1e4)) == pytest.approx(-0.3, abs=1e-3)
    assert float(lse_mean(a, 1e-6)) == pytest.approx(float(a.mean()), abs=1e-5)
    d = torch.tensor([0.2, 1.0, 1.4, 0.7], dtype=torch.float64)
    assert float(power_mean(d, 500)) == pytest.approx(1.4, rel=1e-2)     # λ → −∞
    assert float(power_mean(d, -500)) == pytest.approx(0.2, rel=1e-2)    # λ → +∞
    assert float(power_mean(d, 1.0)) == pytest.approx(float(d.mean()))  # the order-1 mean
    assert float(power_mean(d, -1.0)) == pytest.approx(4 / float((1 / d).sum()))  # harmonic (UniformFace)


@pytest.mark.parametrize("form", ["r1", "r2"])
def test_repulsion_pushes_the_closest_pair_apart(form):
    torch.manual_seed(0)
    P = torch.nn.functional.normalize(torch.randn(8, 5), dim=1)
    P[1] = torch.nn.functional.normalize(P[0] + 0.05 * torch.randn(5), dim=0)  # a close pair
    P = P.clone().requires_grad_(True)
    reg = SkewedMeanRegularizer(1.0, SkewedMeanParams(form=form, target=2.0), None, 5, 5)

    def dist(Q):
        Qn = torch.nn.functional.normalize(Q, dim=1)
        D = torch.cdist(Qn, Qn) + 10 * torch.eye(8)
        return D

    before = dist(P.detach())
    v = reg.value(P)
    v.backward()
    with torch.no_grad():
        Q = P - 0.05 * P.grad / P.grad.norm()
    after = dist(Q)
    assert after[0, 1] > before[0, 1]            # the closest pair moved apart
    assert after.min() > before.min()
    # descending the gradient moves p0 away from p1 and p1 away from p0
    d01 = (P[1] - P[0]).detach()
    assert float(-P.grad[0] @ d01) < 0 and float(-P.grad[1] @ -d01) < 0


# ------------------------------------------------------------------ composition in training
FONTS = ("ipag", "ipam", "seto", "ukai", "kouzan-sousyo", "ume-gothic")


def tiny_cfg(tmp_path, **kw):
    from training.config import TrainConfig

    base = dict(dataset="kanji", data_root=str(tmp_path.parent / "kanji-reg"), num_classes=16, image_size=32,
                kanji_fonts=FONTS, backbone="small_cnn", weights="none", embed_dim=8, epochs=2, batch_size=16,
                m_per_class=4, out=str(tmp_path / "run"), cache_dir=str(tmp_path.parent / "cache-reg"),
                progress=False, lr=1e-3)
    base.update(kw)
    return TrainConfig(**base)


def test_refusals(tmp_path):
    from training.trainer import train

    with pytest.raises(UserError, match="acts on class proxies"):
        train(tiny_cfg(tmp_path, loss="triplet", regularizer=("nir",)))
    with pytest.raises(UserError, match="unknown regularizer"):
        train(tiny_cfg(tmp_path, regularizer=("dropout",)))
    with pytest.raises(UserError, match="2 regularizer"):
        train(tiny_cfg(tmp_path, regularizer=("nir", "skewed_mean"), reg_weight=(0.1,)))
    with pytest.raises(UserError, match="no parameter .depth."):
        train(tiny_cfg(tmp_path, regularizer=("nir",), reg_param=("nir.depth=3",)))


@pytest.mark.parametrize("loss,regs,params,head", [
    # NIR at its default flow multiplier (5), named so that the case holds if the default moves
    ("proxy_anchor", ("determinant", "nir", "skewed_mean"), ("determinant.transforms=2", "determinant.hidden=16",
                                                             "nir.flow_lr_mult=5"),
     "embed_head"),
    # the determinant's non-default variants: logdet R, tangent augmentation, no activation, g_max's own
    # loss on detached inputs (through the neck's detached W at the trunk position)
    ("binomial", ("cgml", "determinant"), ("determinant.transforms=2", "determinant.hidden=16",
                                            "determinant.position=trunk", "determinant.variant=logdet",
                                            "determinant.augment=tangent", "determinant.activation=none",
                                            "determinant.gmax_loss=detached"),
     "trunk_head"),
    # NIR's non-default variants: the exp variant on the checkered flow, raw input, embedded condition, noise
    ("proxy_nca", ("nir",), ("nir.variant=exp", "nir.input=raw", "nir.flow=glow_checkered", "nir.layers=3",
                             "nir.clamp=0", "nir.condition=dense_embed", "nir.noise=0.05"), None),
])
def test_several_regularizers_train_and_checkpoint_serves_the_index(tmp_path, loss, regs, params, head):
    from index.backends.search import Searcher
    from index.backends.store import read_index
    from index.build import build_from_dataset
    from model.checkpoint import load_model, read_checkpoint
    from training.trainer import train

    cfg = tiny_cfg(tmp_path, loss=loss, regularizer=regs, reg_param=params)
    m = train(cfg)
    assert math.isfinite(m["test"]["map@r"]) and "uniformity" in m["test"] and "spectral_decay" in m["test"]
    log = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    import json
    first = json.loads(log[0])
    for r in regs:
        assert f"train_{r}" in first
    ck = read_checkpoint(tmp_path / "run" / "best.pt")
    assert not any("g_max" in k or "max_loss" in k for k in ck["state_dict"])  # g_max is not kept
    model, _ = load_model(tmp_path / "run" / "best.pt")
    # the determinant's g_min is the kept metric layer, where its position says; nothing else adds a head
    assert [h for h in ("trunk_head", "embed_head") if getattr(model, h) is not None] == ([head] if head else [])
    idx = tmp_path / "idx"
    build_from_dataset(tmp_path / "run" / "best.pt", cfg.data_config(), idx, cache_dir=cfg.cache_dir, progress=False)
    data = read_index(idx)
    assert data.dim == model.trunk_dim
    assert Searcher(data).search(np.asarray(data.features[:2]), k=3).rows.shape == (2, 3)
    # resume works with regularizer state
    again = train(dataclasses.replace(cfg, resume=True))  # restores regularizer + optimizer state
    assert again["test"]["map@r"] == pytest.approx(m["test"]["map@r"])
