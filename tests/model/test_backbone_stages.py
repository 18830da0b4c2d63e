"""Every backbone declares its stages; running them in turn is exactly the trunk's forward pass."""
import pytest
import torch

from model.backbones import BACKBONES, build_backbone

EXPECTED = {
    "efficientnet_lite0": ["stem"] + [f"blocks{i}" for i in range(7)] + ["head"],
    "efficientnet_lite1": ["stem"] + [f"blocks{i}" for i in range(7)] + ["head"],
    "efficientnet_lite2": ["stem"] + [f"blocks{i}" for i in range(7)] + ["head"],
    "small_cnn": ["block0", "block1", "block2", "block3"],
    "resnet18": ["stem", "layer1", "layer2", "layer3", "layer4"],
    "resnet50": ["stem", "layer1", "layer2", "layer3", "layer4"],
    "googlenet": ["stem", "inception3", "inception4", "inception5"],
}


def test_every_registered_backbone_is_covered():
    """(The timm:NAME family's stages depend on the model: tests/model/test_timm_backbones.py.)"""
    assert set(EXPECTED) == {e.name for e in BACKBONES.entries() if not e.family}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_stages_compose_to_the_trunk(name):
    torch.manual_seed(0)
    bb = build_backbone(name, weights="none").eval()
    assert [n for n, _ in bb.stages()] == EXPECTED[name]
    assert list(BACKBONES.get(name).spec.stages) == EXPECTED[name]  # what --help and validation count
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        full = bb(x)
        split = bb.run_stages(bb.run_stages(x, 0, 2), 2)
    assert full.shape == (2, bb.dim)
    assert torch.allclose(full, split, atol=1e-5)
    keys = set(bb.state_dict())
    assert all(k.startswith("trunk.") for k in keys)  # stages add no state-dict keys: checkpoints unchanged


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_stages_partition_the_trunk_parameters(name):
    """Each parameter belongs to exactly one stage: the optimizer's per-stage groups and the frozen
    prefix depend on it."""
    bb = build_backbone(name, weights="none")
    seen = [id(p) for _, m in bb.stages() for p in m.parameters()]
    assert len(seen) == len(set(seen))
    assert set(seen) == {id(p) for p in bb.trunk.parameters()}
