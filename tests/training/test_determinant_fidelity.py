"""The determinant regularizer (paper 000) against independent computations: R over the real and
augmented samples from autograd Jacobians, augmented samples built by hand (nearest same-class
neighbour in numpy), the metric loss seeing the real batch only in a training step, the paper's
defaults, g_max's metric-loss variants and the weight-0 control's gradients, and checkpoints written
before the flow-head activation."""
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
    # eq. 11: λ1 R_min(Z) − λ2 R_max(Z); g_max has no metric loss of its own (gmax_loss=none)
    assert reg.max_loss is None
    assert float(terms["determinant"]) == pytest.approx(0.05 * np.mean(r_min) - 0.05 * np.mean(r_max), abs=1e-9)


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
    reg = make_reg(gmax_loss="attached")  # g_max's own loss too: neither loss sees an augmented sample
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
    assert (p.flow, p.transforms, p.position, p.lambda_max, p.gmax_loss) == ("realnvp", 12, "neck", -1.0, "none")
    assert REGULARIZERS.get("determinant").spec.weight == 0.05
    loss, _ = build_loss("proxy_anchor", C, 16)
    reg = DeterminantRegularizer(0.05, p, loss, 16, 32)
    assert reg.lambda_max == reg.weight == 0.05  # λ2 = λ1
    assert reg.max_loss is None and reg.loss_parameters() == []  # eq. 11: one metric loss, g_min's
    for head in (reg.g_min, reg.g_max):
        assert head.plus_one and isinstance(head.activation, nn.ELU) and head.spec.activation == "elu"
        assert head.spec.kind == "realnvp" and head.spec.transforms == 12


def test_help_names_each_variant_and_the_papers():
    from training.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["train"].format_help().split())
    for word in ("variant=plus_one", "variant=logdet", "augment=feature", "augment=tangent", "activation=elu",
                 "activation=relu|leaky_relu|none", "gmax_loss=none", "gmax_loss=detached|attached",
                 "the paper's defaults"):
        assert word in text, word
    from training.regularizers import REGULARIZERS

    helps = REGULARIZERS.get("determinant").param_help()
    assert "the paper's" in helps["variant"] and "the paper's" in helps["augment"]
    assert "the paper's" in helps["activation"] and "0.4" in helps["epsilon"]
    assert "none (the paper's eq. 11" in helps["gmax_loss"]


def grads(out, params):
    return [torch.zeros_like(q) if g is None else g
            for q, g in zip(params, torch.autograd.grad(out, params, retain_graph=True, allow_unused=True),
                            strict=True)]


def close(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gmax_loss", ["none", "detached", "attached"])
def test_weight_zero_control_gives_neck_and_trunk_plain_trainings_gradient_unless_g_max_loss_is_attached(gmax_loss):
    """The control (weight 0, ε = 0) through the training step, against plain training through g_min written
    out with zuko's own transform: with gmax_loss=none (eq. 11's one metric loss) and detached, the trunk
    output φ, the neck W and g_min get exactly plain training's gradient; attached adds g_max's loss's
    gradient to them.  g_max gets none (none), or its own loss's gradient on u.detach() (detached)."""
    reg = make_reg(weight=0.0, epsilon=0.0, gmax_loss=gmax_loss)
    assert reg.lambda_max == 0.0
    model, step = step_for(reg)
    feats = torch.randn(len(Y), TRUNK, dtype=torch.float64, requires_grad=True)
    total, parts = step.forward(feats, Y, torch.Generator().manual_seed(0))
    assert all(np.isfinite(parts[k]) for k in ("R_min", "R_max", "R_min_real", "R_max_real"))
    W = model.neck.W
    g_min, g_max = list(reg.g_min.parameters()), list(reg.g_max.parameters())
    trunk = [feats, W, *g_min]

    u = nn.functional.elu(feats @ W.T)
    plain = reg.loss(nn.functional.normalize(reg.g_min.flow().transform(u), dim=1), Y)
    if gmax_loss == "none":
        assert reg.max_loss is None and reg.loss_parameters() == []
        assert float(total) == pytest.approx(float(plain), abs=1e-12)
        close(grads(total, trunk), grads(plain, trunk))
        assert all(float(g.abs().max()) == 0 for g in grads(total, g_max))  # g_max idle at weight 0
        return
    own = reg.loss_parameters()
    assert own and {id(q) for q in own}.isdisjoint(id(q) for q in reg.loss.parameters())  # its own proxies
    g_max_in = u.detach() if gmax_loss == "detached" else u
    second = reg.max_loss(nn.functional.normalize(reg.g_max.flow().transform(g_max_in), dim=1), Y)
    assert float(total) == pytest.approx(float(plain + second), abs=1e-12)
    close(grads(total, [*g_max, *own]), grads(second, [*g_max, *own]))
    assert any(float(g.abs().max()) > 0 for g in grads(total, g_max))
    if gmax_loss == "detached":
        close(grads(total, trunk), grads(plain, trunk))
    else:  # a second metric loss on the neck and the trunk
        close(grads(total, trunk), grads(plain + second, trunk))
        diff = [a - b for a, b in zip(grads(total, [feats, W]), grads(plain, [feats, W]), strict=True)]
        assert all(float(d.abs().max()) > 1e-6 for d in diff)


def test_detached_g_max_loss_at_the_trunk_position_leaves_the_neck_alone():
    """At position=trunk g_max's output goes through the neck W before its loss: detached uses W's value,
    so W's gradient is plain training's; attached trains W with the second loss too."""
    from model.network import EmbeddingModel

    feats = torch.randn(len(Y), TRUNK, dtype=torch.float64)
    got = {}
    for gmax_loss in ("detached", "attached"):
        torch.manual_seed(0)
        loss, _ = build_loss("proxy_anchor", C, D)
        p = DeterminantParams(transforms=1, hidden=8, position="trunk", epsilon=0.0, gmax_loss=gmax_loss)
        reg = DeterminantRegularizer(0.0, p, loss.double(), D, TRUNK)
        reg.g_min.double()
        reg.module.double()
        torch.manual_seed(2)
        model = EmbeddingModel(StubBackbone(), D, trunk_head=reg.g_min).double()
        step = Step(model, loss, [reg], opt=None, grad_clip=0.0)
        total, _ = step.forward(feats, Y, torch.Generator().manual_seed(0))
        W = model.neck.W
        u = nn.functional.elu(feats)
        plain = loss(nn.functional.normalize(reg.g_min.flow().transform(u), dim=1) @ W.T, Y)
        got[gmax_loss] = (grads(total, [W]), grads(plain, [W]))
    close(*got["detached"])
    assert float((got["attached"][0][0] - got["attached"][1][0]).abs().max()) > 1e-6


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
