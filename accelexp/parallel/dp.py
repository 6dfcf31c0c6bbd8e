"""`parallelism=dp`: torch.nn.DataParallel — one process scatters each batch over its GPUs.

A placement (where one replica's layers live: copies on each of this process's GPUs, one batch
split between them), with no sync between processes. As in the seed's ResNet-50 script.
Asking for more GPUs than are present is an error; on a CPU-only machine the plain module runs
(DataParallel has nothing to split there), said once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn as nn

from accelexp.errors import AccelexpError, ConfigError
from accelexp.parallel.base import Placement, resolve_device
from accelexp.parallel.config import DataParallelConfig

log = logging.getLogger(__name__)


class DataParallelPlacement(Placement):
    cfg: DataParallelConfig
    name = "dataparallel"

    def choose_devices(self, local_rank: int) -> list[torch.device]:
        first = resolve_device(self.device_request, local_rank)
        if first.type != "cuda":
            log.info("parallelism=dp on a CPU-only machine: running the plain module on the CPU")
            self.device_ids: list[int] = []
            self.devices = [first]
            return self.devices
        available = torch.cuda.device_count()
        wanted = list(self.cfg.devices) if self.cfg.devices is not None else list(range(available))
        missing = [d for d in wanted if d >= available]
        if missing:
            raise AccelexpError(
                f"parallelism.devices={wanted} asks for GPU(s) {missing}, but this machine has "
                f"{available} GPU(s) (ids 0..{available - 1}). Use fewer devices."
            )
        self.device_ids = wanted
        self.devices = [torch.device("cuda", d) for d in wanted]
        return self.devices

    def place(self, model: nn.Module, input_shape: Sequence[int] | None = None) -> nn.Module:
        model = model.to(self.devices[0])
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
