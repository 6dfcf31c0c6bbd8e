"""Where this process stands: the launcher's world it joined, and the shape of the work.

`current_world()` answers "am I inside a world, and where?" for every launcher we join:

- horovodrun:        HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK
- torchrun:          RANK, WORLD_SIZE, LOCAL_RANK (+ MASTER_ADDR, MASTER_PORT)
- Slurm's srun:      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (+ the node list for the master)
- Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from accelexp.errors import AccelexpError, ConfigError
from accelexp.record import DEVICES_PER_REPLICA, REPLICAS, WORLD_SIZE

if TYPE_CHECKING:  # torch is imported by the code that builds a shape, not by launchers
    import torch

_SOURCES = {
    "horovodrun": ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    "mpirun": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
}


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str | None = None  # the launcher whose environment this came from

    @property
    def joined(self) -> bool:
        """True when a launcher started this process as one of several."""
        return self.source is not None


@dataclass(frozen=True)
class WorldShape:
    """How one run's work divides, shared by the strategy, the sampler and the logging.

    `replicas` copies of the model train on different samples (data parallelism: one process
    each); each replica is split over `devices_per_replica` devices (model parallelism: the
    distinct devices its stages run on). Like torchtitan's `ParallelDims`, one object owns it,
    built and checked once by `WorldShape.build` when the strategy has joined its world.
    """

    replicas: int = 1
    devices_per_replica: int = 1
    rank: int = 0  # this process's replica
    local_rank: int = 0  # its index among the processes on this machine

    @classmethod
    def build(cls, world: World, devices: Sequence[torch.device], shards: bool) -> WorldShape:
        """The shape of `world`, whose processes each drive one replica over `devices`.

        `shards`: the replicas hold shards of one model (FSDP), so each needs a device of its
        own; a process on a GPU another process of the machine also uses is refused.
        """
        if not devices:
            raise ConfigError("a replica needs at least one device")
        shape = cls(
            replicas=world.world_size,
            devices_per_replica=len(set(devices)),
            rank=world.rank,
            local_rank=world.local_rank,
        )
        if not 0 <= shape.rank < shape.replicas:
            raise AccelexpError(
                f"rank {shape.rank} is outside a world of {shape.replicas} processes: the "
                f"launcher's environment ({world.source}) is inconsistent."
            )
        import torch

        gpus = torch.cuda.device_count() if devices[0].type == "cuda" else 0
        if shards and gpus and shape.local_rank >= gpus:
            raise ConfigError(
                f"parallelism=fsdp shards the model over one GPU per worker, but worker "
                f"{shape.local_rank} of this machine has no GPU of its own (the machine has "
                f"{gpus}). Start at most {gpus} workers per machine (parallelism.nprocs), "
                f"or use device=cpu."
            )
        return shape

    @property
    def world_size(self) -> int:
        """Devices doing the work: what per-device throughput and scaling efficiency divide by."""
        return self.replicas * self.devices_per_replica

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, tracks and saves."""
        return self.rank == 0

    def describe(self) -> dict[str, int]:
        return {
            WORLD_SIZE: self.world_size,
            REPLICAS: self.replicas,
            DEVICES_PER_REPLICA: self.devices_per_replica,
        }


def current_world(env: Mapping[str, str] = os.environ) -> World:
    """The world this process was launched into, or a world of one."""
    for source, (rank, size, local) in _SOURCES.items():
        if rank not in env or size not in env:
            continue
        # a one-task Slurm or MPI job is no world to join: accelexp may start its own workers
        if int(env[size]) > 1 or source in ("horovodrun", "torchrun"):
            return World(int(env[rank]), int(env[size]), int(env.get(local, 0)), source)
    return World()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def slurm_master_addr(env: Mapping[str, str] = os.environ) -> str:
    """The first host of the Slurm job: where rank 0 listens."""
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodes:
        return "127.0.0.1"
    try:
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=True
        ).stdout.split()
        return hosts[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodes.split(",")[0]
