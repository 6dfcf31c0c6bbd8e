"""How much of the device's arithmetic a run uses: model FLOPs against a measured matmul peak.

`train_flops_per_sample` counts one sample's forward pass with PyTorch's own FLOP counter
(`torch.utils.flop_counter.FlopCounterMode`: matmuls, convolutions, attention) and takes three
times that for a training step (forward, and a backward pass of about twice the forward's work),
the convention of MFU figures. `peak_flops` measures what this device reaches on a large square
matmul in the run's compute dtype, best of a few, rather than trusting a datasheet: the share of
it a run reaches (`flop_utilisation`) tells a model that keeps the device's arithmetic busy from
one whose steps are mostly fixed per-step costs (Python, dispatch, kernel launches).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

TRAIN_OVER_FORWARD = 3


@torch.no_grad()
def train_flops_per_sample(model: nn.Module, sample_shape: Sequence[int]) -> float | None:
    """FLOPs of one training sample (3x the forward's), or None when they cannot be counted.

    One forward pass of a zero batch of one sample, in eval mode (BatchNorm statistics and
    dropout untouched, no random numbers drawn), on the device of the model's first parameter.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        counter = FlopCounterMode(display=False)
        with counter:
            model(torch.zeros(1, *sample_shape, device=device))
        return float(counter.get_total_flops() * TRAIN_OVER_FORWARD) or None
    except Exception:  # a model the counter cannot trace: no utilisation figure, no failure
        return None
    finally:
        model.train(was_training)


def peak_flops(
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    size: int | None = None,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
) -> float:
    """FLOP/s of the best of `repeats` timed `size` x `size` matmuls of `dtype` (the run's
    parameters': bf16 under precision=bf16_true) under `autocast`."""
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, generator=_generator(device)).to(dtype)
    b = torch.randn(size, size, device=device, generator=_generator(device)).to(dtype)
    best = float("inf")
    with autocast():
        a @ b  # warm-up: kernel choice, first-touch
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            a @ b
            _sync(device)
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _generator(device: torch.device) -> torch.Generator:
    """Its own generator: measuring the peak draws nothing from the run's random streams."""
    return torch.Generator(device).manual_seed(0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
