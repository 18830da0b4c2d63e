"""Fine-tuning from the decoded-image cache (the default) and from the streaming loader: the same
seed gives the same run, a resumed run equals the uninterrupted one, validation reads the cache
exactly as the loader would; channels_last and --compile keep the state the trainer saves."""
import dataclasses
import logging

import numpy as np
import pytest
import torch
from tiny_kanji import tiny

from model.checkpoint import read_checkpoint
from training.batches import CachedImages, ImageBatches
from training.config import IMAGE_CACHE_AUTO_BYTES, TrainConfig
from training.trainer import Run, state_like_parameters, train


def finetune(tmp_path, kanji_root, **kw):
    return tiny(tmp_path, kanji_root, mode="finetune", probe_epochs=0, **kw)


def weights(run_dir):
    return read_checkpoint(run_dir / "latest.pt")["state_dict"]


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Killed(Exception):
    pass


def kill_after(n):
    def hook(epoch):
        if epoch == n:
            raise Killed
    return hook


@pytest.mark.parametrize("image_cache", ["on", "off"])
def test_same_seed_same_run_and_resume_equals_uninterrupted(tmp_path, kanji_root, image_cache, caplog):
    """A run killed after its first epoch and resumed equals the uninterrupted run of the same seed:
    the same metrics and the same weights (the loader's worker count changes nothing either).  The
    run says where its crops come from."""
    with caplog.at_level(logging.INFO, logger="training"):
        full = train(finetune(tmp_path / "a", kanji_root, epochs=2, seed=1, image_cache=image_cache))
    said = {"on": "batched, from the decoded-image cache", "off": "per image, in the loader"}[image_cache]
    assert f"fine-tuning crops: {said}" in caplog.messages
    cfg = finetune(tmp_path / "c", kanji_root, epochs=2, seed=1, image_cache=image_cache,
                   workers="0" if image_cache == "off" else "auto")
    with pytest.raises(Killed):
        train(cfg, on_epoch_end=kill_after(1))
    resumed = train(dataclasses.replace(cfg, resume=True))
    assert resumed == full | {"train_seconds": resumed["train_seconds"]}
    assert same_weights(weights(tmp_path / "a" / "run"), weights(tmp_path / "c" / "run"))


def test_cache_and_loader_differ_only_in_their_crops(tmp_path, kanji_root):
    """The cache is the default in fine-tune mode; validation from it equals the loader's, exactly."""
    run = Run(finetune(tmp_path, kanji_root))
    run.setup()
    assert isinstance(run.source, CachedImages)
    loader = ImageBatches(dataclasses.replace(run_sources(run)))
    try:
        e_cache, y_cache = run.source.embed(run.model, run.splits.val)
        e_loader, y_loader = loader.embed(run.model, run.splits.val)
        assert np.array_equal(y_cache, y_loader) and np.array_equal(e_cache, e_loader)
        # one batch: the labels are the same, the crops are the cache's own draws
        b = [np.arange(8)]
        x, y, bad = next(iter(run.source.batches(b, torch.Generator().manual_seed(0))))
        x2, y2, _ = next(iter(run.source.batches(b, torch.Generator().manual_seed(0))))
        assert x.shape == (8, 3, 32, 32) and not bad and np.array_equal(y, run.source.labels[:8])
        assert torch.equal(x, x2)
        # a cache that stays in host memory while the step runs elsewhere: rows gathered a batch ahead
        many = [np.arange(8), np.arange(8, 24), np.arange(30, 40)]
        resident = list(run.source.batches(many, torch.Generator().manual_seed(1)))
        run.source.resident = False
        staged = list(run.source.batches(many, torch.Generator().manual_seed(1)))
        for a, c in zip(resident, staged, strict=True):
            assert torch.equal(a[0], c[0]) and np.array_equal(a[1], c[1])
    finally:
        loader.close()
        run.source.close()


def run_sources(run):
    from training.batches import SourceConfig

    return SourceConfig(backbone=run.backbone, splits=run.splits, transform=run.transform, dcfg=run.dcfg,
                        cache_dir=run.cfg.cache_dir, progress=False, device=run.device)


def test_which_source_fine_tuning_reads():
    cfg = TrainConfig(mode="finetune")
    assert cfg.uses_image_cache(2300, 224)  # the default: the cache
    per_image = 224 * 224 * 3
    assert not cfg.uses_image_cache(IMAGE_CACHE_AUTO_BYTES // per_image + 1, 224)  # too large: the loader
    assert TrainConfig(mode="finetune", image_cache="on").uses_image_cache(10**9, 224)
    assert not TrainConfig(mode="finetune", image_cache="off").uses_image_cache(10, 32)
    assert not TrainConfig(mode="tail").uses_image_cache(10, 32)  # the tail reads its prefix maps
    assert TrainConfig().identity()["image_cache"] == "auto"  # it decides the crops: part of the run
    assert "channels_last" not in TrainConfig().identity() and "compile" not in TrainConfig().identity()


def test_channels_last_step_matches_and_resume_restores_the_parameters_layout(tmp_path, kanji_root):
    runs = {}
    for name, fmt in (("contiguous", "off"), ("channels_last", "on")):
        run = Run(finetune(tmp_path / name, kanji_root, channels_last=fmt))
        run.setup()
        runs[name] = run
        b = [np.arange(16)]
        x, y, _ = next(iter(run.source.batches(b, torch.Generator().manual_seed(0))))
        ids = torch.tensor([run.label_map[int(v)] for v in y])
        run.source.start_epoch(0, run.model)
        loss, _ = run.step.loss_of_batch(run.source.encode, x.contiguous(memory_format=run.memory_format), ids,
                                         torch.Generator().manual_seed(0))
        loss.backward()
        run.loss_value = float(loss.detach())
        run.source.close()
    a, c = runs["contiguous"], runs["channels_last"]
    assert c.memory_format == torch.channels_last and a.memory_format == torch.contiguous_format
    conv = next(m for m in c.model.backbone.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert c.loss_value == pytest.approx(a.loss_value, rel=1e-5)
    # the same gradients, up to round-off (which batch-statistics BatchNorm amplifies in the first layers)
    for (k, p), q in zip(a.model.backbone.named_parameters(), c.model.backbone.parameters(), strict=True):
        assert torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0) > 0.999, k
        assert (p.grad - q.grad).norm() < 0.03 * p.grad.norm(), k
    # optimizer state saved in one layout, restored into parameters of the other: it takes theirs
    c.step.opt.step()
    a.step.opt.load_state_dict(c.step.opt.state_dict())
    state_like_parameters(a.step.opt)
    for p in a.model.backbone.parameters():
        for v in a.step.opt.state[p].values():
            if v.shape == p.shape:
                assert v.stride() == p.stride()


def test_compile_wraps_the_trained_part_and_keeps_checkpoint_keys(tmp_path, kanji_root):
    plain = Run(finetune(tmp_path / "a", kanji_root))
    plain.setup()
    run = Run(finetune(tmp_path / "b", kanji_root, compile=True))
    run.setup()
    for r in (plain, run):
        r.source.close()
    assert run.source.encode is not plain.source.__class__.encode.__get__(run.source)
    assert "encode" in vars(run.source) and "encode" not in vars(plain.source)  # compiled: an instance attribute
    assert run.model.state_dict().keys() == plain.model.state_dict().keys()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_fine_tuning_from_the_cache_is_reproducible(tmp_path, kanji_root):
    from model.augment import BatchAugment, draw_crops
    from model.preprocess import TransformSpec

    spec = TransformSpec(32, 32, (0.5,) * 3, (0.25,) * 3, augment=True, flip=True)
    images = torch.randint(0, 256, (20, 32, 32, 3), dtype=torch.uint8)
    aug = BatchAugment(spec)
    cpu = aug(images, torch.arange(20), torch.ones(20), torch.Generator().manual_seed(0))
    gpu = aug(images.cuda(), torch.arange(20), torch.ones(20), torch.Generator().manual_seed(0)).cpu()
    assert draw_crops(torch.ones(20), 32, torch.Generator().manual_seed(0), True).top.device.type == "cpu"
    assert ((gpu - cpu).abs() * 0.25 * 255).max() < 1.01
    kw = dict(epochs=2, device="cuda", channels_last="on", deterministic=True)
    a = train(finetune(tmp_path / "a", kanji_root, **kw))
    b = train(finetune(tmp_path / "b", kanji_root, **kw))
    assert a["val"] == b["val"]
