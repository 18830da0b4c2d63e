"""model/device.py: device and precision selection refuse what the machine cannot do."""
import pytest
import torch

from core.errors import UserError
from model.device import autocast, resolve_device


def test_auto_and_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_is_refused_without_cuda():
    with pytest.raises(UserError, match="CUDA is not available on this machine"):
        resolve_device("cuda:0")


def test_bad_specs_and_precisions_are_refused():
    with pytest.raises(UserError, match="--device must be"):
        resolve_device("gpu")
    with pytest.raises(UserError, match="--precision must be one of"):
        autocast(torch.device("cpu"), "fp8")
    with pytest.raises(UserError, match="fp16 needs CUDA"):
        autocast(torch.device("cpu"), "fp16")


def test_bf16_autocast_on_cpu_runs_the_matmul_in_bf16():
    a = torch.randn(4, 8)
    with autocast(torch.device("cpu"), "bf16"):
        out = a @ a.T
    assert out.dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert (a @ a.T).dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_embedding_matches_cpu():
    from model.backbones import build_backbone

    torch.manual_seed(0)
    bb = build_backbone("small_cnn", "none").eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        cpu = bb(x)
        gpu = bb.to("cuda")(x.to("cuda")).cpu()
    assert torch.allclose(cpu, gpu, atol=1e-4)


def test_deterministic_algorithms_hold_inside_the_block_only():
    from model.device import deterministic_algorithms

    cudnn = torch.backends.cudnn
    before = (torch.are_deterministic_algorithms_enabled(), cudnn.deterministic, cudnn.benchmark)
    with deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert cudnn.deterministic and not cudnn.benchmark
    assert (torch.are_deterministic_algorithms_enabled(), cudnn.deterministic, cudnn.benchmark) == before
    with deterministic_algorithms(False):
        assert torch.are_deterministic_algorithms_enabled() == before[0]
