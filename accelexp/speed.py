"""Speed switches (`speed.*`): how fast a run goes, set once by the builder, unseen by the loop.

- `cudnn_benchmark`: cuDNN times its convolution algorithms for each new shape and keeps the
  fastest (the training shapes are fixed: the last, shorter batch is dropped).
- `tf32`: fp32 matmuls and convolutions on TF32 tensor cores (Ampere and later). Off by default
  so that `precision=fp32` means IEEE fp32 — PyTorch's own default lets cuDNN use TF32 for
  convolutions, which would hide part of what AMP gains; TF32 is a rung of its own.
- `channels_last`: the model's 4-D weights and every batch in NHWC, the layout tensor cores
  want. `auto`: on with CUDA for a model with 2-D convolutions, off on a CPU.
- `compile`: `torch.compile` with that mode (`reduce-overhead` adds CUDA graphs), applied by the
  strategy — the DDP module as a whole, each stage of a pipeline — in place, so state dict names
  do not change. Compiling happens during the first steps; the loop times them apart
  (`compile_s`) and leaves them out of `samples_per_s`.
- `optimizer_impl`: the optimizer's kernels — one per parameter (`for_loop`), batched
  (`foreach`, PyTorch's default on CUDA), or one fused kernel (`fused`).
- `activation_checkpointing` (`none | full | selective`, with `selective_ac_option`): a memory
  lever that costs speed — blocks run their forward again in the backward instead of keeping
  their activations (`accelexp.activation_checkpoint`); applied here, before compile and before
  a strategy shards the model, as torchtitan orders them.
- `heap`: glibc's malloc thresholds pinned (`pinned`) or left to follow the process's history
  (`dynamic`); `auto` pins on a CPU. A process-wide setting (`accelexp.heap` says why).

`deterministic=true` wins over `cudnn_benchmark` and `tf32`: both are turned off, said once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from accelexp import activation_checkpoint
from accelexp import heap as host_heap
from accelexp.errors import AccelexpError
from accelexp.record import SPEED
from accelexp.schema import SpeedConfig

log = logging.getLogger(__name__)

# steps of the first epoch timed as compilation: tracing and compiling forward and backward,
# then (reduce-overhead) a warm-up run and the CUDA graph's recording before it is replayed
COMPILE_WARMUP_STEPS = 3
SHORT_NAMES = {"channels_last": "cl", "tf32": "tf32"}
OPTIMIZER_IMPL_KWARGS: dict[str, dict[str, bool]] = {
    "auto": {},
    "for_loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


class SpeedConfigError(AccelexpError, ValueError):
    """A speed switch does not fit the model or the machine; the message says what to use."""


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and cuDNN convolutions, on or off.

    Through the setters that torch 2.11 to 2.14 keep readable by both the old and the new
    (`fp32_precision`) flag APIs; setting the new flags alone makes later reads of the old ones
    (as some libraries do) raise.
    """
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def tf32_enabled() -> bool:
    return torch.get_float32_matmul_precision() != "highest" and torch.backends.cudnn.allow_tf32


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


@dataclass(frozen=True)
class SpeedSwitches:
    """The resolved switches of one run (every `auto` decided)."""

    channels_last: bool = False
    cudnn_benchmark: bool = False
    tf32: bool = False
    compile: str = "off"
    optimizer_impl: str = "auto"
    activation_checkpointing: str = "none"
    selective_ac_option: str = "2"
    heap: str = host_heap.DYNAMIC

    @classmethod
    def resolve(
        cls, cfg: SpeedConfig, device: torch.device, model: nn.Module, deterministic: bool = False
    ) -> SpeedSwitches:
        conv = has_conv2d(model)
        channels_last = cfg.channels_last
        if channels_last == "auto":
            channels_last = device.type == "cuda" and conv
        elif channels_last and not conv:
            raise SpeedConfigError(
                f"speed.channels_last=true, but {type(model).__name__} has no 2-D convolution: "
                f"the NHWC layout only helps convolutions and would add copies here. Use "
                f"speed.channels_last=auto or false."
            )
        benchmark, tf32 = cfg.cudnn_benchmark, cfg.tf32
        if deterministic and (benchmark or tf32):
            log.info("deterministic=true: cuDNN autotuning and TF32 are turned off")
            benchmark = tf32 = False
        ac, ac_option = cfg.activation_checkpointing, str(cfg.selective_ac_option)
        activation_checkpoint.chosen(model, ac, ac_option)  # refuses a model without blocks
        return cls(
            bool(channels_last),
            benchmark,
            tf32,
            cfg.compile,
            cfg.optimizer_impl,
            ac,
            ac_option,
            host_heap.resolve(cfg.heap, device.type),
        )

    # --- what the builder applies --------------------------------------------------------------
    def apply_backends(self) -> None:
        """The process-wide backend flags and heap (before any model runs)."""
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        set_tf32(self.tf32)
        if self.heap == host_heap.PINNED and not host_heap.pin():
            log.warning("speed.heap=pinned: glibc refused the thresholds; they follow the run")

    @property
    def memory_format(self) -> torch.memory_format:
        """The layout of every batch (and of the model's 4-D weights)."""
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model in its memory format, its blocks checkpointed, before a strategy places,
        compiles or wraps it."""
        if self.channels_last:
            model = model.to(memory_format=self.memory_format)
        activation_checkpoint.apply(model, self.activation_checkpointing, self.selective_ac_option)
        return model

    @property
    def checkpointing(self) -> str:
        """`activation_checkpointing` in a word: none, full, every2 (every 2nd block), op."""
        if self.activation_checkpointing != "selective":
            return self.activation_checkpointing
        option = self.selective_ac_option
        return option if option == activation_checkpoint.OP else f"every{option}"

    def optimizer_kwargs(self) -> dict[str, bool]:
        """Keyword arguments of torch's SGD/AdamW that choose their kernels."""
        return OPTIMIZER_IMPL_KWARGS[self.optimizer_impl]

    @property
    def compile_mode(self) -> str | None:
        return None if self.compile == "off" else self.compile

    @property
    def warmup_steps(self) -> int:
        """First-epoch steps the loop times as compilation (0: nothing to compile)."""
        return COMPILE_WARMUP_STEPS if self.compile_mode else 0

    # --- what is logged -------------------------------------------------------------------------
    def summary(self) -> str:
        """A short name of the switches that are on: 'eager', 'tf32+cl+compile:default', ..."""
        parts = [SHORT_NAMES[k] for k in ("tf32", "channels_last") if getattr(self, k)]
        if self.compile_mode:
            parts.append(f"compile:{self.compile}")
        if self.optimizer_impl != "auto":
            parts.append(self.optimizer_impl)
        if self.checkpointing != "none":
            parts.append(f"ac:{self.checkpointing}")
        return "+".join(parts) or "eager"

    def tags(self) -> dict[str, str]:
        """Each switch as a tag (lower-case strings), and the summary as `speed`."""
        values: dict[str, Any] = {
            "channels_last": self.channels_last,
            "cudnn_benchmark": self.cudnn_benchmark,
            "tf32": self.tf32,
            "compile": self.compile,
            "optimizer_impl": self.optimizer_impl,
            "activation_checkpointing": self.checkpointing,
            "heap": self.heap,
        }
        return {SPEED: self.summary(), **{k: str(v).lower() for k, v in values.items()}}
