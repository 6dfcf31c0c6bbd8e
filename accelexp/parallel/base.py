"""The one interface every way of splitting work implements, and the device it runs on.

The training loop talks to a `Strategy` only: it wraps the model and optimizer, chooses which
samples this process sees, steps the optimizer, and sums numbers across processes. A new strategy
is a new module in this folder; nothing outside it asks which strategy is running.
"""

from __future__ import annotations

import contextlib
import math
import resource
from collections.abc import Sequence

import torch
import torch.nn as nn
from omegaconf import DictConfig
from torch.utils.data import DistributedSampler, Sampler

from accelexp.diagnosis.accounting import CommTime
from accelexp.errors import AccelexpError
from accelexp.parallel.world import WorldShape
from accelexp.precision import Precision


def resolve_device(request: str, local_rank: int = 0) -> torch.device:
    """`auto`: this process's GPU when CUDA is usable, else the CPU; `cuda` without one: error."""
    if request == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if request == "cuda":
        raise AccelexpError(
            "device=cuda was asked for, but no CUDA GPU is usable here; "
            "use device=cpu or device=auto."
        )
    return torch.device("cpu")


def peak_memory_mb(device: torch.device) -> float:
    """CUDA's peak allocated memory since the last reset, or the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class ShardSampler(Sampler[int]):
    """Indices rank, rank + world, rank + 2 * world, ... of range(num_samples), in order."""

    def __init__(self, num_samples: int, world_size: int, rank: int) -> None:
        self.indices = range(rank, num_samples, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Strategy:
    """One process, one device. Subclasses override what differs for their world."""

    name = "single"
    # the launcher that starts `nprocs` workers of this strategy (accelexp.launch), or None
    launcher: str | None = None

    def __init__(self, cfg: DictConfig, device: str = "auto") -> None:
        self.cfg = cfg
        self.device_request = device
        self.shape = WorldShape()
        self.device = torch.device("cpu")  # where inputs go: the (first stage's) device

    @classmethod
    def for_config(cls, cfg: DictConfig) -> type[Strategy]:
        """The class that runs `cfg` (a strategy with several engines picks one here)."""
        return cls

    @classmethod
    def devices_per_worker(cls, cfg: DictConfig) -> int:
        """GPUs each worker process takes, for the launcher's check of what the machine has."""
        return 1

    # --- lifecycle ---------------------------------------------------------------------------
    def setup(self) -> None:
        self.place_devices()

    def place_devices(self) -> None:
        """Choose this process's device(s), once the world's shape is known."""
        self.device = resolve_device(self.device_request, self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def teardown(self) -> None:
        pass

    # --- the world's shape (see WorldShape) ---------------------------------------------------
    @property
    def rank(self) -> int:
        return self.shape.rank

    @property
    def local_rank(self) -> int:
        return self.shape.local_rank

    @property
    def replicas(self) -> int:
        """Processes training on different samples, each with a copy of the model."""
        return self.shape.replicas

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_devices(self) -> int:
        """Devices doing the work (the per-device throughput divides by this)."""
        return self.shape.world_size

    @property
    def accumulate_steps(self) -> int:
        return self.cfg.accumulate_steps

    def describe(self) -> dict[str, int | str]:
        """Facts about the world that are logged with the run."""
        return {
            **self.shape.describe(),
            "num_devices": self.num_devices,
            "device_type": self.device.type,
        }

    # --- memory ------------------------------------------------------------------------------
    def reset_memory_stats(self) -> None:
        """Start a new peak (called at each epoch's start)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory_metrics(self) -> dict[str, float]:
        """Peak memory since the last reset, logged each epoch."""
        return {"peak_mem_mb": peak_memory_mb(self.device)}

    # --- model and optimizer ----------------------------------------------------------------
    def place(self, model: nn.Module, input_shape: Sequence[int] | None = None) -> nn.Module:
        """Put the model on this process's device(s); `input_shape` is one batch's shape."""
        return model.to(self.device)

    def wrap_model(self, model: nn.Module, input_shape: Sequence[int] | None = None) -> nn.Module:
        return self.place(model, input_shape)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module, e.g. for saving a checkpoint that loads anywhere."""
        return model

    def compile(self, model: nn.Module, mode: str) -> nn.Module:
        """`torch.compile` the wrapped model in place (state dict names unchanged).

        The whole wrapped module: under DDP that lets the compiler split the graph at DDP's
        buckets, so gradient allreduce still overlaps the backward pass.
        """
        model.compile(mode=mode)
        return model

    def scale_lr(self, lr: float) -> float:
        """`parallelism.lr_scaling` with the number of samples per optimizer step."""
        factor = self.replicas * self.accumulate_steps
        return lr * {"linear": factor, "sqrt": math.sqrt(factor), "none": 1}[self.cfg.lr_scaling]

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module
    ) -> torch.optim.Optimizer:
        return optimizer

    def optimizer_step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        precision.step(optimizer)

    def backward_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Where a backward pass runs; `sync=False` for the micro-batches that only accumulate."""
        return contextlib.nullcontext()

    # --- data --------------------------------------------------------------------------------
    def train_sampler(self, num_samples: int, seed: int) -> Sampler[int]:
        """A shuffled shard per rank, reshuffled by `set_epoch`.

        Every strategy, one process included, draws from the same seeded permutation, so a run
        on N workers with batch B sees, step by step, the same samples as one process with
        batch N*B: the property the data-parallel correctness tests check.
        """
        return DistributedSampler(
            range(num_samples),
            num_replicas=self.replicas,
            rank=self.rank,
            shuffle=True,
            seed=seed,
        )

    def eval_sampler(self, num_samples: int) -> Sampler[int]:
        """This rank's share of an evaluation set: each sample once over all ranks, no padding."""
        return ShardSampler(num_samples, self.replicas, self.rank)

    # --- communication time (accelexp.diagnosis.accounting) -----------------------------------
    def take_comm_time(self) -> CommTime | None:
        """The communication this strategy timed since the last call; None: it does none."""
        return None

    def comm_advice(self) -> list[tuple[str, str]]:
        """Overrides that cut this strategy's communication, each with why (for a verdict)."""
        return []

    # --- collectives -------------------------------------------------------------------------
    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: object) -> object:
        """Rank 0's `obj` on every rank (a checkpoint read on rank 0's disk only)."""
        return obj

    def gather_object(self, obj: object) -> list:
        """Every rank's `obj`, in rank order (e.g. the ranks' RNG states for a checkpoint)."""
        return [obj]
