"""A timm ViT as the trunk, end to end on tiny kanji: frozen, tail over the cached token prefix (equal
to the whole trunk bit for bit) and fine-tune; an index built from the checkpoint with no flags,
offline, that serves a search and the app."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from tiny_kanji import tiny as _tiny
from tiny_timm import NAME

from training.trainer import Run, train


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))


def tiny(tmp_path, kanji_root, **kw):
    return _tiny(tmp_path, kanji_root, **({"backbone": NAME, "weights": "none", "epochs": 1, "device": "cpu",
                                           "embed_dim": 8} | kw))


def test_frozen_neck_on_a_timm_vit(tmp_path, kanji_root):
    m = train(tiny(tmp_path, kanji_root))
    assert np.isfinite(m["test"]["map@r"]) and m["test"]["map@r"] > 0


def test_tail_over_the_cached_token_prefix_is_the_whole_trunk_bit_for_bit(tmp_path, kanji_root):
    from model.features import backbone_features

    cfg = tiny(tmp_path, kanji_root, train_blocks=2)
    run = Run(cfg)
    run.setup()
    src = run.source
    assert src.n_prefix == 2  # embed, block0 cached; block1 and block2 (with the norm and pooling) train
    pc = src.cache["train"]
    assert pc.maps.dtype == np.float32 and pc.maps.shape[1:] == (1 + 16, 32)  # class token + 4 × 4 patches
    bb = run.backbone.eval()
    feats, labels, kept = backbone_features(bb, run.splits, run.splits.train, run.transform, run.dcfg, None, False)
    assert np.array_equal(kept, pc.kept) and np.array_equal(labels, pc.labels)
    bs = run.dcfg.eval_batch_size  # the same batches as the features' pass
    with torch.no_grad():
        tail = torch.cat([bb.run_stages(torch.from_numpy(np.array(pc.maps[i: i + bs])), src.n_prefix)
                          for i in range(0, len(pc.labels), bs)])
    assert torch.equal(tail, torch.from_numpy(feats))
    m = train(dataclasses.replace(cfg, overwrite=True))  # the set-up run made the folder
    assert np.isfinite(m["test"]["map@r"])
    from model.checkpoint import load_model

    model, ck = load_model(tmp_path / "run" / "best.pt")
    assert ck["backbone"] == NAME and ck["backbone_preprocessing"]["interpolation"] == "bicubic"
    trained = model.backbone.trunk.state_dict()
    init_sd = bb.trunk.state_dict()  # the set-up run's: the same seed's initial weights
    assert torch.equal(trained["patch_embed.proj.weight"], init_sd["patch_embed.proj.weight"])
    assert torch.equal(trained["blocks.0.attn.qkv.weight"], init_sd["blocks.0.attn.qkv.weight"])
    assert not torch.equal(trained["blocks.2.attn.qkv.weight"], init_sd["blocks.2.attn.qkv.weight"])


def test_finetune_trains_every_stage_of_the_vit(tmp_path, kanji_root):
    cfg = tiny(tmp_path, kanji_root, mode="finetune")
    before = Run(cfg)
    before.setup()
    sd0 = {k: v.clone() for k, v in before.backbone.trunk.state_dict().items()}
    m = train(dataclasses.replace(cfg, overwrite=True))  # the set-up run made the folder
    assert np.isfinite(m["test"]["map@r"])
    from model.checkpoint import load_model

    model, _ = load_model(tmp_path / "run" / "best.pt")
    sd = model.backbone.trunk.state_dict()
    for k in ("patch_embed.proj.weight", "pos_embed", "blocks.0.attn.qkv.weight", "norm.weight"):
        assert not torch.equal(sd[k], sd0[k]), k


def test_index_from_a_timm_checkpoint_serves_search_and_the_app(tmp_path, kanji_root):
    from PIL import Image
    from support import run_command

    from app.service import RetrievalService, SearchConfig
    from app.ui import build_ui

    train(tiny(tmp_path, kanji_root, train_blocks=1))
    r = run_command("index", "build", "--checkpoint", tmp_path / "run" / "best.pt", "--out", tmp_path / "idx",
                    "--cache-dir", "", "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    man = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert man["backbone"] == NAME and man["transform"]["interpolation"] == "bicubic"
    svc = RetrievalService(tmp_path / "idx")
    src = svc.root / svc.data.items.paths[2]
    Image.open(src).save(tmp_path / "q.png")
    q = svc.query_from_upload(str(tmp_path / "q.png"))
    panel = svc.panel(q, SearchConfig("trained", {}, "cosine"), k=3)
    assert panel.results[0]["id"] == int(svc.data.items.ids[2])  # the query image finds itself first
    assert build_ui(svc) is not None


def test_a_tail_as_long_as_the_vit_is_refused_in_one_line(tmp_path, kanji_root):
    from core.errors import UserError

    with pytest.raises(UserError, match=r"trains 1 … 3 of timm:dml_test_vit's 4 stages, got --train-blocks 4"):
        Run(tiny(tmp_path, kanji_root, train_blocks=4)).setup()
