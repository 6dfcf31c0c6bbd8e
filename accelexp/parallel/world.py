"""Where this process stands: the launcher's world it joined, and the shape of the work.

`current_world()` answers "am I inside a world, and where?" for every launcher we join:

- horovodrun:        HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE
- torchrun:          RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (+ MASTER_ADDR, MASTER_PORT)
- Slurm's srun:      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE with
                     SLURM_NODEID, SLURM_STEP_NUM_NODES (+ the node list for the master)
- Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
                     OMPI_COMM_WORLD_LOCAL_SIZE

A world accelexp's own launcher made (`accelexp.launch`: torchrun or horovodrun started by
`parallelism.nprocs`) carries the job's token (`accelexp.processes.JOB_ENV`) and is sized by
`parallelism.nprocs`; any other is the user's launcher's (`World.launcher`), sized by its own
flags: `World.relaunch` writes them for a number of processes per host.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from accelexp.errors import AccelexpError, ConfigError
from accelexp.processes import JOB_ENV
from accelexp.record import DEVICES_PER_REPLICA, REPLICAS, WORLD_SIZE

if TYPE_CHECKING:  # torch is imported by the code that builds a shape, not by launchers
    import torch

_SOURCES = {
    "horovodrun": ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    "mpirun": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
}
_LOCAL_SIZES = {  # the processes on this host (Slurm's: `_slurm_tasks_here`)
    "horovodrun": "HOROVOD_LOCAL_SIZE",
    "torchrun": "LOCAL_WORLD_SIZE",
    "mpirun": "OMPI_COMM_WORLD_LOCAL_SIZE",
}


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str | None = None  # the launcher whose environment this came from
    local_size: int | None = None  # its processes on this host; None: not said (all of them)
    nodes: int | None = None  # its hosts; None: not said (as many as `per_host` makes)
    by_accelexp: bool = False  # accelexp's own launcher made it (`parallelism.nprocs`)

    @property
    def joined(self) -> bool:
        """True when a launcher started this process as one of several."""
        return self.source is not None

    @property
    def launcher(self) -> str | None:
        """The launcher the user ran to make this world, whose flags size it (a joined world
        ignores `parallelism.nprocs`); None: a world of one, or accelexp's own."""
        return None if self.by_accelexp else self.source

    @property
    def per_host(self) -> int:
        """The world's processes on this host."""
        return self.local_size or self.world_size

    @property
    def hosts(self) -> int:
        return self.nodes or math.ceil(self.world_size / self.per_host)

    def relaunch(self, per_host: int) -> str:
        """The user's launcher's own command line for this world with `per_host` processes on
        each of its hosts, e.g. `torchrun --nnodes=2 --nproc-per-node=4`."""
        hosts, total = self.hosts, self.hosts * per_host
        if self.launcher == "torchrun":
            return f"torchrun --nnodes={hosts} --nproc-per-node={per_host}"
        if self.launcher == "horovodrun":
            slots = ",".join(f"host{k + 1}:{per_host}" for k in range(hosts))
            return f"horovodrun -np {total} -H {slots if hosts > 1 else f'localhost:{per_host}'}"
        if self.launcher == "slurm":
            return f"srun --ntasks={total} --ntasks-per-node={per_host}"
        if self.launcher == "mpirun":
            return f"mpirun -np {total} --map-by ppr:{per_host}:node"
        raise ValueError(f"no launcher's flags size this world (source {self.source})")


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
    rank: int = 0  # this process's rank in the world (one replica each, but in a pipeline)
    local_rank: int = 0  # its index among the processes on this machine
    # the processes one replica spans: 1, or a pipeline's stages across ranks (`pipeline`); the
    # world is then a mesh of `ranks_per_replica` (pp, outer) x `replicas` (dp, inner)
    ranks_per_replica: int = 1

    @classmethod
    def build(
        cls,
        world: World,
        devices: Sequence[torch.device],
        shards: bool,
        ranks_per_replica: int = 1,
    ) -> WorldShape:
        """The shape of `world`, whose processes each drive one replica over `devices`, or, with
        `ranks_per_replica` > 1, each a part of one (a pipeline's stages across ranks).

        `shards`: the replicas hold shards of one model (FSDP), so each needs a device of its
        own; a process on a GPU another process of the machine also uses is refused.
        """
        if not devices:
            raise ConfigError("a replica needs at least one device")
        if world.world_size % ranks_per_replica:
            raise ConfigError(
                f"a world of {world.world_size} processes cannot be cut into replicas of "
                f"{ranks_per_replica} ranks each."
            )
        shape = cls(
            replicas=world.world_size // ranks_per_replica,
            devices_per_replica=len(set(devices)) * ranks_per_replica,
            rank=world.rank,
            local_rank=world.local_rank,
            ranks_per_replica=ranks_per_replica,
        )
        if not 0 <= shape.rank < shape.processes:
            raise AccelexpError(
                f"rank {shape.rank} is outside a world of {shape.processes} processes: the "
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
    def processes(self) -> int:
        """The world's processes: `replicas` x `ranks_per_replica`."""
        return self.replicas * self.ranks_per_replica

    @property
    def replica(self) -> int:
        """This process's replica (its data shard): its rank, but in a pipeline across ranks,
        whose ranks all see their replica's batch."""
        return self.rank % self.replicas

    @property
    def stage(self) -> int:
        """This process's place in its replica: its pipeline rank (0 where a replica is one
        process)."""
        return self.rank // self.replicas

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
            slurm = source == "slurm"
            here = _slurm_tasks_here(env) if slurm else env.get(_LOCAL_SIZES[source])
            nodes = (env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")) if slurm else None
            return World(
                int(env[rank]),
                int(env[size]),
                int(env.get(local, 0)),
                source,
                local_size=int(here) if here else None,
                nodes=int(nodes) if nodes else None,
                by_accelexp=JOB_ENV in env,
            )
    return World()


def _slurm_tasks_here(env: Mapping[str, str]) -> int | None:
    """This node's tasks, from Slurm's compressed per-node counts ("4(x2),3") and the node's
    index; None when Slurm does not say."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not text:
        return None
    counts = []
    for part in text.split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    node = int(env.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else None


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
