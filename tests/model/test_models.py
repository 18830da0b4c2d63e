"""Backbones load completely and offline; checkpoints round-trip and refuse mismatches."""

import pytest
import torch

from core.errors import CheckpointMismatchError, UserError
from model.backbones import BACKBONES, build_backbone
from model.checkpoint import load_model, read_checkpoint, save_checkpoint
from model.network import EmbeddingModel


def test_efficientnet_lite0_pretrained_load_is_complete():
    from model.backbones.efficientnet_lite0 import packaged_weights_path

    bb = build_backbone("efficientnet_lite0")
    src = torch.load(packaged_weights_path(), map_location="cpu", weights_only=True)
    src_t = [v for k, v in src.items() if not k.endswith("num_batches_tracked")]
    own = {k: v for k, v in bb.trunk.state_dict().items() if not k.endswith("num_batches_tracked")}
    # every trunk tensor equals its source tensor, in order (the classifier was dropped)
    assert len(own) == len(src_t) - 2
    for (k, v), s in zip(own.items(), src_t[:-2], strict=True):  # the classifier's two tensors come last
        assert torch.equal(v, s), k
    assert bb.dim == 1280
    with torch.inference_mode():
        f = bb.eval()(torch.randn(2, 3, 64, 64))
    assert f.shape == (2, 1280) and torch.isfinite(f).all()
    assert bb.fingerprint() == build_backbone("efficientnet_lite0").fingerprint()
    assert bb.fingerprint() != build_backbone("efficientnet_lite0", weights="none").fingerprint()


def test_torchvision_missing_weights_say_where(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(UserError, match=r"resnet18-f37072fd\.pth.*--weights none"):
        build_backbone("resnet18")


@pytest.mark.parametrize("name,dim", [("resnet18", 512), ("googlenet", 1024)])
def test_torchvision_from_local_file_and_cache(tmp_path, monkeypatch, name, dim):
    import torchvision

    from model.backbones.torchvision_nets import cached_weights_path

    if name == "googlenet":
        ref = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=True)
    else:
        ref = torchvision.models.resnet18(weights=None)
    f = tmp_path / "w.pth"
    torch.save(ref.state_dict(), f)
    bb = build_backbone(name, weights=str(f))
    assert bb.dim == dim
    assert torch.equal(bb.trunk.conv1.weight if name == "resnet18" else bb.trunk.conv1.conv.weight,
                       ref.conv1.weight if name == "resnet18" else ref.conv1.conv.weight)
    with torch.inference_mode():
        assert bb.eval()(torch.randn(1, 3, 64, 64)).shape == (1, dim)
    # the same file in the torch cache is found by "imagenet"
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    p = cached_weights_path(name)
    p.parent.mkdir(parents=True)
    p.write_bytes(f.read_bytes())
    assert build_backbone(name).dim == dim


def test_partial_weights_are_refused(tmp_path):
    import torchvision

    sd = torchvision.models.resnet18(weights=None).state_dict()
    sd.pop("layer4.1.bn2.weight")
    f = tmp_path / "partial.pth"
    torch.save(sd, f)
    with pytest.raises(UserError, match="1 missing"):
        build_backbone("resnet18", weights=str(f))


def test_registry_and_small_cnn():
    assert {"efficientnet_lite0", "resnet18", "resnet50", "googlenet", "small_cnn"} <= set(BACKBONES)
    bb = build_backbone("small_cnn")
    assert bb(torch.randn(2, 3, 32, 32)).shape == (2, bb.dim)
    with pytest.raises(UserError, match="no pretrained"):
        build_backbone("small_cnn", weights="imagenet")
    with pytest.raises(UserError, match="unknown backbone"):
        build_backbone("vgg")


def test_metric_matrix_is_w_transpose_w():
    torch.manual_seed(0)
    m = EmbeddingModel(build_backbone("small_cnn"), embed_dim=16)
    f = torch.randn(5, m.trunk_dim)
    e = m.embed_features(f)
    assert m.W.shape == (16, m.trunk_dim) and m.M.shape == (m.trunk_dim, m.trunk_dim)
    # eᵢᵀeⱼ = φᵢᵀ M φⱼ
    torch.testing.assert_close(e @ e.T, f @ m.M @ f.T, rtol=1e-4, atol=1e-4)


def test_checkpoint_roundtrip_and_refusals(tmp_path):
    torch.manual_seed(0)
    m = EmbeddingModel(build_backbone("small_cnn"), embed_dim=8)
    p = tmp_path / "ck.pt"
    save_checkpoint(p, m, config={"lr": 1e-3}, split={"test": [1, 2]}, metrics={"map@r": 0.5},
                    extra={"proxies": torch.randn(3, 8)})
    m2, ck = load_model(p, backbone="small_cnn", embed_dim=8)
    assert ck["metrics"]["map@r"] == 0.5 and ck["config"]["lr"] == 1e-3
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(m.eval()(x), m2(x))
    with pytest.raises(CheckpointMismatchError, match="backbone 'small_cnn', not 'resnet18'"):
        load_model(p, backbone="resnet18")
    with pytest.raises(CheckpointMismatchError, match="embedding dimension 8, expected 128"):
        load_model(p, embed_dim=128)
    # truncated file
    t = tmp_path / "trunc.pt"
    t.write_bytes(p.read_bytes()[:1000])
    with pytest.raises(UserError, match="cannot read checkpoint"):
        read_checkpoint(t)
    # a torch file that is not ours
    o = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(1)}, o)
    with pytest.raises(UserError, match="not a checkpoint of this project"):
        read_checkpoint(o)


def test_checkpoint_never_unpickles(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    p = tmp_path / "evil.pt"
    with open(p, "wb") as f:
        pickle.dump({"format": "dml-retrieval-checkpoint", "x": Evil()}, f)
    with pytest.raises(UserError, match="cannot read checkpoint"):
        read_checkpoint(p)


def test_interrupted_checkpoint_write_keeps_previous(tmp_path, monkeypatch):
    m = EmbeddingModel(build_backbone("small_cnn"), embed_dim=8)
    p = tmp_path / "latest.pt"
    save_checkpoint(p, m, metrics={"epoch": 1})
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(p, m, metrics={"epoch": 2})
    monkeypatch.setattr(torch, "save", real_save)
    assert read_checkpoint(p)["metrics"]["epoch"] == 1
    assert [x.name for x in tmp_path.iterdir()] == ["latest.pt"]
