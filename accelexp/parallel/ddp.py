"""`parallelism=ddp`: torch.distributed DistributedDataParallel, one process per device.

NCCL on CUDA, Gloo on CPU (`backend: auto`). The process joins the world its launcher made
(torchrun, srun, mpirun: see `world.py`); a lone process (nprocs=1) makes a world of one on a free
local port, so the same code path runs at every size. Options: SyncBatchNorm, bucket size, static
graph, gradient compression through DDP's comm hooks (fp16/bf16), and gradient accumulation with
`no_sync` on the micro-batches that only accumulate.

Communication time (on a CPU, Gloo): a comm hook around the allreduce (`TimedAllreduce`) notes when
each gradient bucket was handed to Gloo and when its allreduce finished. Per step, the union of
those intervals is the time communication was in flight, and the time from the last bucket's
hand-over (the backward's compute is done) to the last allreduce's end is what the host waited
for in the backward pass. On CUDA, NCCL's futures complete at enqueue time, so host clocks cannot
time them: DDP keeps its built-in hooks there, and `profile=true` (HTA) gives the GPU's figures.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel

from accelexp.diagnosis.accounting import CommTime
from accelexp.errors import AccelexpError
from accelexp.parallel.base import Strategy
from accelexp.parallel.world import WorldShape, current_world, free_port, slurm_master_addr

TIMEOUT = datetime.timedelta(minutes=10)


class TimedAllreduce:
    """A DDP comm hook that runs `hook` (DDP's allreduce, or a compressing one) and times it."""

    def __init__(self, hook) -> None:
        self.hook = hook
        self.comm = CommTime()
        self.buckets: list[tuple[float, list[float]]] = []  # (handed over, [finished]) per bucket

    def as_hook(self):
        """A function for `register_comm_hook`, which reads a hook's name and signature."""
        return functools.wraps(self.hook)(lambda state, bucket: self(state, bucket))

    def __call__(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        finished: list[float] = []
        self.buckets.append((time.perf_counter(), finished))

        def done(future: torch.futures.Future) -> torch.Tensor:
            finished.append(time.perf_counter())  # on the thread that completed the allreduce
            return future.value()

        return self.hook(state, bucket).then(done)

    def step_done(self) -> None:
        """After a synchronising backward pass: its buckets' times go into `comm`."""
        intervals = sorted((start, end[0]) for start, end in self.buckets if end)
        self.buckets.clear()
        if not intervals:
            return
        last_handed_over = max(start for start, _ in intervals)
        self.comm.wait("backward", max(0.0, max(end for _, end in intervals) - last_handed_over))
        inflight, reach = 0.0, float("-inf")  # the union of the intervals
        for start, end in intervals:
            inflight += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        self.comm.in_flight(inflight)


class DDP(Strategy):
    name = "ddp"
    launcher = "torchrun"

    def __init__(self, cfg: DictConfig, device: str = "auto") -> None:
        super().__init__(cfg, device)
        self._owns_group = False
        self._timed: TimedAllreduce | None = None

    def setup(self) -> None:
        world = current_world()
        self.shape = WorldShape(
            replicas=world.world_size, rank=world.rank, local_rank=world.local_rank
        )
        self.place_devices()
        backend = self.cfg.backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            addr, port = self._rendezvous_address(world.source)
            try:
                dist.init_process_group(
                    backend,
                    store=self._store(addr, port),
                    rank=self.rank,
                    world_size=self.replicas,
                    timeout=TIMEOUT,
                )
            except (RuntimeError, dist.DistStoreError) as error:
                raise AccelexpError(
                    f"DDP could not form its world of {self.replicas} at tcp://{addr}:{port} "
                    f"({error}). If the port is taken, set parallelism.master_port to a free one "
                    f"(or unset MASTER_PORT)."
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

    def _store(self, addr: str, port: int) -> dist.Store:
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
            self.replicas,
            is_master=self.rank == 0 and not agent_hosts,
            timeout=TIMEOUT,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"accelexp/attempt{attempt}", store)

    def teardown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def wrap_model(self, model: nn.Module, input_shape: Sequence[int] | None = None) -> nn.Module:
        if self.cfg.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = self.place(model, input_shape)
        devices = {p.device for p in model.parameters()}
        ddp = DistributedDataParallel(
            model,
            # one GPU: its id; a CPU module or one spread over several devices: None
            device_ids=[self.device.index]
            if devices == {self.device} and self.device.type == "cuda"
            else None,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            static_graph=self.cfg.static_graph,
            find_unused_parameters=self.cfg.find_unused_parameters,
        )
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {
            "none": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
        }[self.cfg.comm_hook]
        if self.device.type == "cpu":
            self._timed = TimedAllreduce(hook)
            hook = self._timed.as_hook()
        if hook is not default_hooks.allreduce_hook:  # that one is DDP's own, built in
            ddp.register_comm_hook(state=None, hook=hook)
        return ddp

    def comm_advice(self) -> list[tuple[str, str]]:
        return [
            ("parallelism.comm_hook=fp16", "gradients sent as fp16: half the bytes to allreduce"),
            (
                f"parallelism.bucket_cap_mb={self.cfg.bucket_cap_mb / 4:g}",
                "smaller buckets start their allreduce earlier in the backward pass",
            ),
        ]

    def take_comm_time(self) -> CommTime | None:
        if self._timed is None:
            return None
        comm, self._timed.comm = self._timed.comm, CommTime()
        return comm

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    @contextlib.contextmanager
    def backward_context(self, model: nn.Module, sync: bool):
        if not sync:
            with model.no_sync():
                yield
            return
        yield
        if self._timed is not None:
            self._timed.step_done()

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
