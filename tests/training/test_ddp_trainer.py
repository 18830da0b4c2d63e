"""The trainer under a 2-process gloo group (what torchrun starts), in tail mode with a warm-up
and the determinant regularizer: DDP is built once, the trained stage stays frozen through the
warm-up epoch (its gradient stays None, as in one process) and then trains, identical on both
ranks, as do the neck, proxies and flows; every rank gets rank 0's test metrics; only rank 0
writes the run folder."""
import os

import pytest
import torch
from support import spawn_ranks
from test_ddp import free_port
from tiny_kanji import FONTS

pytestmark = pytest.mark.multiprocess  # a 2-process gloo group


def _worker(rank, world, port, cfg, out):
    from training.trainer import Run

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # as torchrun sets them
    torch.set_num_threads(1)
    snaps, wrapped = [], []

    def gloo_threads():  # gloo's worker and transport threads, by the names torch gives them
        tasks = os.listdir("/proc/self/task")
        return sum(open(f"/proc/self/task/{t}/comm").read().startswith(("pt_gloo", "gloo")) for t in tasks)

    def snap(epoch):
        wrapped.append((run.step.ddp is not None, gloo_threads()))
        snaps.append({k: v.detach().clone() for k, v in run.model.state_dict().items()}
                     | {f"loss.{k}": v.clone() for k, v in run.loss.state_dict().items()}
                     | {f"reg.{k}": v.clone() for r in run.regs for k, v in r.module.state_dict().items()})

    run = Run(cfg, on_epoch_end=snap)
    metrics = run.fit()
    torch.save({"snaps": snaps, "metrics": metrics, "during": wrapped, "after": gloo_threads()},
               os.path.join(out, f"rank{rank}.pt"))


def assert_ddp_then_torn_down(r0, r1, epochs):
    """Every epoch trained through DDP with gloo's threads up; after fit the group is gone and its
    threads joined, before the interpreter exits (one that frees a collective's tensors while Python
    finalizes aborts the process)."""
    for r in (r0, r1):
        assert len(r["during"]) == epochs and all(ddp and n > 0 for ddp, n in r["during"])
        assert r["after"] == 0


def test_tail_warmup_and_determinant_under_two_ranks(tmp_path, kanji_root):
    from training.config import TrainConfig

    cfg = TrainConfig(dataset="kanji", data_root=kanji_root, num_classes=20, image_size=32,
                      kanji_fonts=FONTS, backbone="small_cnn", weights="none", embed_dim=16, epochs=2,
                      batch_size=16, m_per_class=4, out=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                      progress=False, lr=1e-3, mode="tail", train_blocks=1, warmup_epochs=1,
                      regularizer=("determinant",), reg_param=("determinant.transforms=2", "determinant.hidden=16"))
    spawn_ranks(_worker, (2, free_port(), cfg, str(tmp_path)))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert_ddp_then_torn_down(r0, r1, cfg.epochs)
    assert r0["metrics"] == r1["metrics"]  # rank 0's test metrics, told to every rank
    for a, b in zip(r0["snaps"], r1["snaps"], strict=True):  # identical replicas after every epoch
        assert a.keys() == b.keys()
        for k in a:  # (BatchNorm running statistics of a trained stage are each rank's own until DDP
            if "running_" not in k:  # broadcasts rank 0's at the next forward; rank 0's are saved)
                assert torch.equal(a[k], b[k]), k
    from model.backbones import build_backbone

    torch.manual_seed(cfg.seed)  # the trainer builds its backbone first under this seed
    init = build_backbone("small_cnn", "none").state_dict()
    tail = [k for k in init if k.startswith("trunk.features.3.") and init[k].dtype.is_floating_point
            and "running" not in k]
    assert len(tail) == 6
    # the warm-up epoch left the trained stage as it was (gradient None, no AdamW step); epoch 2 moved it
    assert all(torch.equal(r0["snaps"][0][f"backbone.{k}"], init[k]) for k in tail)
    assert all(not torch.equal(r0["snaps"][1][f"backbone.{k}"], init[k]) for k in tail)
    early = [k for k in init if k.startswith("trunk.features.0.") and "running" not in k]
    assert all(torch.equal(r0["snaps"][1][f"backbone.{k}"], init[k]) for k in early)  # the prefix never trains
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "best.pt", "config.toml", "curve.png", "latest.pt", "log.jsonl", "metrics.json"]


def test_fine_tuning_from_the_decoded_image_cache_under_two_ranks(tmp_path, kanji_root):
    """Rank 0 decodes the images while rank 1 waits, then both read the cache; each rank cuts its own
    crops (its generator is seeded by the rank) and the replicas stay identical."""
    from training.config import TrainConfig

    cfg = TrainConfig(dataset="kanji", data_root=kanji_root, num_classes=20, image_size=32,
                      kanji_fonts=FONTS, backbone="small_cnn", weights="none", embed_dim=16, epochs=2,
                      batch_size=16, m_per_class=4, out=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                      progress=False, lr=1e-3, mode="finetune", probe_epochs=0)
    spawn_ranks(_worker, (2, free_port(), cfg, str(tmp_path)))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert_ddp_then_torn_down(r0, r1, cfg.epochs)
    assert r0["metrics"] == r1["metrics"]
    for a, b in zip(r0["snaps"], r1["snaps"], strict=True):
        for k in a:
            if "running_" not in k:
                assert torch.equal(a[k], b[k]), k
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir() if p.name.startswith("pixels")) == [
        "pixels32", "pixels32"]  # the training and the validation cache, built once
