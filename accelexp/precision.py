"""Numeric precision of a run: fp32, fp16 AMP with a GradScaler, or bf16 — per device type.

Like Composer's `Precision`, one small object owns the autocast context and the loss scaling, so
the training loop says `with precision.autocast(): ...` and `precision.backward(loss)` and never
asks which precision it runs in. On a CPU, `amp` means bf16 autocast without a scaler (CPUs have
no fast fp16 path and bf16 needs no scaling); this is said once in the log.

This module is the one place that maps a `precision` option and a device type to dtypes: what
the model computes in (`compute_dtype`, `effective_name`; FSDP gathers its parameters in it)
and what gradients are reduced in (`reduce_dtype`). It is built once, on the device the
strategy chose (`accelexp.parallel.connect`), and the strategy gets the object, never the name.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)


class Precision:
    def __init__(
        self,
        name: str,
        device: torch.device,
        init_scale: float = 65536.0,
        growth_interval: int = 2000,
    ) -> None:
        self.name = name
        self.device_type = device.type
        # what autocast computes in; None: fp32, no autocast
        self.compute_dtype: torch.dtype | None = {
            "fp32": None,
            "bf16": torch.bfloat16,
            "amp": torch.float16 if device.type == "cuda" else torch.bfloat16,
        }[name]
        self.scaler: torch.amp.GradScaler | None = None
        if self.compute_dtype is torch.float16:
            self.scaler = torch.amp.GradScaler(
                device.type, init_scale=init_scale, growth_interval=growth_interval
            )
        if name == "amp" and device.type != "cuda":
            log.info("precision=amp on %s: bf16 autocast without a GradScaler", device.type)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], device: torch.device) -> Precision:
        """From the `precision` config group: its name, and the GradScaler's keys where the
        option has them (`amp`)."""
        scaler = {key: cfg[key] for key in ("init_scale", "growth_interval") if key in cfg}
        return cls(cfg["name"], device, **scaler)

    @property
    def effective_name(self) -> str:
        """The option this run really computes in: `bf16` for `amp` on a CPU, else `name`."""
        return "bf16" if self.compute_dtype is torch.bfloat16 else self.name

    def reduce_dtype(self, in_fp32: bool) -> torch.dtype:
        """The dtype sharded gradients are reduced in (FSDP's `reduce_dtype`): fp32 when asked
        or when computing in fp32, else the compute dtype."""
        return torch.float32 if in_fp32 or self.compute_dtype is None else self.compute_dtype

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass and the loss run in."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale, once they are complete (after a manual
        sync such as Horovod's `optimizer.synchronize()`) and before clipping or `step`; without
        a scaler, nothing to do."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the optimizer, skipping steps with inf/nan gradients when scaling."""
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def grad_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler else None

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's `state_dict()` back into the scaler (nothing without one or it)."""
        if self.scaler and state:
            self.scaler.load_state_dict(state)
