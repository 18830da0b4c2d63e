"""Data-parallel training (training/distributed.py), 2 gloo processes on 127.0.0.1 against one
process: the same global batches (training/samplers.py: each rank its block of classes of the
one-process batch), synthetic backbone features (the frozen-feature step), a few optimizer steps.

  * a proxy loss (Proxy-Anchor: it gathers), a per-sample-mean proxy loss (ArcFace: it does not),
    a mined pair loss (Multi-Similarity through PML's DistributedLossWrapper/MinerWrapper), and
    CGML's paired batches (X′ and X″ each B, and the split option's B/2 each): 2 ranks × B/2 follow
    1 process × B (loss trajectory and parameters);
  * the proxies, the neck and the regularizer flows are equal on both ranks after the steps
    (also with the determinant regularizer's per-rank tangent augmentation);
  * the wrapped pair loss and its miner receive 2 × B/2 embeddings.
"""
import os
import socket

import numpy as np
import pytest
import torch
from support import spawn_ranks

N_CLASSES, PER_CLASS, B, M, STEPS, TRUNK = 8, 8, 16, 4, 5, 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(spec: dict):
    from model.backbones import build_backbone
    from model.network import EmbeddingModel
    from training.config import TrainConfig
    from training.losses import build_loss
    from training.regularizers import build_regularizers
    from training.step import Step, build_optimizer

    cfg = TrainConfig(embed_dim=16, lr=1e-3, loss=spec["loss"], regularizer=tuple(spec.get("regs", ())),
                      reg_param=tuple(spec.get("reg_param", ())))
    torch.manual_seed(0)
    backbone = build_backbone("small_cnn", "none")
    model = EmbeddingModel(backbone, cfg.embed_dim)
    loss, _ = build_loss(cfg.loss, N_CLASSES, cfg.embed_dim, spec.get("loss_param", ()))
    regs = build_regularizers(cfg, loss, backbone.dim)
    for r in regs:
        for name, head in r.heads().items():
            setattr(model, name, head)
    for p in backbone.parameters():
        p.requires_grad_(False)
    opt = build_optimizer(cfg, model, loss, regs, 0)
    return Step(model, loss, regs, opt, cfg.grad_clip), model, loss, regs


def data():
    g = torch.Generator().manual_seed(1)
    y = np.repeat(np.arange(N_CLASSES), PER_CLASS)
    x = torch.randn(N_CLASSES, TRUNK, generator=g)[y] + 0.7 * torch.randn(len(y), TRUNK, generator=g)
    return x, y


def train_steps(spec: dict, rank: int = 0, world: int = 1) -> dict:
    """STEPS steps on this rank's shares of the global batches; what the test compares."""
    from training.distributed import Dist
    from training.samplers import epoch_batches, epoch_rng

    step, model, loss, regs = build(spec)
    counts = []
    if world > 1:
        step.distribute(Dist(rank, world, rank, torch.device("cpu")))
        inner = getattr(loss, "loss", None)
        for mod in (inner, getattr(loss, "miner", None)):
            if mod is not None:
                mod.register_forward_pre_hook(lambda m, args: counts.append((type(m).__name__, len(args[0]))))
    x, y = data()
    # STEPS steps: the first two epochs' draws (this rank's shares)
    batches = [b for e in range(2) for b in epoch_batches(y, B, M, step.paired, epoch_rng(5, e), rank, world)][:STEPS]
    gen = torch.Generator().manual_seed(100 + rank)
    model.train()
    losses, grads = [], {}
    named = {}
    for pre, mod in [("model", model), ("loss", loss), *((f"reg.{r.name}", r.module) for r in regs)]:
        named |= {id(q): f"{pre}.{k}" for k, q in mod.named_parameters()}
    for idx in batches:
        parts = step(lambda t: t, x[idx], torch.from_numpy(y[idx]), gen)
        losses.append(parts)
        if not grads:  # the first step's gradients, as the optimizer used them (averaged over the ranks)
            grads = {named[id(p)]: p.grad.clone() for g in step.opt.param_groups for p in g["params"]
                     if p.grad is not None}
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items() if not k.startswith("backbone.")}
    state |= {f"loss.{k}": v.clone() for k, v in loss.state_dict().items()}
    for r in regs:
        state |= {f"reg.{r.name}.{k}": v.clone() for k, v in r.module.state_dict().items()}
    return {"losses": losses, "grads": grads, "state": state, "counts": counts, "local_batch": len(idx)}


def _worker(rank: int, world: int, port: int, specs: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # as torchrun sets them
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:  # every case in one process group: one spawn for the whole module
        torch.save({name: train_steps(spec, rank, world) for name, spec in specs.items()},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        from training.distributed import leave

        leave(None)  # gloo's threads joined before the interpreter exits


def same_state(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


CASES = {
    "proxy_anchor": {"loss": "proxy_anchor"},
    "arcface": {"loss": "arcface"},
    "multi_similarity": {"loss": "multi_similarity"},
    "cgml": {"loss": "proxy_anchor", "regs": ["cgml"], "reg_param": []},
    "cgml_split": {"loss": "proxy_anchor", "regs": ["cgml"], "reg_param": ["cgml.batches=split"]},
}


DETERMINANT = {"loss": "proxy_anchor", "regs": ["determinant"],
               # the tangent variant: its random partners are drawn per rank, the case worth checking here
               "reg_param": ["determinant.transforms=2", "determinant.hidden=16", "determinant.epsilon=0.4",
                             "determinant.augment=tangent", "determinant.gmax_loss=attached"]}
TRIPLET = {"loss": "triplet", "loss_param": ["miner=semihard"]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """{case: [rank 0's result, rank 1's]} from one 2-process gloo group."""
    out = tmp_path_factory.mktemp("ddp")
    specs = CASES | {"determinant": DETERMINANT, "triplet": TRIPLET}
    spawn_ranks(_worker, (2, free_port(), specs, str(out)))
    got = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    return {name: [g[name] for g in got] for name in specs}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_half_batches_follow_one_process_full_batches(name, ranks):
    spec = CASES[name]
    one = train_steps(spec)
    assert ranks[name][0]["local_batch"] == one["local_batch"] // 2
    for r in ranks[name]:  # the logged parts (means over the ranks) are the one-process values
        assert len(r["losses"]) == len(one["losses"]) == STEPS
        for a, b in zip(r["losses"], one["losses"], strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (name, k, r["losses"], one["losses"])
        same_state(r["grads"], one["grads"], rtol=1e-4, atol=1e-6)  # the gradients themselves, not only Adam's steps
        same_state(r["state"], one["state"], rtol=1e-4, atol=1e-5)
    # and the ranks hold identical replicas: proxies, neck, flows
    same_state(ranks[name][0]["state"], ranks[name][1]["state"], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_proxies_and_flows_equal_across_ranks_with_determinant_augmentation(ranks):
    """The determinant regularizer: g_min (the model's head), g_max and its own proxies, and the tangent
    augmentation drawn from each rank's own generator (so the ranks differ in what they draw, not in
    what they hold)."""
    r0, r1 = ranks["determinant"]
    assert any("g_max" in k for k in r0["state"]) and any("max_loss" in k for k in r0["state"])
    assert any("embed_head" in k for k in r0["state"]) and "loss.loss.proxies" in r0["state"]
    same_state(r0["state"], r1["state"], rtol=0, atol=0)
    init = build(DETERMINANT)[2].state_dict()["loss.proxies"]
    assert not torch.equal(r0["state"]["loss.loss.proxies"], init)  # the proxies did train


@pytest.mark.multiprocess
def test_mined_pair_loss_sees_the_global_batch(ranks):
    r0, r1 = ranks["triplet"]
    for r in (r0, r1):
        assert r["local_batch"] == B // 2
        seen = {name for name, _ in r["counts"]}
        assert seen == {"TripletMarginLoss", "TripletMarginMiner"}
        assert {n for _, n in r["counts"]} == {B}  # 2 × B/2 embeddings, every call
        assert len(r["counts"]) == 2 * STEPS
    same_state(r0["state"], r1["state"], rtol=0, atol=0)


def test_one_process_is_unchanged_by_the_distributed_code():
    """No process group: a loss call is its forward, the step has no DDP wrapper."""
    step, _, loss, _ = build({"loss": "proxy_anchor"})
    assert step.ddp is None
    e, y = torch.randn(8, 16), torch.arange(4).repeat(2)
    assert torch.equal(loss(e, y), loss.forward(e, y))


def test_batch_sizes_that_do_not_split_are_refused():
    from core.errors import UserError
    from training.samplers import epoch_batches, epoch_rng

    y = np.repeat(np.arange(10), 4)
    with pytest.raises(UserError, match="a batch of 3 classes does not split over 2 ranks"):
        epoch_batches(y, 24, 4, "split", epoch_rng(0, 0), 0, 2)  # 3 classes per half
    for batches, n in (("full", 16), ("split", 8)):
        pair = epoch_batches(y, 16, 2, batches, epoch_rng(0, 0), 1, 2)
        for idx in pair:  # [X′_1, X″_1]: the same classes in the same order in both halves
            h = len(idx) // 2
            assert (y[idx[:h]] == y[idx[h:]]).all() and len(idx) == n
