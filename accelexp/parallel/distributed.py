"""torch.distributed's world, shared by the syncs built on it (`ddp.DDPSync`, `fsdp.FSDPSync`).

NCCL on CUDA, Gloo on CPU (`backend: auto`). The process joins the world its launcher made
(torchrun, srun, mpirun: see `world.py`); a lone process (nprocs=1) makes a world of one on a free
local port, so the same code path runs at every size. Metrics are summed, objects broadcast and
gathered with torch.distributed's collectives.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from accelexp.errors import AccelexpError
from accelexp.parallel.base import Sync
from accelexp.parallel.config import DDPConfig, FSDPConfig
from accelexp.parallel.world import World, WorldShape, current_world, free_port, slurm_master_addr

TIMEOUT = datetime.timedelta(minutes=10)


class TorchDistributed(Sync):
    """A world of processes through torch.distributed; subclasses say how replicas agree."""

    launcher = "torchrun"
    cfg: DDPConfig | FSDPConfig  # hybrid's a DDPConfig too

    def __init__(self, cfg: DDPConfig | FSDPConfig) -> None:
        super().__init__(cfg)
        self._owns_group = False
        self.world = World()

    def join(self) -> World:
        self.world = current_world()
        return self.world

    def start(self, device: torch.device, shape: WorldShape) -> None:
        super().start(device, shape)
        backend = self.cfg.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        self.backend = backend
        if dist.is_initialized():
            return
        addr, port = self._rendezvous_address(self.world.source)
        try:
            dist.init_process_group(
                backend,
                store=self._store(addr, port, shape),
                rank=shape.rank,
                world_size=shape.processes,
                timeout=TIMEOUT,
            )
        except (RuntimeError, dist.DistStoreError) as error:
            raise AccelexpError(
                f"{self.cfg.name} could not form its world of {shape.processes} at "
                f"tcp://{addr}:{port} ({error}). If the port is taken, set "
                f"parallelism.master_port to a free one (or unset MASTER_PORT)."
            ) from error
        self._owns_group = True

    def _rendezvous_address(self, source: str | None) -> tuple[str, int]:
        """torchrun sets MASTER_ADDR/PORT; under srun/mpirun rank 0's host is derived."""
        if source is None:  # a world of one
            return "127.0.0.1", free_port()
        addr = os.environ.get("MASTER_ADDR") or (
            slurm_master_addr() if source == "slurm" else "127.0.0.1"
        )
        port = os.environ.get("MASTER_PORT") or self.cfg.master_port or 29500
        return addr, int(port)

    def _store(self, addr: str, port: int, shape: WorldShape) -> dist.Store:
        """The rendezvous store, with a key prefix of its own per restart of the world.

        torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT and keeps it across the
        restarts of `--max-restarts`: without a prefix, a restarted rank can read the address a
        dead rank of the previous attempt published, and wait for it until the timeout.
        Otherwise rank 0 hosts the store.
        """
        agent_hosts = (
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("MASTER_ADDR") == addr
            and os.environ.get("MASTER_PORT") == str(port)
        )
        store = dist.TCPStore(
            addr,
            port,
            shape.processes,
            is_master=shape.rank == 0 and not agent_hosts,
            timeout=TIMEOUT,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"accelexp/attempt{attempt}", store)

    def leave(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_object(self, obj: object) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, obj: object) -> list:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
