"""A run's numeric precision: its names, torch-free (the config, the report and the verdict
compare them), and what each can run on (`fp8_problem`). The object a run computes with — its
autocast, GradScaler and dtypes — is `accelexp.precision.runtime.Precision`, owned by the run's
strategy (`Strategy.precision`).

`Name` is the one list of the `precision` config group's options (`conf/precision/`, in the
report's order); every other module compares a run's precision against its members, never a
string of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


class Name(StrEnum):
    """The `precision` options, in the report's order (a member equals its string)."""

    FP32 = "fp32"  # float32 throughout
    AMP = "amp"  # fp16 autocast + GradScaler on CUDA; bf16 autocast on a CPU
    BF16 = "bf16"  # bf16 autocast, fp32 weights
    BF16_TRUE = "bf16_true"  # bf16 weights, no autocast
    FP8 = "fp8"  # torchao's fp8 matmuls (CUDA, compute capability >= 8.9), bf16 autocast


NAMES = tuple(Name)
# a precision a run already computes in half width, and the options that would not halve it again
# (the verdict's advice leaves these out)
HALF_WIDTH_ALREADY = {Name.BF16_TRUE: (Name.AMP, Name.BF16), Name.FP8: (Name.AMP, Name.BF16)}

FP8_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9), Hopper (9.0) and later


def fp8_problem(device_type: str, capabilities: Sequence[tuple[int, int]] = ()) -> str:
    """Why `precision=fp8` cannot run on a `device_type` whose GPUs have these compute
    `capabilities`, and what to use instead; "" when it can (CUDA, every GPU at least 8.9)."""
    if device_type == "cuda" and capabilities and min(capabilities) >= FP8_CAPABILITY:
        return ""
    if device_type != "cuda" or not capabilities:
        here = "this run has no CUDA GPU: it computes on the CPU"
    else:
        low = min(capabilities)
        here = f"this machine's GPU has compute capability {low[0]}.{low[1]}"
    need = ".".join(map(str, FP8_CAPABILITY))
    return (
        f"precision=fp8 runs its matmuls on fp8 tensor cores, which need an NVIDIA GPU of "
        f"compute capability >= {need} (Ada, Hopper or newer), and {here}. Use precision=bf16 "
        f"(bf16 autocast) or precision=bf16_true (bf16 weights: half the model's memory)."
    )
