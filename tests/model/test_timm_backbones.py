"""timm trunks (`timm:NAME`) and EfficientNet-Lite1/2: stages, preprocessing, weights from a file or the
local Hugging Face cache (offline), and the refusals."""
import importlib.util

import pytest
import torch
from safetensors.torch import save_file
from support import run_command
from tiny_timm import HUB_ID, NAME

from core.errors import UserError
from model.backbones import BACKBONES, build_backbone
from model.preprocess import TransformSpec, transform_for


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Never the network, never the user's cache: an empty stand-in hub cache unless a test fills it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def test_list_shows_how_to_name_a_timm_model(tmp_path):
    r = run_command("training", "list", "backbones", cwd=tmp_path)
    assert r.returncode == 0
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("timm:NAME"))
    assert "timm:vit_small_patch14_dinov2" in line and "--weights hub" in line
    assert "efficientnet_lite1" in r.stdout and "input size: 260 px" in r.stdout


def test_family_names_resolve_and_bad_ones_are_refused():
    assert BACKBONES.get("timm:convnext_atto").family
    assert BACKBONES.check_name("timm:convnext_atto") == "timm:convnext_atto"
    with pytest.raises(UserError, match="write timm:NAME"):
        BACKBONES.get("timm:")
    with pytest.raises(UserError, match="timm has no model 'no_such_net'"):
        build_backbone("timm:no_such_net", "none")
    with pytest.raises(UserError, match="--weights hub"):
        build_backbone(NAME, "imagenet")
    with pytest.raises(UserError, match="for timm:NAME backbones"):
        build_backbone("resnet18", "hub")


@pytest.mark.parametrize("name, expected", [
    (NAME, ["embed", "block0", "block1", "block2"]),
    ("timm:convnext_atto", ["stem", "stage0", "stage1", "stage2", "stage3"]),
    ("timm:resnet10t", ["stem", "layer1", "layer2", "layer3", "layer4"]),
])
def test_timm_stages_are_the_trunk_bit_for_bit_and_partition_its_parameters(name, expected):
    torch.manual_seed(0)
    bb = build_backbone(name, "none").eval()
    assert [n for n, _ in bb.stages()] == expected
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        full = bb(x)
        ref = bb.trunk.forward_head(bb.trunk.forward_features(x), pre_logits=True)
        split = bb.run_stages(bb.run_stages(x, 0, 2), 2)
    assert full.shape == (3, bb.dim) and torch.equal(full, ref) and torch.equal(full, split)
    seen = [id(p) for _, m in bb.stages() for p in m.parameters()]
    assert len(seen) == len(set(seen)) and set(seen) == {id(p) for p in bb.trunk.parameters()}
    assert all(k.startswith("trunk.") for k in bb.state_dict())


def test_vit_stages_token_maps_and_other_input_sizes():
    torch.manual_seed(0)
    bb = build_backbone(NAME, "none").eval()
    with torch.no_grad():
        tokens = bb.run_stages(torch.randn(2, 3, 32, 32), 0, 1)
        assert tokens.shape == (2, 1 + 16, 32)  # the class token and a 4 × 4 grid of 8-px patches
        assert bb(torch.randn(2, 3, 64, 64)).shape == (2, 32)  # the position embedding follows the grid
        assert bb.run_stages(torch.randn(2, 3, 36, 36), 0, 1).shape == (2, 1 + 25, 32)  # padded to 40: 5 × 5
    assert bb.prefix_dtype == torch.float32


def test_preprocessing_comes_from_timms_pretrained_configuration():
    from data import DataConfig

    bb = build_backbone("timm:vit_small_patch14_dinov2.lvd142m", "none")
    assert (bb.mean, bb.std, bb.input_size, bb.interpolation, bb.crop_pct) == (
        (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 518, "bicubic", 1.0)
    res = build_backbone("timm:resnet18", "none")
    cfg = res.trunk.pretrained_cfg
    assert (res.interpolation, res.crop_pct) == (cfg["interpolation"], cfg["crop_pct"]) == ("bicubic", 0.95)
    spec = transform_for(res, DataConfig(dataset="imagefolder", image_size=224, resize_mode="crop"))
    assert spec.resize == round(224 / 0.95) and spec.interpolation == "bicubic"
    assert TransformSpec.from_dict(spec.describe()) == spec
    # the convolutional backbones keep their transform and its cache key: bilinear, 256/224
    lite = transform_for(build_backbone("small_cnn", "none"), DataConfig(dataset="imagefolder", image_size=224,
                                                                          resize_mode="crop"))
    assert lite.resize == 256 and "interpolation" not in lite.describe()


def _headless_state(seed=1):
    torch.manual_seed(seed)
    return build_backbone(NAME, "none").trunk.state_dict()


def test_weights_round_trip_through_a_file(tmp_path):
    sd = _headless_state()
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "w.safetensors")
    torch.save(dict(sd), tmp_path / "w.pt")
    x = torch.randn(2, 3, 32, 32)
    outs = []
    for f in ("w.safetensors", "w.pt"):
        bb = build_backbone(NAME, str(tmp_path / f)).eval()
        assert bb.weights == str(tmp_path / f)
        assert all(torch.equal(bb.trunk.state_dict()[k], v) for k, v in sd.items())
        with torch.no_grad():
            outs.append(bb(x))
    assert torch.equal(outs[0], outs[1])


def test_incomplete_or_missing_weights_are_refused(tmp_path):
    sd = _headless_state()
    part = {k: v.contiguous() for k, v in sd.items() if not k.startswith("blocks.2.")}
    save_file(part, tmp_path / "part.safetensors")
    with pytest.raises(UserError, match="do not fit"):
        build_backbone(NAME, str(tmp_path / "part.safetensors"))
    r = run_command("training", "evaluate", "--backbone", NAME, "--weights", str(tmp_path / "nope.safetensors"),
                    "--dataset", "imagefolder", "--data-root", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nope.safetensors" in lines[0]


def _hub_file(tmp_path, sd: dict):
    """The layout huggingface_hub gives a cached download: refs/main names the snapshot."""
    repo = tmp_path / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, snap / "model.safetensors")
    return snap / "model.safetensors"


def test_hub_weights_come_from_the_local_cache_offline(tmp_path):
    torch.manual_seed(2)
    full = __import__("timm").create_model("dml_test_vit", pretrained=False).state_dict()  # with its classifier
    path = _hub_file(tmp_path, full)
    bb = build_backbone(NAME, "hub")
    assert bb.weights == "hub"
    own = bb.trunk.state_dict()
    assert set(own) == {k for k in full if not k.startswith("head.")}
    assert all(torch.equal(own[k], full[k]) for k in own)
    if importlib.util.find_spec("huggingface_hub"):  # the same file huggingface_hub's offline lookup finds
        from huggingface_hub import try_to_load_from_cache

        assert try_to_load_from_cache(HUB_ID, "model.safetensors", cache_dir=str(tmp_path / "hub")) == str(path)


def test_hub_weights_absent_are_refused_in_one_line_naming_the_file(tmp_path):
    with pytest.raises(UserError) as e:
        build_backbone(NAME, "hub")
    msg = str(e.value)
    assert "\n" not in msg and "model.safetensors" in msg
    assert str(tmp_path / "hub" / ("models--" + HUB_ID.replace("/", "--"))) in msg


def test_lite1_and_lite2_architectures_and_their_input_sizes():
    for name, size in (("efficientnet_lite1", 240), ("efficientnet_lite2", 260)):
        torch.manual_seed(0)
        bb = build_backbone(name, "none").eval()
        assert bb.input_size == size == BACKBONES.get(name).spec.input_size and bb.dim == 1280
        x = torch.randn(1, 3, 64, 64)
        with torch.no_grad():
            assert torch.equal(bb(x), bb.run_stages(bb.run_stages(x, 0, 3), 3))


@pytest.mark.parametrize("variant", [1, 2])
def test_lite_pretrained_weights_from_their_package(variant):
    bb = build_backbone(f"efficientnet_lite{variant}")
    torch.manual_seed(0)
    rand = build_backbone(f"efficientnet_lite{variant}", "none")
    assert bb.weights == "imagenet"
    assert not torch.equal(bb.trunk.conv_stem.weight, rand.trunk.conv_stem.weight)


def test_image_size_zero_on_photos_is_the_backbones_own_and_data_sets_with_their_own_size_keep_it():
    from training.config import TrainConfig

    def size(**kw):
        return TrainConfig(**kw).data_config().image_size

    assert size(dataset="cub", backbone="efficientnet_lite1") == 240
    assert size(dataset="sop", backbone="efficientnet_lite2") == 260
    assert size(dataset="cub", backbone="timm:vit_small_patch14_dinov2.lvd142m") == 518
    assert size(dataset="cub", backbone="efficientnet_lite2", image_size=128) == 128  # given: kept
    assert size(dataset="cub", backbone="small_cnn") == 0  # no size of its own: the data set's 224
    assert size(dataset="kanji", backbone="efficientnet_lite2") == 0  # rendered at the data set's 64 px
    assert size(dataset="imagefolder", backbone="efficientnet_lite2") == 0  # sized from its files
