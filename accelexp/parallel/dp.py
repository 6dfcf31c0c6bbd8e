"""`parallelism=dp`: torch.nn.DataParallel — one process scatters each batch over its GPUs.

As in the seed's ResNet-50 script. Asking for more GPUs than are present is an error; on a
CPU-only machine the plain module runs (DataParallel has nothing to split there), said once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn as nn

from accelexp.config import ConfigError
from accelexp.errors import AccelexpError
from accelexp.parallel.base import Strategy

log = logging.getLogger(__name__)


class DataParallel(Strategy):
    name = "dp"

    def setup(self) -> None:
        super().setup()
        available = torch.cuda.device_count() if self.device.type == "cuda" else 0
        wanted = list(self.cfg.devices) if self.cfg.devices is not None else list(range(available))
        missing = [d for d in wanted if d >= available]
        if self.device.type == "cuda" and missing:
            raise AccelexpError(
                f"parallelism.devices={wanted} asks for GPU(s) {missing}, but this machine has "
                f"{available} GPU(s) (ids 0..{available - 1}). Use fewer devices."
            )
        if self.device.type == "cuda":
            self.device = torch.device("cuda", wanted[0])
            torch.cuda.set_device(self.device)
        else:
            log.info("parallelism=dp on a CPU-only machine: running the plain module on the CPU")
        self.device_ids = wanted if self.device.type == "cuda" else []

    @property
    def num_devices(self) -> int:
        return max(1, len(self.device_ids))

    def wrap_model(self, model: nn.Module, input_shape: Sequence[int] | None = None) -> nn.Module:
        model = self.place(model, input_shape)
        if len(self.device_ids) > 1:
            return nn.DataParallel(model, device_ids=self.device_ids)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model

    def compile(self, model: nn.Module, mode: str) -> nn.Module:
        if isinstance(model, nn.DataParallel):
            raise ConfigError(
                f"speed.compile={mode} with parallelism=dp over {len(self.device_ids)} GPUs: "
                f"torch.compile cannot trace DataParallel's threads and runs it eagerly (the "
                f"'compiled' figures would be eager ones). Use parallelism=ddp with "
                f"parallelism.nprocs={len(self.device_ids)}, or speed.compile=off."
            )
        return super().compile(model, mode)
