"""Device and precision selection, shared by every command that runs a model.

`--device auto|cpu|cuda|cuda:N`: auto takes CUDA when available.  Asking for a
CUDA device that is not there is refused (one line), never silently downgraded.
`--precision fp32|bf16|fp16`: autocast for the forward pass; fp16 on CPU is
refused (CPU autocast is bf16 only).  FAISS stays on the CPU: outputs come back
as contiguous float32.
"""
from __future__ import annotations

import contextlib
import os
import re

import torch

from core.errors import UserError

DEVICE_HELP = "auto (CUDA when available) | cpu | cuda | cuda:N"
PRECISIONS = ("fp32", "bf16", "fp16")


def resolve_device(spec: str | None = "auto") -> torch.device:
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if not m:
        raise UserError(f"--device must be {DEVICE_HELP}, got {spec!r}")
    if not torch.cuda.is_available():
        raise UserError(f"--device {spec}: CUDA is not available on this machine; use --device cpu or auto")
    idx = int(m.group(1) or 0)
    if idx >= torch.cuda.device_count():
        raise UserError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", idx)


def autocast(device: torch.device, precision: str = "fp32"):
    """A context for the forward pass at `precision` on `device` (fp32: no autocast)."""
    if precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    if device.type == "cpu" and precision == "fp16":
        raise UserError("--precision fp16 needs CUDA; on the CPU use bf16 or fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


# fine-tuning backbones whose channels_last speed was measured (bench/train_throughput.py, docs/training.md)
CHANNELS_LAST_MEASURED = ("efficientnet_lite0",)
CHANNELS_LAST_CUDA_MIN_SIZE = 128  # H200: 1.54× faster at 224 px (fp32), slower at 64 px


def use_channels_last(choice: str, device: torch.device, backbone: str, image_size: int,
                      whole_network: bool = True) -> bool:
    """--channels-last on | off | auto.  auto: on where it was measured faster for fine-tuning this
    backbone (`whole_network`): on the CPU at every size, on CUDA from CHANNELS_LAST_CUDA_MIN_SIZE px.
    A trained tail stays in the default layout (its gain on the CPU is smaller, and tail runs keep
    reproducing the results recorded for them)."""
    if choice != "auto":
        return choice == "on"
    if not whole_network or backbone not in CHANNELS_LAST_MEASURED:
        return False
    return device.type == "cpu" or (device.type == "cuda" and image_size >= CHANNELS_LAST_CUDA_MIN_SIZE)


def compile_mode(device: torch.device) -> str:
    """torch.compile's mode for `device`: CUDA graphs on CUDA (a small model's step is bound by
    kernel launches there), inductor's default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def compiled(fn, device: torch.device):
    """`fn` compiled for `device` (shapes taken as static: one graph per batch shape)."""
    return torch.compile(fn, mode=compile_mode(device), dynamic=False)


@contextlib.contextmanager
def deterministic_algorithms(on: bool = True):
    """Deterministic kernels only, for this block: cuDNN's convolutions (no autotuning) and cuBLAS
    with a fixed workspace, so that a CUDA run repeats bit for bit; an op with no deterministic
    kernel warns.  The previous settings come back after."""
    if not on:
        yield
        return
    cudnn = torch.backends.cudnn
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             cudnn.deterministic, cudnn.benchmark)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS makes its handle
    torch.use_deterministic_algorithms(True, warn_only=True)
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        cudnn.deterministic, cudnn.benchmark = saved[2], saved[3]
