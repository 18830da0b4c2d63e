"""Training end to end on tiny kanji: frozen and fine-tuned, resume, cache keys, bad data."""
import dataclasses
import json

import pytest
import torch
from tiny_kanji import tiny

from core.errors import UserError
from training.config import TrainConfig
from training.trainer import train


def test_frozen_training_outputs_and_selection(tmp_path, kanji_root):
    cfg = tiny(tmp_path, kanji_root, epochs=4)
    m = train(cfg)
    out = tmp_path / "run"
    for f in ("best.pt", "latest.pt", "config.toml", "log.jsonl", "metrics.json", "curve.png"):
        assert (out / f).is_file(), f
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2, 3, 4]
    best_epoch = max(log, key=lambda r: r["val_map@r"])["epoch"]
    assert m["selected_epoch"] == best_epoch  # selected on validation, not test
    assert set(m["test"]) >= {"map@r", "recall@1", "nmi", "f1"}
    from model.checkpoint import read_checkpoint
    ck = read_checkpoint(out / "best.pt")
    assert ck["metrics"]["test"]["map@r"] == pytest.approx(m["test"]["map@r"])
    assert ck["split"]["test"] and not set(ck["split"]["test"]) & set(ck["split"]["train"])
    assert "proxies" in "".join(ck["extra"]["loss_state"])


def test_same_seed_same_metrics_and_resume_equals_uninterrupted(tmp_path, kanji_root):
    full = train(tiny(tmp_path / "a", kanji_root, epochs=4, seed=3))
    again = train(tiny(tmp_path / "b", kanji_root, epochs=4, seed=3))
    assert again["test"]["map@r"] == full["test"]["map@r"]

    class Killed(Exception):
        pass

    def die(epoch):
        if epoch == 2:
            raise Killed

    cfg = tiny(tmp_path / "c", kanji_root, epochs=4, seed=3)
    with pytest.raises(Killed):
        train(cfg, on_epoch_end=die)
    assert not (tmp_path / "c" / "run" / "metrics.json").exists()
    resumed = train(dataclasses.replace(cfg, resume=True))
    assert resumed["test"]["map@r"] == full["test"]["map@r"]
    assert resumed["val"]["map@r"] == full["val"]["map@r"]
    log = (tmp_path / "c" / "run" / "log.jsonl").read_text().splitlines()
    assert len(log) == 4
    # a different config may not resume this run
    with pytest.raises(UserError, match="config.toml differs"):
        train(dataclasses.replace(cfg, resume=True, lr=5e-3))


def test_a_constant_rate_run_resumes_and_its_tensorboard_steps_continue(tmp_path, kanji_root):
    """--schedule none has no scheduler to save; a resumed run counts its TensorBoard steps on from
    the epochs done (steps per epoch × epochs), so the step axis has no gap and no repeat."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from model.checkpoint import read_checkpoint

    full = train(tiny(tmp_path / "a", kanji_root, epochs=2, schedule="none"))

    class Killed(Exception):
        pass

    def die(epoch):
        raise Killed

    cfg = tiny(tmp_path / "c", kanji_root, epochs=2, schedule="none", tensorboard=True)
    with pytest.raises(Killed):
        train(cfg, on_epoch_end=die)
    out = tmp_path / "c" / "run"
    assert "scheduler" not in read_checkpoint(out / "latest.pt")["extra"]
    first = len(EventAccumulator(str(out / "tb")).Reload().Scalars("train/loss"))
    resumed = train(dataclasses.replace(cfg, resume=True))
    assert resumed["test"] == full["test"] and resumed["val"] == full["val"]
    steps = [e.step for e in EventAccumulator(str(out / "tb")).Reload().Scalars("train/loss")]
    assert first >= 2 and sorted(steps) == list(range(1, 2 * first + 1))


def test_trainer_caches_features_under_a_key_of_transform_and_weights(tmp_path, kanji_root):
    from data import load_data
    from model.backbones import build_backbone
    from model.features import cache_key
    from model.preprocess import transform_for

    cfg = tiny(tmp_path, kanji_root, epochs=1)
    train(cfg)
    splits = load_data(cfg.data_config(), progress=False)
    torch.manual_seed(cfg.seed)  # the trainer builds its backbone first under this seed
    bb = build_backbone("small_cnn", "none")
    spec = transform_for(bb, cfg.data_config())
    assert (spec.image_size, spec.resize) == (32, 32)  # kanji: plain resize
    k = cache_key(bb, splits, splits.train, spec)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        f"small_cnn-{splits.name}-{sub.name}-{cache_key(bb, splits, sub, spec)}"
        for sub in (splits.train, splits.val, splits.test))  # what the trainer embedded, and nothing else
    assert k == cache_key(bb, splits, splits.train, spec)
    assert k != cache_key(bb, splits, splits.train, dataclasses.replace(spec, image_size=48, resize=48))
    assert k != cache_key(bb, splits, splits.train, dataclasses.replace(spec, mean=(0.4, 0.4, 0.4)))
    assert k != cache_key(bb, splits, splits.train, dataclasses.replace(spec, augment=True))
    assert k != cache_key(bb, splits, splits.val, spec)
    with torch.no_grad():
        next(bb.parameters()).add_(1e-3)
    assert k != cache_key(bb, splits, splits.train, spec)


def test_finetune_with_warmup_and_corrupt_image(tmp_path, kanji_root):
    from data import load_data

    cfg = tiny(tmp_path, kanji_root, mode="finetune", epochs=2, warmup_epochs=1, batch_size=8,
               probe_epochs=0)
    splits = load_data(cfg.data_config(), progress=False)
    # corrupt one training image in a private copy of the data set
    import shutil
    from pathlib import Path
    src = Path(splits.root).parent
    dst = tmp_path / "kanji_copy" / src.name
    shutil.copytree(src, dst)
    victim = dst / "images" / splits.train.paths[0]
    victim.write_bytes(b"not a png")
    cfg = dataclasses.replace(cfg, data_root=str(tmp_path / "kanji_copy"))
    m = train(cfg)
    assert m["n_skipped_images"] >= 1
    from model.backbones import build_backbone
    from model.checkpoint import load_model

    torch.manual_seed(cfg.seed)  # the trainer builds its backbone right after this seed
    init = build_backbone("small_cnn", "none").state_dict()
    logged = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(logged) == 2
    latest, _ = load_model(tmp_path / "run" / "latest.pt")
    changed = [k for k, v in latest.backbone.state_dict().items()
               if v.dtype.is_floating_point and not torch.equal(v, init[k])]
    assert changed  # epoch 2 (after the warm-up) trained the backbone


def test_missing_dataset_and_bad_batch(tmp_path, kanji_root):
    with pytest.raises(UserError, match="not found"):
        train(tiny(tmp_path, kanji_root, dataset="cub", data_root=str(tmp_path / "nope")))
    with pytest.raises(UserError, match="multiple of m_per_class"):
        train(tiny(tmp_path, kanji_root, batch_size=10))


def test_a_run_recorded_before_a_setting_existed_is_the_same_run(tmp_path):
    from training.checkpoints import same_identity

    cfg = TrainConfig(out=str(tmp_path / "r"))
    recorded = {k: v for k, v in cfg.identity().items() if k not in ("train_blocks", "bn_freeze", "lr_decay")}
    assert same_identity(recorded, cfg)
    assert not same_identity(recorded, dataclasses.replace(cfg, train_blocks=2))
