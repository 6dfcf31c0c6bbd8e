"""`parallelism=hybrid`: model parallel inside each replica, data parallel across replicas.

Each worker process holds one replica of the model cut into stages over `devices_per_replica`
devices (its own GPUs: local rank r takes GPUs r*D .. r*D+D-1; on a CPU every stage is on the
CPU). The replicas stay in sync through the `engine`: DDP over the multi-device module
(`device_ids=None`, as PyTorch's DDP + model-parallel recipe does), or Horovod's
DistributedOptimizer (Horovod's layout for model parallelism: each worker has several GPUs and
submits the same tensors as the others; NCCL rings are formed over each tensor's GPUs). They are
started like the data-parallel strategies: `nprocs` replicas by torchrun or horovodrun, or joining
a world a launcher made.

The world's shape (`WorldShape`: replicas x devices per replica) is what the sampler shards
over (replicas), what the lr scales with, and what is logged (`world_size`, `replicas`,
`devices_per_replica`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from omegaconf import DictConfig

from accelexp.config import ConfigError
from accelexp.parallel.base import Strategy, resolve_device
from accelexp.parallel.ddp import DDP
from accelexp.parallel.horovod import Horovod
from accelexp.parallel.model import SplitModel


class ReplicaStages(SplitModel):
    """A replica's stages over this worker's own `devices_per_replica` devices."""

    @classmethod
    def devices_per_worker(cls, cfg: DictConfig) -> int:
        return cfg.devices_per_replica

    def stage_devices(self) -> list[torch.device]:
        per_replica = self.cfg.devices_per_replica
        stages = self.cfg.stages or per_replica
        if resolve_device(self.device_request).type == "cpu":
            return [torch.device("cpu")] * stages
        first, gpus = self.local_rank * per_replica, torch.cuda.device_count()
        if first + per_replica > gpus:
            raise ConfigError(
                f"replica {self.local_rank} on this machine needs GPUs {first}..."
                f"{first + per_replica - 1} (parallelism.devices_per_replica={per_replica}), but "
                f"the machine has {gpus}. Start at most {gpus // per_replica} replicas per machine "
                f"(parallelism.nprocs), or lower parallelism.devices_per_replica."
            )
        return [torch.device("cuda", first + k % per_replica) for k in range(stages)]


class HybridDDP(ReplicaStages, DDP):
    name = "hybrid"


class HybridHorovod(ReplicaStages, Horovod):
    name = "hybrid"


class Hybrid(Strategy):
    """Chooses the engine: `parallelism.engine` ddp or horovod."""

    name = "hybrid"
    ENGINES: ClassVar[dict[str, type[Strategy]]] = {"ddp": HybridDDP, "horovod": HybridHorovod}

    @classmethod
    def for_config(cls, cfg: DictConfig) -> type[Strategy]:
        if cfg.engine not in cls.ENGINES:
            raise ConfigError(
                f"parallelism.engine={cfg.engine!r} is unknown: expected one of "
                f"{', '.join(cls.ENGINES)}."
            )
        return cls.ENGINES[cfg.engine]
