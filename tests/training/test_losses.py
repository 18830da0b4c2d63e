"""Every registered loss trains; binomial deviance matches its formula; proxies reach the optimizer."""
import math

import numpy as np
import pytest
import torch

from training.losses import LOSSES, build_loss, has_proxies
from training.losses.binomial import BinomialDevianceLoss


def clustered_features(seed=0, classes=8, per_class=6, dim=32):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g)
    y = torch.arange(classes).repeat_interleave(per_class)
    x = centers[y] + 0.8 * torch.randn(len(y), dim, generator=g)
    return x, y


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_each_loss_falls_in_a_few_steps(name):
    torch.manual_seed(0)
    x, y = clustered_features()
    neck = torch.nn.Linear(32, 16, bias=False)
    loss_fn, _ = build_loss(name, 8, 16)
    opt = torch.optim.AdamW([{"params": neck.parameters(), "lr": 1e-2},
                             {"params": loss_fn.parameters(), "lr": 1e-1}])
    first = None
    losses = []
    for _ in range(40):
        loss = loss_fn(neck(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert math.isfinite(last) and last < first, (name, first, last)


def test_binomial_matches_the_formula_computed_directly():
    torch.manual_seed(1)
    e = torch.randn(10, 5)
    y = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 3])
    got = BinomialDevianceLoss(alpha=2.0, beta=0.5, neg_cost=25.0)(e, y)
    x = e / e.norm(dim=1, keepdim=True)
    pos, neg = [], []
    for i in range(10):
        for j in range(10):
            if i == j:
                continue
            D = float(x[i] @ x[j])
            s = 1 if y[i] == y[j] else 0
            eta = 1.0 if s else 25.0
            v = math.log(1 + math.exp(-(2 * s - 1) * 2.0 * (D - 0.5) * eta))
            (pos if s else neg).append(v)
    want = sum(pos) / len(pos) + sum(neg) / len(neg)
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_proxy_losses_expose_proxies_and_trainer_optimises_them():
    for name in ("proxy_anchor", "proxy_nca", "arcface", "soft_triple"):
        loss, _ = build_loss(name, 6, 16)
        assert has_proxies(name) and loss.proxy_parameters()
        p = loss.class_proxies()
        assert p.shape == (6, 16)
        torch.testing.assert_close(p.norm(dim=1), torch.ones(6))
        assert all(q.requires_grad for q in loss.proxy_parameters())
    for name in ("triplet", "npair", "multi_similarity", "binomial", "contrastive"):
        assert not has_proxies(name) and not build_loss(name, 6, 16)[0].proxy_parameters()


def test_proxies_actually_move_in_training():
    torch.manual_seed(0)
    x, y = clustered_features()
    neck = torch.nn.Linear(32, 16, bias=False)
    loss_fn, _ = build_loss("proxy_nca", 8, 16)
    before = loss_fn.proxy_parameters()[0].detach().clone()
    opt = torch.optim.AdamW([*neck.parameters(), *loss_fn.parameters()], lr=1e-2)
    for _ in range(3):
        loss = loss_fn(neck(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(before, loss_fn.proxy_parameters()[0].detach())


def test_loss_params_are_typed_and_checked():
    from core.errors import UserError

    _, p = build_loss("proxy_anchor", 4, 8, ["alpha=16", "margin=0.2"])
    assert p == {"alpha": 16.0, "margin": 0.2}
    with pytest.raises(UserError, match="no parameter 'gamma'"):
        build_loss("proxy_anchor", 4, 8, ["gamma=1"])
    with pytest.raises(UserError, match="not a number"):
        build_loss("proxy_anchor", 4, 8, ["alpha=big"])
    with pytest.raises(UserError, match="unknown loss"):
        build_loss("lifted", 4, 8)
