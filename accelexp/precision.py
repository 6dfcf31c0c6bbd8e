"""Numeric precision of a run: fp32, fp16 AMP with a GradScaler, or bf16 — per device type.

Like Composer's `Precision`, one small object owns the autocast context and the loss scaling, so
the training loop says `with precision.autocast(): ...` and `precision.backward(loss)` and never
asks which precision it runs in. On a CPU, `amp` means bf16 autocast without a scaler (CPUs have
no fast fp16 path and bf16 needs no scaling); this is said once in the log.
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
        self.dtype: torch.dtype | None = {
            "fp32": None,
            "bf16": torch.bfloat16,
            "amp": torch.float16 if device.type == "cuda" else torch.bfloat16,
        }[name]
        self.scaler: torch.amp.GradScaler | None = None
        if self.dtype is torch.float16:
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

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass and the loss run in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (before clipping or a manual sync)."""
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
