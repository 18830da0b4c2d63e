"""NIR (paper 001) against its official code (ExplainableML/NonIsotropicProxyDML): the objective,
the FrEIA GLOW flow with its soft clamp, the condition, the noise and the learning rates, each
checked against an independent computation (the flow against FrEIA 0.2 itself); the named variants
(nll, exp, the checkered flow) compute what they say."""
import dataclasses
import math

import numpy as np
import pytest
import torch
import zuko
from torch.nn import functional as F
from zuko.flows import GeneralCouplingTransform
from zuko.lazy import Flow, UnconditionalDistribution, UnconditionalTransform
from zuko.transforms import PermutationTransform

from core.errors import UserError
from model.flows import FlowSpec, SoftClampAffineTransform, build_flow, flow_forward
from training.config import TrainConfig
from training.regularizers import REGULARIZERS, BatchContext
from training.regularizers import nir as nir_mod
from training.regularizers.nir import NIRParams, NIRRegularizer


def make(d=6, C=5, weight=None, **kw):
    from training.losses import build_loss

    torch.manual_seed(0)
    loss, _ = build_loss("proxy_anchor", C, d)
    w = REGULARIZERS.get("nir").spec.weight if weight is None else weight
    p = dataclasses.replace(NIRParams(), **{"blocks": 2, "hidden": 16, "layers": 3} | kw)
    return NIRRegularizer(w, p, loss, d, 32), loss


def ctx_of(emb, y, loss, generator=None):
    return BatchContext(labels=y, embeddings=emb, neck=emb, trunk=emb, backbone=emb, loss=loss,
                        neck_layer=torch.nn.Identity(), generator=generator or torch.Generator(),
                        proxies=loss.class_proxies())


def official_normflow(flow, d, blocks, layers, hidden, clamp=2.0, seeds=None):
    """The official criteria/nir.py NormFlow graph, built with FrEIA 0.2 itself (InputNode; per block k
    PermuteRandom(seed=k), then GLOWCouplingBlock with the soft clamp and subnet_fc, conditioned by its own
    ConditionNode; GraphINN), its sub-networks loaded with `flow`'s weights.  FrEIA's block transforms
    the first half from [x2, c] with subnet2, then the second from [y1, c] with subnet1, and reads
    (s, t) as the last layer's two halves; zuko's hyper-network interleaves (t, a) per dimension, so
    the last layer's rows are reordered.  `seeds`: the permutations' seeds (the official code's k)."""
    import FrEIA.framework as Ff
    import FrEIA.modules as Fm

    def subnet_fc(dims_in, dims_out):  # NormFlow.subnet_fc: fc_init 'none', ReLU, no dropout
        mods = [torch.nn.Linear(dims_in, hidden)]
        for _ in range(layers - 2):
            mods += [torch.nn.ReLU(), torch.nn.Linear(hidden, hidden)]
        return torch.nn.Sequential(*mods, torch.nn.ReLU(), torch.nn.Linear(hidden, dims_out))

    state = np.random.get_state()  # PermuteRandom reseeds numpy's global generator
    try:
        nodes = [Ff.InputNode(d, name="Input")]
        conds = [Ff.ConditionNode(d, name=f"condition_{k}") for k in range(blocks)]
        for k in range(blocks):
            nodes.append(Ff.Node(nodes[-1], Fm.PermuteRandom, {"seed": k if seeds is None else seeds[k]},
                                 name=f"permute_{k}"))
            nodes.append(Ff.Node(nodes[-1], Fm.GLOWCouplingBlock, {"clamp": clamp, "subnet_constructor": subnet_fc},
                                 name=f"fc_{k}", conditions=conds[k]))
        inn = Ff.GraphINN(nodes + [Ff.OutputNode(nodes[-1], name="output")] + conds)
    finally:
        np.random.set_state(state)
    glow = [m for m in inn.modules() if isinstance(m, Fm.GLOWCouplingBlock)]
    ours = [t for t in flow.transform.transforms if isinstance(t, GeneralCouplingTransform)]
    assert len(glow) == blocks and len(ours) == 2 * blocks
    with torch.no_grad():
        for k, block in enumerate(glow):
            for sub, coupling in ((block.subnet2, ours[2 * k]), (block.subnet1, ours[2 * k + 1])):
                theirs = [m for m in sub if isinstance(m, torch.nn.Linear)]
                mine = [m for m in coupling.hyper if isinstance(m, zuko.nn.Linear)]
                assert [m.weight.shape for m in theirs] == [m.weight.shape for m in mine]
                n = mine[-1].out_features // 2
                rows = torch.cat([torch.arange(1, 2 * n, 2), torch.arange(0, 2 * n, 2)])  # (s…, t…) from (t, a) pairs
                for i, (a, b) in enumerate(zip(theirs, mine, strict=True)):
                    last = i == len(mine) - 1
                    a.weight.copy_(b.weight[rows] if last else b.weight)
                    a.bias.copy_(b.bias[rows] if last else b.bias)
    return inn.to(next(flow.parameters()).dtype)


def run_official(inn, x, c, blocks):
    """(z, log_jac_det), as criteria/nir.py calls NormFlow: normflow(batch, c=[cond] * blocks)."""
    return inn(x, c=[c] * blocks, jac=True)


def freia_permutation(seed, d):
    """FrEIA PermuteRandom(seed): np.random.seed(seed); np.random.permutation(d) (global state restored)."""
    state = np.random.get_state()
    np.random.seed(seed)
    perm = np.random.permutation(d)
    np.random.set_state(state)
    return perm


# ------------------------------------------------------------------ flow: FrEIA GLOW with soft clamp
def test_soft_clamp_is_freias_atan_form_and_bounds_the_log_scale():
    a = torch.tensor([-1e6, -3.0, -0.2, 0.0, 0.5, 4.0, 1e6], dtype=torch.float64)
    for clamp in (2.0, 0.7):
        t = SoftClampAffineTransform(torch.zeros_like(a), a, clamp=clamp)
        want = clamp * 0.636 * np.arctan(a.numpy())  # FrEIA/modules/coupling_layers.py: 0.636 * atan(u)
        np.testing.assert_allclose(t.log_scale.numpy(), want, rtol=1e-12)
        assert t.log_scale.abs().max() < clamp
        x = torch.randn(7, dtype=torch.float64)
        np.testing.assert_allclose(t(x).numpy(), np.exp(want) * x.numpy(), rtol=1e-12)
        np.testing.assert_allclose(t.inv(t(x)).numpy(), x.numpy(), rtol=1e-10)


def test_glow_permutations_are_freias_permute_random():
    f = build_flow(FlowSpec("glow", 10, 3, (8,), context=2, clamp=2.0))
    assert len(f.transform.transforms) == 9  # per block: permutation, then the two half couplings
    for k in range(3):
        assert f.transform.transforms[3 * k]().order.tolist() == freia_permutation(k, 10).tolist()


@pytest.mark.parametrize("kind,d,clamp", [("glow", 6, 2.0), ("glow", 5, 2.0), ("glow", 6, 0.0),
                                          ("glow_checkered", 6, 0.0), ("glow_checkered", 6, 2.0)])
def test_glow_logdet_equals_autograd_jacobian_and_zukos_transform(kind, d, clamp):
    f = build_flow(FlowSpec(kind, d, 3, (16, 16), context=3, clamp=clamp))
    torch.manual_seed(1)
    for p in f.parameters():
        if p.dim() > 0:
            torch.nn.init.normal_(p, std=0.3)
    f = f.double()
    x = torch.randn(4, d, dtype=torch.float64)
    c = torch.randn(4, 3, dtype=torch.float64)
    y, ladj, _ = flow_forward(f, x, c)
    want_y, want_ladj = f(c).transform.call_and_ladj(x)
    torch.testing.assert_close(y, want_y, rtol=0, atol=1e-12)
    torch.testing.assert_close(ladj, want_ladj, rtol=0, atol=1e-12)
    for i in range(4):
        J = torch.autograd.functional.jacobian(lambda v, ci=c[i: i + 1]: flow_forward(f, v, ci)[0], x[i: i + 1])
        assert float(ladj[i].detach()) == pytest.approx(float(torch.linalg.slogdet(J.reshape(d, d))[1]), abs=1e-9)
    torch.testing.assert_close(f(c).transform.inv(y), x, rtol=0, atol=1e-9)


@pytest.mark.parametrize("d,blocks,layers,hidden", [(128, 5, 8, 128), (5, 3, 4, 16)])
def test_glow_equals_freias_official_normflow_with_the_same_weights(d, blocks, layers, hidden):
    """Against FrEIA 0.2's GLOWCouplingBlock graph as the official NormFlow builds it (the official sizes,
    and an odd size where the halves differ): the same z and log|det| to rounding, in float64.  The
    comparison is sensitive: FrEIA with another clamp or other permutations disagrees."""
    reg, _ = make(d=d, blocks=blocks, hidden=hidden, layers=layers)
    f = reg.flow.double()
    torch.manual_seed(3)
    x = F.normalize(torch.randn(16, d, dtype=torch.float64), dim=1)
    c = F.normalize(torch.randn(16, d, dtype=torch.float64), dim=1)
    z, ladj, _ = flow_forward(f, x, c)
    want_z, want_ladj = run_official(official_normflow(f, d, blocks, layers, hidden), x, c, blocks)
    assert float((want_z - x).abs().max()) > 0.1 and float(want_ladj.detach().abs().max()) > 0.01  # not the identity
    torch.testing.assert_close(z, want_z, rtol=0, atol=1e-12)
    torch.testing.assert_close(ladj, want_ladj, rtol=0, atol=1e-12)

    for wrong in (dict(clamp=1.5), dict(seeds=[k + 1 for k in range(blocks)])):
        other_z, other_ladj = run_official(official_normflow(f, d, blocks, layers, hidden, **wrong), x, c, blocks)
        assert float((other_z - z).abs().max()) > 1e-3, wrong

    if d == 128:  # the official NormFlow's size: 5 blocks × 2 subnet_fc(depth 8, width 128), condition of size d
        per_subnet = (64 + 128) * 128 + 128 + 7 * (128 * 128 + 128)  # Linear(192,128), 6×(128,128), (128,128)
        assert sum(q.numel() for q in reg.module.parameters()) == 5 * 2 * per_subnet
        hyper = reg.flow.transform.transforms[1].hyper
        linears = [m for m in hyper if isinstance(m, zuko.nn.Linear)]
        assert len(linears) == 8 and all(isinstance(m, torch.nn.ReLU) for m in list(hyper)[1::2])
        assert {m.out_features for m in linears[:-1]} == {128}


# ------------------------------------------------------------------ the objective
def test_official_objective_equals_a_direct_computation():
    """term = weight · mean exp(½‖z‖² − log|det|), z from FrEIA's official NormFlow with the same weights and
    log|det| from an autograd Jacobian of it, the exp and the mean in numpy float64; with the base loss scaled
    by w_align the step's total is the official mean exp(NLL) + w_align · proxy loss itself."""
    reg, loss = make(d=6)
    assert reg.params.variant == "official" and reg.weight == 1.0 and reg.base_loss_scale == 0.01
    emb = torch.randn(8, 6)
    y = torch.tensor([0, 0, 1, 1, 2, 3, 3, 4])
    terms = reg.terms(ctx_of(emb, y, loss))

    x = F.normalize(emb, dim=1).double()
    c = loss.class_proxies().detach()[y].double()
    f = reg.flow.double()
    inn = official_normflow(f, 6, 2, 3, 16)
    nll = []
    for i in range(8):
        def fwd(v, ci=c[i: i + 1]):
            return run_official(inn, v, ci, 2)[0]
        z = fwd(x[i: i + 1])[0].detach().numpy()
        J = torch.autograd.functional.jacobian(fwd, x[i: i + 1]).reshape(6, 6).numpy()
        nll.append(0.5 * (z ** 2).sum() - np.linalg.slogdet(J)[1])
    nll = np.array(nll)
    want = np.exp(nll).mean()
    assert float(terms["nir"].detach()) == pytest.approx(want, rel=1e-5)
    assert float(terms["nir_nll"]) == pytest.approx(nll.mean(), rel=1e-5, abs=1e-5)

    base = float(loss(emb, y))
    official = np.exp(nll).mean() + 0.01 * base  # criteria/nir.py: mean(exp(nll)) + w_align · proxy loss
    assert reg.base_loss_scale * base + float(terms["nir"]) == pytest.approx(official, rel=1e-5)


def test_official_exp_is_float32_without_a_guard_and_finite_at_init():
    """The official code exponentiates the per-sample NLL as it is; at the official sizes and
    initialisation the NLL of unit embeddings is a few nats, far from float32's exp limit (~88)."""
    reg, loss = make(d=128, C=10, blocks=5, hidden=128, layers=8)
    emb = torch.randn(32, 128)
    y = torch.arange(32) % 10
    nll = reg.nll(emb, y, loss.class_proxies())
    assert nll.dtype == torch.float32 and nll.abs().max() < 20
    assert float(reg.objective(nll)) == pytest.approx(float(torch.exp(nll.double()).mean()), rel=1e-5)
    assert torch.isinf(reg.objective(torch.tensor([100.0])))  # no clamp: overflow shows, as in the official code


def test_gradients_reach_flow_and_proxies():
    reg, loss = make(d=6)
    y = torch.tensor([0, 1, 1, 3])
    reg.terms(ctx_of(torch.randn(4, 6), y, loss))["nir"].backward()
    g = loss.proxy_parameters()[0].grad
    assert g is not None and g[[0, 1, 3]].abs().sum() > 0 and g[[2, 4]].abs().sum() == 0
    assert all(p.grad is not None for p in reg.flow.parameters())


# ------------------------------------------------------------------ condition, noise, learning rates
def test_condition_dense_and_dense_embed():
    reg, loss = make(d=6)
    assert reg.params.condition == "dense" and reg.embed is None  # parameters.py: --loss_nir_nf_cond_mode dense
    p = loss.class_proxies()
    assert torch.equal(reg.condition(p), p)

    reg, loss = make(d=6, condition="dense_embed")  # criteria/nir.py: NormflowCondPrep('dense_embed')
    e = reg.embed
    assert [type(m) for m in e] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    assert (e[0].in_features, e[0].out_features, e[2].in_features, e[2].out_features) == (6, 6, 6, 6)
    p = loss.class_proxies()
    want = F.linear(torch.relu(F.linear(p, e[0].weight, e[0].bias)), e[2].weight, e[2].bias)
    torch.testing.assert_close(reg.condition(p), want)
    assert {id(q) for q in e.parameters()} <= {id(q) for q in reg.parameters()}  # trained at the flow's rate
    emb, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 3])
    z, ladj = reg.residual(F.normalize(emb, dim=1), want[y])
    nll = 0.5 * (z ** 2).sum(1) - ladj
    assert float(reg.terms(ctx_of(emb, y, loss))["nir_nll"]) == pytest.approx(float(nll.mean()), rel=1e-6)


def test_noise_is_uniform_renormalised_seeded_and_off_in_eval():
    reg, _ = make(d=6)
    assert reg.params.noise == 0.0  # parameters.py: --loss_nir_noise 0
    emb = torch.randn(4, 6)
    torch.testing.assert_close(reg.flow_input(emb, torch.Generator().manual_seed(0)), F.normalize(emb, dim=1))

    reg, _ = make(d=6, noise=0.1)
    a = reg.flow_input(emb, torch.Generator().manual_seed(3))
    b = reg.flow_input(emb, torch.Generator().manual_seed(3))
    u = torch.rand(emb.shape, generator=torch.Generator().manual_seed(3))  # criteria/nir.py: noise · torch.rand
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, F.normalize(F.normalize(emb, dim=1) + 0.1 * u, dim=1))
    assert not torch.allclose(a, reg.flow_input(emb, torch.Generator().manual_seed(4)))
    reg.module.eval()
    torch.testing.assert_close(reg.flow_input(emb, torch.Generator().manual_seed(3)), F.normalize(emb, dim=1))


def test_official_constants_and_optimizer_groups():
    # parameters.py (nir_parameters): --loss_nir_w_align 0.01, --loss_nir_lrmulti 50,
    # --loss_nir_proxy_lrmulti 4000 (the proxy loss alone: --loss_oproxy_lrmulti 2000),
    # --loss_nir_nf_cblocks 5, --loss_nir_nf_fc_depth 8, --loss_nir_nf_fc_width 128, --loss_nir_nf_clamp_alpha 2
    assert nir_mod.W_ALIGN == 0.01 and nir_mod.FLOW_LR_MULT == 50.0 and nir_mod.PROXY_LR_SCALE == 2.0
    # the official base lr is 1e-5, ours 1e-4: the flow's default multiplier keeps the official absolute rate
    assert NIRParams().flow_lr_mult * TrainConfig().lr == pytest.approx(50.0 * 1e-5)
    assert REGULARIZERS.get("nir").spec.weight == 1.0 and NIRParams().w_align == 0.01
    p = NIRParams()
    assert (p.blocks, p.hidden, p.layers, p.clamp, p.flow, p.variant, p.condition, p.noise, p.input) == (
        5, 128, 8, 2.0, "glow", "official", "dense", 0.0, "unit")
    for f in dataclasses.fields(NIRParams):  # each help names the official value
        assert "official" in f.metadata["help"], f.name
    with pytest.raises(UserError, match="^regularizer .nir.: layers must be ≥ 2, got 1$"):
        REGULARIZERS.params("nir", {"layers": 1})

    from model.backbones import build_backbone
    from model.network import EmbeddingModel
    from training.losses import build_loss
    from training.regularizers import build_regularizers
    from training.step import build_optimizer

    def groups(reg_param=()):
        cfg = TrainConfig(embed_dim=8, lr=1e-3, loss="proxy_anchor", regularizer=("nir",), reg_param=reg_param)
        backbone = build_backbone("small_cnn", "none")
        model = EmbeddingModel(backbone, cfg.embed_dim)
        loss, _ = build_loss(cfg.loss, 4, cfg.embed_dim)
        regs = build_regularizers(cfg, loss, backbone.dim)
        opt = build_optimizer(cfg, model, loss, regs, 0)
        return cfg, {g["name"]: g for g in opt.param_groups}

    cfg, g = groups(("nir.condition=dense_embed",))
    assert g["reg:nir"]["lr"] == pytest.approx(cfg.lr * 5) and g["reg:nir"]["weight_decay"] == 0.0
    assert len(g["reg:nir"]["params"]) == 5 * 2 * 8 * 2 + 4  # flow: blocks × 2 couplings × 8 linears × (w, b); embedder
    assert g["loss"]["lr"] == pytest.approx(cfg.lr * cfg.proxy_lr_mult * 2)
    cfg, g = groups(("nir.proxy_lr_scale=1", "nir.flow_lr_mult=10"))
    assert g["loss"]["lr"] == pytest.approx(cfg.lr * cfg.proxy_lr_mult)
    assert g["reg:nir"]["lr"] == pytest.approx(cfg.lr * 10)


# ------------------------------------------------------------------ the named variants
def checkered_flow(d, blocks, hidden):
    """The checkered flow written out with zuko's own layers: one coupling per block on checkered halves, a
    seeded permutation between blocks."""
    layers = []
    g = torch.Generator().manual_seed(0)
    for i in range(blocks):
        layers.append(GeneralCouplingTransform(d, d, mask=torch.arange(d) % 2 == i % 2,
                                               hidden_features=(hidden, hidden)))
        if i < blocks - 1:
            layers.append(UnconditionalTransform(PermutationTransform, torch.randperm(d, generator=g), buffer=True))
    base = UnconditionalDistribution(zuko.distributions.DiagNormal, torch.zeros(d), torch.ones(d), buffer=True)
    return Flow(layers, base)


def test_checkered_flow_and_the_nll_and_exp_variants_compute_what_they_say():
    reg, loss = make(d=6, weight=0.1, flow="glow_checkered", layers=3, clamp=0.0, blocks=5, hidden=16, variant="nll")
    old = checkered_flow(6, 5, 16)
    new_state, old_state = reg.flow.state_dict(), old.state_dict()
    assert list(new_state) == list(old_state)
    params = {n for n, _ in old.named_parameters()}
    for n in old_state:  # the same masks and permutations
        if n not in params:
            assert torch.equal(new_state[n], old_state[n]), n
    for n, p in reg.flow.named_parameters():  # and the near-identity start: last layer of each coupling net zero
        if n.endswith(("hyper.4.weight", "hyper.4.bias")):
            assert not p.any()
    torch.manual_seed(2)
    for p in reg.flow.parameters():
        torch.nn.init.normal_(p, std=0.2)
    old.load_state_dict(reg.flow.state_dict())
    emb, y = torch.randn(6, 6), torch.tensor([0, 1, 1, 2, 3, 4])
    x, c = F.normalize(emb, dim=1), loss.class_proxies()[y]
    z, ladj = old(c).transform.call_and_ladj(x)
    nll = 0.5 * (z**2).sum(1) - ladj

    terms = reg.terms(ctx_of(emb, y, loss))
    assert float(terms["nir"]) == pytest.approx(0.1 * float(nll.mean()), rel=1e-5)
    reg.params = dataclasses.replace(reg.params, variant="exp")
    terms = reg.terms(ctx_of(emb, y, loss))
    assert float(terms["nir"]) == pytest.approx(0.1 * float(torch.exp(nll / 6).mean()), rel=1e-5)
    assert float(terms["nir_nll"]) == pytest.approx(float(nll.mean()), rel=1e-5, abs=1e-6)


def test_raw_input_skips_normalisation():
    reg, loss = make(d=6, input="raw")
    emb = 3 * torch.randn(4, 6)
    torch.testing.assert_close(reg.flow_input(emb), emb)
    assert math.isfinite(float(reg.terms(ctx_of(emb, torch.tensor([0, 1, 2, 3]), loss))["nir"]))


def test_the_training_step_total_is_the_official_objective():
    """Through the trainer's Step: total = mean exp(NLL) + w_align · proxy loss (the base loss scaled by
    w_align, the NIR term at weight 1), and the logged `loss` stays the unscaled metric loss."""
    from model.backbones import build_backbone
    from model.network import EmbeddingModel
    from training.step import Step

    torch.manual_seed(0)
    model = EmbeddingModel(build_backbone("small_cnn", weights="none"), 6)
    reg, loss = make(d=6)
    step = Step(model, loss, [reg], opt=None, grad_clip=0.0)
    feats = torch.randn(8, model.trunk_dim)
    y = torch.tensor([0, 0, 1, 1, 2, 3, 3, 4])
    total, parts = step.forward(feats, y, torch.Generator().manual_seed(0))
    emb = model.embed_features(feats)
    base = float(loss(emb, y))
    nir = float(reg.objective(reg.nll(emb, y, loss.class_proxies())))
    assert float(total) == pytest.approx(nir + 0.01 * base, rel=1e-5)
    assert parts["loss"] == pytest.approx(base, rel=1e-6)


def test_a_diverged_step_stops_the_run_naming_the_part():
    """A NaN or infinite loss part stops training with the part named (not NaN weights trained on
    until an evaluation fails on NaN embeddings)."""
    from training.step import Diverged, check_finite

    check_finite({"loss": 1.0, "nir": 0.0})
    with pytest.raises(Diverged, match=r"training diverged: nir = inf .*weight of the regularizer"):
        check_finite({"loss": 1.0, "nir": float("inf")})
    with pytest.raises(Diverged, match="loss = nan"):
        check_finite({"loss": float("nan")})


def test_a_step_whose_regularizer_overflows_raises_diverged():
    from model.backbones import build_backbone
    from model.network import EmbeddingModel
    from training.step import Diverged, Step

    torch.manual_seed(0)
    model = EmbeddingModel(build_backbone("small_cnn", weights="none"), 6)
    reg, loss = make(d=6)
    reg.objective = lambda nll: torch.exp(1e4 * nll.abs()).mean()  # overflows to inf in float32
    params = [*model.parameters(), *loss.parameters(), *reg.parameters()]
    step = Step(model, loss, [reg], opt=torch.optim.SGD(params, lr=0.1), grad_clip=0.0)
    x = torch.randn(8, 3, 32, 32)
    y = torch.tensor([0, 0, 1, 1, 2, 3, 3, 4])
    with pytest.raises(Diverged, match="nir = inf"):
        step(model.backbone, x, y, torch.Generator().manual_seed(0))
