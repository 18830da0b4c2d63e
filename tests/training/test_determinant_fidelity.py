"""The determinant regularizer (paper 000) against independent computations: R over the real and
augmented samples from autograd Jacobians, augmented samples built by hand (nearest same-class
neighbour in numpy), the metric loss seeing the real batch only in a training step, the paper's
defaults, the weight-0 control, and checkpoints written before the flow-head activation."""
import argparse
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from training.losses import build_loss
from training.regularizers import BatchContext
from training.regularizers.determinant import DeterminantParams, DeterminantRegularizer
from training.step import Step

D, TRUNK, C = 4, 6, 5
Y = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])  # class 2 is alone: no augmented sample for it


def make_reg(weight=0.05, **kw) -> DeterminantRegularizer:
    torch.manual_seed(0)
    loss, _ = build_loss("proxy_anchor", C, D)
    p = dataclasses.replace(DeterminantParams(transforms=1, hidden=8), **kw)
    reg = DeterminantRegularizer(weight, p, loss, D, TRUNK)
    torch.manual_seed(1)
    for flow in (reg.g_min.flow, reg.g_max.flow):  # away from the identity start: non-trivial Jacobians
        for q in flow.parameters():
            if q.dim() > 0:
                nn.init.normal_(q, std=0.3)
    reg.g_min.double()
    reg.module.double()
    reg.loss = loss.double()
    return reg


def context(reg, neck) -> BatchContext:
    """What Step.forward hands a regularizer for a neck-position flow head."""
    emb, *terms = reg.g_min.with_terms(neck)
    return BatchContext(labels=Y, embeddings=emb, neck=neck, trunk=neck, backbone=neck, loss=reg.loss,
                        neck_layer=nn.Identity(), generator=torch.Generator().manual_seed(0),
                        head_terms={"embed_head": terms})


def np_elu(x):
    return np.where(x > 0, x, np.expm1(x))


def np_augmented(u: np.ndarray, y: np.ndarray, eps: float) -> np.ndarray:
    """u_i + ε (u_j − u_i), u_j the nearest other same-class sample; none for a sample alone."""
    out = []
    for i in range(len(u)):
        others = [j for j in range(len(u)) if j != i and y[j] == y[i]]
        if others:
            j = min(others, key=lambda k: np.linalg.norm(u[k] - u[i]))
            out.append(u[i] + eps * (u[j] - u[i]))
    return np.array(out)


def R_by_jacobian(flow, z: torch.Tensor, variant: str) -> float:
    """R(z) from autograd: plus_one, (1/d) Σ over coupling layers Σ_t log(|∂y_t/∂x_t| + 1) with each
    layer's Jacobian at its own input (exact for one layer); logdet, (1/d) log|det| of the whole stack."""
    layers = flow().transform.transforms
    if variant == "logdet":
        J = torch.autograd.functional.jacobian(lambda v: flow().transform(v), z)
        return float(torch.linalg.slogdet(J)[1]) / len(z)
    total, v = 0.0, z
    for t in layers:
        J = torch.autograd.functional.jacobian(t, v)
        total += float(torch.log(torch.diagonal(J).abs() + 1).sum())
        v = t(v)
    return total / len(z)


@pytest.mark.parametrize("variant,transforms", [("plus_one", 1), ("plus_one", 3), ("logdet", 3)])
def test_R_over_real_and_augmented_samples_equals_autograd_jacobians(variant, transforms):
    reg = make_reg(variant=variant, transforms=transforms)
    rng = np.random.default_rng(0)
    neck_np = rng.normal(size=(len(Y), D))
    terms = reg.terms(context(reg, torch.tensor(neck_np)))

    u = np_elu(neck_np)  # the flows' input space
    aug = np_augmented(u, Y.numpy(), 0.4)
    assert len(aug) == len(Y) - 1
    Z = torch.tensor(np.concatenate([u, aug]))
    with torch.no_grad():
        r_min = [R_by_jacobian(reg.g_min.flow, z, variant) for z in Z]
        r_max = [R_by_jacobian(reg.g_max.flow, z, variant) for z in Z]
    n = len(Y)
    assert float(terms["R_min"]) == pytest.approx(np.mean(r_min), abs=1e-9)
    assert float(terms["R_max"]) == pytest.approx(np.mean(r_max), abs=1e-9)
    assert float(terms["R_min_real"]) == pytest.approx(np.mean(r_min[:n]), abs=1e-9)
    assert float(terms["R_max_real"]) == pytest.approx(np.mean(r_max[:n]), abs=1e-9)
    # eq. 11: λ1 R_min(Z) − λ2 R_max(Z), plus g_max's own metric loss on the real samples
    with torch.no_grad():
        emb_max = nn.functional.normalize(reg.g_max.flow().transform(torch.tensor(u)), dim=1)
        want = 0.05 * np.mean(r_min) - 0.05 * np.mean(r_max) + float(reg.max_loss(emb_max, Y))
    assert float(terms["determinant"]) == pytest.approx(want, abs=1e-9)


def test_no_augmentation_with_epsilon_zero_and_logdet_variant_on_real_samples():
    reg = make_reg(epsilon=0.0)
    terms = reg.terms(context(reg, torch.randn(len(Y), D, dtype=torch.float64)))
    assert float(terms["R_min"]) == float(terms["R_min_real"])
    assert float(terms["R_max"]) == float(terms["R_max_real"])


class Recorder:
    """Records the embeddings a loss module is called with (a forward pre-hook)."""

    def __init__(self, module):
        self.seen = []
        module.register_forward_pre_hook(lambda m, args: self.seen.append(args[0].detach().clone()))


class StubBackbone(nn.Module):
    dim = TRUNK


def step_for(reg):
    from model.network import EmbeddingModel

    torch.manual_seed(2)
    model = EmbeddingModel(StubBackbone(), D, embed_head=reg.g_min).double()
    return model, Step(model, reg.loss, [reg], opt=None, grad_clip=0.0)


def test_augmented_samples_never_reach_the_metric_loss_in_a_training_step():
    reg = make_reg()
    model, step = step_for(reg)
    main, own = Recorder(reg.loss), Recorder(reg.max_loss)
    feats = torch.randn(len(Y), TRUNK, dtype=torch.float64)
    loss, parts = step.forward(feats, Y, torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)
    with torch.no_grad():
        neck = model.neck(feats)
        want_min = nn.functional.normalize(reg.g_min.flow().transform(nn.functional.elu(neck)), dim=1)
        want_max = nn.functional.normalize(reg.g_max.flow().transform(nn.functional.elu(neck)), dim=1)
    # each metric loss is called once, on the real batch's embeddings of its own flow
    assert len(main.seen) == 1 and len(own.seen) == 1
    torch.testing.assert_close(main.seen[0], want_min, rtol=0, atol=1e-12)
    torch.testing.assert_close(own.seen[0], want_max, rtol=0, atol=1e-12)
    # while R covered the augmented samples too
    assert parts["R_min"] != pytest.approx(parts["R_min_real"])
    assert parts["R_max"] != pytest.approx(parts["R_max_real"])

    # the tangent variant puts its augmented unit embeddings into the metric loss (a second call)
    reg = make_reg(augment="tangent")
    model, step = step_for(reg)
    main = Recorder(reg.loss)
    _, parts = step.forward(feats, Y, torch.Generator().manual_seed(0))
    assert [len(e) for e in main.seen] == [len(Y), len(Y)]
    assert parts["R_min"] == parts["R_min_real"]  # and takes R on the real samples only


def test_gradient_of_R_reaches_the_flows_and_the_partner_through_the_augmented_samples():
    reg = make_reg()
    neck = torch.randn(len(Y), D, dtype=torch.float64, requires_grad=True)
    terms = reg.terms(context(reg, neck))
    n, size = len(Y), len(Y) + len(Y) - 1
    # the augmented samples' share of each R (means over Z, of size n + 7)
    for name, flow in (("R_min", reg.g_min.flow), ("R_max", reg.g_max.flow)):
        aug_sum = terms[name] * size - terms[f"{name}_real"] * n
        grads = torch.autograd.grad(aug_sum, [neck, *flow.parameters()], retain_graph=True, allow_unused=True)
        # (the real samples' share cancels up to rounding)
        assert grads[0].norm(dim=1).gt(1e-6).tolist() == [True] * 5 + [False] + [True] * 2  # class 2 alone
        assert float(grads[0][5].norm()) < 1e-12
        assert sum(float(g.norm()) for g in grads[1:] if g is not None) > 1e-4


def test_defaults_are_the_papers():
    from training.regularizers import REGULARIZERS

    p = DeterminantParams()
    assert (p.variant, p.augment, p.epsilon, p.activation) == ("plus_one", "feature", 0.4, "elu")
    assert (p.flow, p.transforms, p.position, p.lambda_max) == ("realnvp", 12, "neck", -1.0)
    assert REGULARIZERS.get("determinant").spec.weight == 0.05
    loss, _ = build_loss("proxy_anchor", C, 16)
    reg = DeterminantRegularizer(0.05, p, loss, 16, 32)
    assert reg.lambda_max == reg.weight == 0.05  # λ2 = λ1
    for head in (reg.g_min, reg.g_max):
        assert head.plus_one and isinstance(head.activation, nn.ELU) and head.spec.activation == "elu"
        assert head.spec.kind == "realnvp" and head.spec.transforms == 12


def test_help_names_each_variant_and_the_papers():
    from training.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["train"].format_help().split())
    for word in ("variant=plus_one", "variant=logdet", "augment=feature", "augment=tangent", "activation=elu",
                 "activation=relu|leaky_relu|none", "the paper's defaults"):
        assert word in text, word
    from training.regularizers import REGULARIZERS

    helps = REGULARIZERS.get("determinant").param_help()
    assert "the paper's" in helps["variant"] and "the paper's" in helps["augment"]
    assert "the paper's" in helps["activation"] and "0.4" in helps["epsilon"]


def test_weight_zero_epsilon_zero_control_trains_the_flows_by_the_metric_losses_only():
    reg = make_reg(weight=0.0, epsilon=0.0)
    assert reg.lambda_max == 0.0
    model, step = step_for(reg)
    feats = torch.randn(len(Y), TRUNK, dtype=torch.float64)
    loss, parts = step.forward(feats, Y, torch.Generator().manual_seed(0))
    assert all(np.isfinite(parts[k]) for k in ("R_min", "R_max", "R_min_real", "R_max_real"))
    flows = [*reg.g_min.parameters(), *reg.g_max.parameters()]
    got = torch.autograd.grad(loss, flows, allow_unused=True)
    neck = model.neck(feats)
    u = nn.functional.elu(neck)
    metric = (reg.loss(nn.functional.normalize(reg.g_min.flow().transform(u), dim=1), Y)
              + reg.max_loss(nn.functional.normalize(reg.g_max.flow().transform(u), dim=1), Y))
    want = torch.autograd.grad(metric, flows, allow_unused=True)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert any(a is not None and a.abs().sum() > 0 for a in got)


def test_old_checkpoint_spec_without_activation_still_builds_and_new_specs_round_trip():
    from model.backbones import build_backbone
    from model.checkpoint import model_from_checkpoint
    from model.flows import FlowSpec
    from model.network import EmbeddingModel, FlowHead

    for activation in ("none", "elu"):
        torch.manual_seed(0)
        head = FlowHead(FlowSpec("realnvp", 8, 2, (16, 16), activation=activation))
        model = EmbeddingModel(build_backbone("small_cnn", "none"), 8, embed_head=head).eval()
        spec = model.heads_spec()["embed_head"]
        assert spec["activation"] == activation
        if activation == "none":
            del spec["activation"]  # as written before the field existed
        ck = {"backbone": "small_cnn", "embed_dim": 8, "heads": {"embed_head": spec},
              "state_dict": model.state_dict()}
        rebuilt = model_from_checkpoint(ck)
        assert rebuilt.embed_head.spec.activation == activation
        x = torch.randn(5, model.trunk_dim)
        with torch.no_grad():
            torch.testing.assert_close(rebuilt.embed_features(x), model.embed_features(x), rtol=0, atol=0)
