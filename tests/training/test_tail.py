"""Partial fine-tuning over a cached frozen prefix (`--mode tail --train-blocks N`).

The exactness test: one optimisation step on the cached prefix maps equals one step that
computes the prefix on the fly from the same images, for the same batch and seed."""
import copy
import dataclasses

import numpy as np
import pytest
import torch
from tiny_kanji import tiny as _tiny

from core.errors import UserError
from training.batches import set_trainable
from training.config import TrainConfig
from training.samplers import epoch_batches
from training.trainer import Run, epoch_generators, train


def tiny(tmp_path, kanji_root, **kw):
    """test_trainer's tiny kanji run, 2 epochs on the CPU."""
    return _tiny(tmp_path, kanji_root, **({"epochs": 2, "device": "cpu"} | kw))


def test_train_blocks_alone_means_tail_and_bad_counts_are_refused():
    assert TrainConfig(train_blocks=2).resolved_mode() == "tail"
    assert TrainConfig(train_blocks=2).n_train_blocks(9) == 2
    assert TrainConfig(mode="tail").n_train_blocks(9) == 1
    assert TrainConfig(mode="finetune").n_train_blocks(9) == 9
    assert TrainConfig().n_train_blocks(9) == 0
    with pytest.raises(UserError, match="--mode tail trains 1 … 8 of efficientnet_lite0's 9 stages"):
        TrainConfig(train_blocks=9).validate()
    with pytest.raises(UserError, match="--mode finetune trains all 4 stages"):
        TrainConfig(backbone="small_cnn", mode="finetune", train_blocks=2).validate()
    with pytest.raises(UserError, match="--train-blocks must be ≥ 0"):
        TrainConfig(train_blocks=-1).validate()
    with pytest.raises(UserError, match="fp16 needs CUDA"):
        TrainConfig(precision="fp16", device="cpu").validate()


def test_set_trainable_freezes_the_prefix_and_its_batchnorm():
    from model.backbones import build_backbone

    bb = build_backbone("small_cnn", weights="none")
    stages = [m for _, m in bb.stages()]
    set_trainable(bb, 2)
    for i, m in enumerate(stages):
        trains = i >= 2
        assert all(p.requires_grad == trains for p in m.parameters()), i
        bns = [b for b in m.modules() if isinstance(b, torch.nn.BatchNorm2d)]
        assert bns and all(b.training == trains for b in bns), i
    set_trainable(bb, 2, bn_freeze=True)  # the tail's weights train, its BatchNorm statistics do not
    assert all(p.requires_grad for p in stages[3].parameters())
    assert not any(b.training for b in stages[3].modules() if isinstance(b, torch.nn.BatchNorm2d))
    set_trainable(bb, 2, trainable=False)  # a warm-up epoch: nothing in the backbone trains
    assert not any(p.requires_grad for p in bb.parameters())


def _first_batch(run: Run):
    rng, gen, _ = epoch_generators(run.cfg.seed, 0)
    b = epoch_batches(run.source.labels, run.cfg.batch_size, run.cfg.m_per_class, run.step.paired, rng)[0]
    y = torch.tensor([run.label_map[int(v)] for v in run.source.labels[b]])
    return b, y, gen


def _step_params(run: Run, encode, x, y, gen) -> dict:
    run.source.start_epoch(0, run.model)
    run.step(encode, x, y, gen)
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


@pytest.mark.parametrize("loss", ["proxy_anchor", "triplet"])
def test_one_step_on_the_cached_prefix_equals_one_step_computing_it(tmp_path, kanji_root, loss):
    cfg = tiny(tmp_path, kanji_root, train_blocks=2, loss=loss)
    cached = Run(cfg)
    cached.setup()
    fly = copy.deepcopy(cached)  # same initial weights, proxies and optimizer state
    b, y, gen = _first_batch(cached)
    x_cached, _, _ = next(iter(cached.source.batches([b])))
    after_cached = _step_params(cached, cached.source.encode, x_cached, y, gen)

    # the same images, through the frozen prefix now (the cache stores float16: round the same way)
    from data.loader import ImageDataset

    rows = cached.source.cache["train"].kept[b]
    ds = ImageDataset(fly.splits.train, fly.transform.build())
    images = torch.stack([ds[int(i)][0] for i in rows])
    n_prefix = fly.source.n_prefix

    def on_the_fly(imgs):
        with torch.no_grad():
            maps = fly.backbone.run_stages(imgs, 0, n_prefix).half().float()
        return fly.backbone.run_stages(maps, n_prefix)

    _, _, gen2 = _first_batch(fly)
    after_fly = _step_params(fly, on_the_fly, images, y, gen2)
    for k, v in after_cached.items():
        torch.testing.assert_close(after_fly[k], v, rtol=1e-5, atol=1e-6, msg=k)
    # and the step really trained the tail, not the prefix
    before = Run(cfg)
    before.setup()
    sd0 = before.model.state_dict()
    moved = {k for k in after_cached if k.endswith("weight") and not torch.equal(after_cached[k], sd0[k])}
    assert any(k.startswith("backbone.trunk.features.3") for k in moved)
    assert any(k.startswith("backbone.trunk.features.2") for k in moved)
    assert not any(k.startswith(("backbone.trunk.features.0", "backbone.trunk.features.1")) for k in moved)


def test_tail_run_stores_the_trained_trunk_and_index_features_come_from_it(tmp_path, kanji_root):
    from model.checkpoint import load_model
    from model.features import embed_split

    cfg = tiny(tmp_path, kanji_root, train_blocks=1, epochs=2)
    m = train(cfg)
    assert np.isfinite(m["test"]["map@r"])
    model, ck = load_model(tmp_path / "run" / "best.pt")
    assert ck["config"]["train_blocks"] == 1
    from model.backbones import build_backbone

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        init = build_backbone("small_cnn", weights="none").state_dict()
    trained = model.backbone.state_dict()
    assert all(torch.equal(trained[k], init[k]) for k in init if k.startswith(("trunk.features.0", "trunk.features.1",
                                                                              "trunk.features.2")))
    assert not torch.equal(trained["trunk.features.3.0.weight"], init["trunk.features.3.0.weight"])
    # what the index stores, φ from the trained tail on the images, is what training evaluated
    sf = embed_split(tmp_path / "run" / "best.pt", None, "test", str(tmp_path / "cache"), progress=False)
    run = Run(dataclasses.replace(cfg, out=str(tmp_path / "probe")))
    run.setup()
    run.model.load_state_dict(model.state_dict())
    e_train, y_train = run.source.embed(run.model, run.splits.test)
    e_index = np.asarray(model.embed_of_backbone(sf.feats))
    assert np.array_equal(sf.labels, y_train)
    np.testing.assert_allclose(e_index, e_train, atol=2e-2)  # the cache's float16 rounding only


@pytest.fixture(scope="module")
def frozen_neck_val(tmp_path_factory, kanji_root):
    return train(tiny(tmp_path_factory.mktemp("frozen"), kanji_root, **PRETRAINED))["val"]["map@r"]


PRETRAINED = dict(backbone="efficientnet_lite0", weights=None, lr=1e-4, epochs=4, embed_dim=32)


@pytest.mark.parametrize("mode", [dict(train_blocks=2), dict(mode="finetune")], ids=["tail2", "finetune"])
def test_default_recipes_do_not_fall_below_the_frozen_neck_on_validation(tmp_path, kanji_root, frozen_neck_val, mode):
    """The default tail and fine-tune recipes (pretrained trunk, BatchNorm statistics frozen) on tiny data."""
    trained = train(tiny(tmp_path, kanji_root, **PRETRAINED, **mode))
    assert trained["val"]["map@r"] >= frozen_neck_val


def test_tensorboard_events_hold_losses_learning_rates_validation_and_the_projector(tmp_path, kanji_root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tiny(tmp_path, kanji_root, train_blocks=1, epochs=2, tensorboard=True))
    tb = tmp_path / "run" / "tb"
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "lr/neck", "lr/loss", "lr/backbone:block3", "val/map@r", "val/recall@1"} <= tags
    assert [e.step for e in acc.Scalars("val/map@r")] == [1, 2]
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    proj = (tb / "projector_config.pbtxt").read_text()
    assert "test_embeddings" in proj and "sprite.png" in proj
    tensors = next(tb.rglob("tensors.tsv")).read_text().splitlines()
    metadata = next(tb.rglob("metadata.tsv")).read_text().splitlines()
    assert len(tensors) == len(metadata) > 10 and len(tensors[0].split("\t")) == 16


def test_bf16_autocast_trains_on_cpu_with_fp32_losses(tmp_path, kanji_root):
    cfg = tiny(tmp_path, kanji_root, train_blocks=2, precision="bf16")
    run = Run(cfg)
    run.setup()
    b, y, gen = _first_batch(run)
    x, _, _ = next(iter(run.source.batches([b])))
    run.source.start_epoch(0, run.model)
    seen = {}
    encode = run.source.encode
    run.step.loss.register_forward_hook(lambda m, i, o: seen.update(dtype=(i[0].dtype, o.dtype)))
    def probe(t):
        out = encode(t)
        seen["enc"] = out.dtype
        return out

    parts = run.step(probe, x, y, gen)
    assert seen["enc"] == torch.bfloat16          # the tail ran under autocast
    assert seen["dtype"] == (torch.float32, torch.float32)  # the loss did not
    assert np.isfinite(parts["loss"])
    assert all(p.dtype == torch.float32 for p in run.model.parameters())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_tail_training_on_cuda(tmp_path, kanji_root, precision):
    m = train(tiny(tmp_path, kanji_root, train_blocks=2, device="cuda", precision=precision))
    assert np.isfinite(m["test"]["map@r"]) and m["test"]["map@r"] > 0
