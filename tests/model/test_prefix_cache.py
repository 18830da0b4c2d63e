"""model/features.py: the cached frozen prefix equals the prefix computed on the fly."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import UserError
from data import DataConfig, load_data
from model.backbones import build_backbone
from model.features import backbone_features, cache_key, cached_prefix
from model.preprocess import transform_for


@pytest.fixture()
def folder(tmp_path):
    rng = np.random.default_rng(0)
    for c in range(4):
        (tmp_path / "img" / f"c{c}").mkdir(parents=True)
        for j in range(3):
            Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(
                tmp_path / "img" / f"c{c}" / f"{j}.png")
    (tmp_path / "img" / "c0" / "broken.png").write_bytes(b"not a png")
    return tmp_path


def setup(folder):
    """(data config, splits, a seeded small_cnn in eval mode, its transform) over the folder."""
    cfg = DataConfig(dataset="imagefolder", data_root=str(folder / "img"), image_size=32, eval_batch_size=5)
    splits = load_data(cfg, progress=False)
    torch.manual_seed(0)
    bb = build_backbone("small_cnn", "none").eval()
    return cfg, splits, bb, transform_for(bb, cfg)


def test_prefix_maps_equal_on_the_fly_and_are_reused(folder):
    cfg, splits, bb, spec = setup(folder)
    sub = splits.train
    pc = cached_prefix(bb, 2, splits, sub, spec, cfg, str(folder / "cache"), progress=False)
    assert isinstance(pc.maps, np.memmap) and pc.maps.dtype == np.float16
    tf = spec.build()
    from core.images import load_rgb
    readable = [i for i in range(len(sub)) if not sub.paths[i].endswith("broken.png")]
    assert pc.kept.tolist() == readable and len(pc.maps) == len(readable)
    x = torch.stack([tf(load_rgb(sub.abspath(i))) for i in readable])
    with torch.no_grad():
        ref = bb.run_stages(x, 0, 2)
    assert torch.allclose(torch.from_numpy(np.asarray(pc.maps, dtype=np.float32)), ref, atol=2e-2, rtol=1e-2)
    # the tail on the cached maps gives the trunk's features (float16 round-off aside)
    with torch.no_grad():
        tail = bb.run_stages(torch.from_numpy(np.asarray(pc.maps, dtype=np.float32)), 2)
        full = bb(x)
    assert torch.allclose(tail, full, atol=5e-2, rtol=5e-2)
    again = cached_prefix(bb, 2, splits, sub, spec, cfg, str(folder / "cache"), progress=False)
    assert again.path == pc.path and len(list(Path(folder / "cache").iterdir())) == 1


def test_the_prefix_moves_the_backbone_outside_inference_mode(folder, monkeypatch):
    """A move to the device inside inference mode makes the parameters inference tensors (on CUDA,
    where it copies them), which the tail that trains next cannot set to require gradients; the
    cache may also be computed inside a caller's inference mode (the test split, at the end)."""
    cfg, splits, bb, spec = setup(folder)
    modes, move = [], bb.to

    def recording_to(*a, **k):
        modes.append(torch.is_inference_mode_enabled())
        return move(*a, **k)

    monkeypatch.setattr(bb, "to", recording_to)
    with torch.inference_mode():
        cached_prefix(bb, 2, splits, splits.train, spec, cfg, str(folder / "cache"), progress=False)
    assert modes == [False]
    for p in bb.parameters():
        assert not p.is_inference()
        p.requires_grad_(True)


def test_prefix_key_ignores_the_tail_and_tracks_the_prefix(folder):
    cfg = DataConfig(dataset="imagefolder", data_root=str(folder / "img"), image_size=32)
    splits = load_data(cfg, progress=False)
    torch.manual_seed(0)
    bb = build_backbone("small_cnn", "none")
    spec = transform_for(bb, cfg)
    k2 = cache_key(bb, splits, splits.train, spec, prefix=2)
    assert k2 != cache_key(bb, splits, splits.train, spec, prefix=1)
    with torch.no_grad():
        bb.stages()[3][1].stage[0].weight.add_(1.0)   # training the tail keeps the prefix cache valid
    assert cache_key(bb, splits, splits.train, spec, prefix=2) == k2
    with torch.no_grad():
        bb.stages()[0][1][0].weight.add_(1.0)         # a changed prefix is a new cache
    assert cache_key(bb, splits, splits.train, spec, prefix=2) != k2
    with pytest.raises(UserError, match="needs 1 … 3 stages"):
        cached_prefix(bb, 4, splits, splits.train, spec, cfg, str(folder / "cache"), progress=False)


def test_features_pass_that_also_stores_the_prefix_gives_both_caches_bit_for_bit(folder):
    cfg, splits, bb, spec = setup(folder)
    sub = splits.train
    joint, alone = str(folder / "joint"), str(folder / "alone")
    f, y, kept = backbone_features(bb, splits, sub, spec, cfg, joint, progress=False, prefix_stages=2)
    assert len(list(Path(joint).iterdir())) == 2  # the feature cache and the prefix cache
    f0, y0, kept0 = backbone_features(bb, splits, sub, spec, cfg, alone, progress=False)
    assert np.array_equal(f, f0) and np.array_equal(y, y0) and np.array_equal(kept, kept0)
    pc = cached_prefix(bb, 2, splits, sub, spec, cfg, joint, progress=False)  # a hit: nothing computed
    ref = cached_prefix(bb, 2, splits, sub, spec, cfg, alone, progress=False)
    assert pc.path.parent == Path(joint) and len(list(Path(joint).iterdir())) == 2
    assert pc.path.name == ref.path.name
    assert np.array_equal(np.asarray(pc.maps), np.asarray(ref.maps))
    assert np.array_equal(pc.labels, ref.labels) and np.array_equal(pc.kept, ref.kept)
    assert json.loads((pc.path / "meta.json").read_text()) == json.loads((ref.path / "meta.json").read_text())
