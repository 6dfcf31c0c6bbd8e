"""The one interface the training loop talks to, composed of two independent choices.

A `Strategy` is a `Placement` × a `Sync`:

- the `Placement` says where one replica's layers live: one device (`Placement` itself),
  torch.nn.DataParallel over a process's GPUs (`dp.DataParallelPlacement`), or stages over
  several devices (`model.Stages`);
- the `Sync` says how replicas agree: not at all, there is one (`Sync` itself), DDP's gradient
  allreduce (`ddp.DDPSync`), FSDP's sharded parameters (`fsdp.FSDPSync`) or Horovod's
  DistributedOptimizer (`horovod.HorovodSync`).

`accelexp.parallel.STRATEGIES` names the presets (`hybrid` is stages × DDP or Horovod). The
`Strategy` joins the world through its sync, lets its placement choose the devices, and builds
the world's shape once (`WorldShape.build`). The loop wraps the model and optimizer and steps
through it, reads the world's facts from its `shape` and sums numbers across processes through
its `sync`, and never asks which strategy is running.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import resource
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, Sampler

from accelexp import record
from accelexp.advice import Advice, command
from accelexp.errors import AccelexpError
from accelexp.machine import Machine
from accelexp.parallel.config import ParallelismConfig
from accelexp.parallel.world import World, WorldShape
from accelexp.precision.runtime import Precision
from accelexp.schema import PrecisionConfig
from accelexp.timing import BACKWARD, FORWARD, CommTime


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


def held_bytes(tensor: torch.Tensor) -> int:
    """The bytes this process stores for `tensor`: a sharded (DTensor) one's local shard only."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(
    params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Parameters, their gradients and their optimizer state as this process holds them at the
    step's peak (each gradient the size of its parameter, whether or not it is set just now)."""
    state = optimizer.state if optimizer is not None else {}
    tensors = [
        *params,
        *(p for p in params if p.requires_grad),
        *(v for p in params for v in state.get(p, {}).values() if torch.is_tensor(v)),
    ]
    return sum(held_bytes(t) for t in tensors)


class ShardSampler(Sampler[int]):
    """Indices rank, rank + world, rank + 2 * world, ... of range(num_samples), in order."""

    def __init__(self, num_samples: int, world_size: int, rank: int) -> None:
        self.indices = range(rank, num_samples, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def to_device(module: nn.Module, device: torch.device) -> nn.Module:
    """`module.to(device)`, unless all of it is there already: a no-op for real tensors, and the
    one way for the fake ones of a memory forecast (`accelexp.forecast`), which `Module.to`
    cannot swap with themselves."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    return module if all(t.device == device for t in tensors) else module.to(device)


class Placement:
    """Where one replica's layers live; this base: all of them on one device."""

    name = "one device"
    # a pipeline whose stages are spread over the ranks: the memory forecast (`accelexp.forecast`)
    # models each rank from its `pipeline_plan`, not one process's replica
    stages_across_ranks = False
    # the preset whose synced replicas of this placement put more devices to work (the
    # scale-out advice to a run of one process)
    replicated_as = "ddp"

    def __init__(self, cfg: ParallelismConfig, device_request: str = "auto") -> None:
        self.cfg = cfg
        self.device_request = device_request
        self.devices = [torch.device("cpu")]

    @classmethod
    def devices_per_worker(cls, cfg: ParallelismConfig) -> int:
        """GPUs each worker process takes, for the launcher's check of what the machine has."""
        return 1

    @classmethod
    def label(cls, cfg: ParallelismConfig) -> dict[str, str]:
        """What a run's name shows of this placement, by the key that sets each part (`cfg`
        typed, or a sweep's DictConfig: read by attribute)."""
        return {}

    def choose_devices(self, local_rank: int) -> list[torch.device]:
        """The replica's devices (the first holds the inputs, labels and outputs)."""
        self.devices = [resolve_device(self.device_request, local_rank)]
        return self.devices

    def ranks_per_replica(self, world: World) -> int:
        """The processes of `world` one replica spans (`WorldShape.ranks_per_replica`)."""
        return 1

    def start(self, shape: WorldShape) -> None:
        """Once the world is joined and its communication open: what the placement needs of it."""

    def forward_backward(
        self,
        strategy: Strategy,
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        accumulate: int,
        sync: bool,
        clock,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch's forward pass, loss and backward pass (`accelexp.step.train_step`'s):
        (loss, logits), neither detached; this base: the model called on the batch under the
        precision's autocast, the loss in fp32, its backward with loss scaling inside the
        sync's backward context."""
        precision = strategy.precision
        with strategy.backward_context(model, sync=sync):
            with precision.autocast():
                logits = model(precision.cast_inputs(images))
                loss = F.cross_entropy(logits.float(), labels)
            clock.mark(FORWARD)
            precision.backward(loss / accumulate if accumulate > 1 else loss)
        clock.mark(BACKWARD)
        return loss, logits

    def whole_state(self, state: dict, sync: Sync) -> dict:
        """The whole model's (or optimizer's) state from this process's `state` (collective);
        this base: a replica holds all of it."""
        return state

    def own_state(self, state: dict | None) -> dict | None:
        """This process's part of a whole model's (or optimizer's) `state`."""
        return state

    def place(self, model: nn.Module, input_shape: Sequence[int] | None = None) -> nn.Module:
        """Put the model on the replica's device(s); `input_shape` is one batch's shape."""
        return to_device(model, self.devices[0])

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def compile(self, model: nn.Module, mode: str) -> nn.Module:
        """`torch.compile` the wrapped model in place (state dict names unchanged).

        The whole wrapped module: under DDP that lets the compiler split the graph at DDP's
        buckets, so gradient allreduce still overlaps the backward pass.
        """
        model.compile(mode=mode)
        return model

    def describe(self) -> dict[str, int | str]:
        return {}

    def reset_memory_stats(self) -> None:
        for device in set(self.devices):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

    def memory_metrics(self, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
        """Peak memory since the last reset (the busiest device's, on CUDA)."""
        return {record.PEAK_MEM_MB: max(peak_memory_mb(device) for device in set(self.devices))}


class Sync:
    """How replicas agree; this base: they need not, there is one, in this process."""

    name = "none"
    launcher: str | None = None  # what starts `nprocs` workers (accelexp.launch), or None
    shards = False  # True: each replica holds a shard of the model, not a copy

    def __init__(self, cfg: ParallelismConfig) -> None:
        self.cfg = cfg
        self.device = torch.device("cpu")  # the replica's (first) device, once `start` has it

    @classmethod
    def label(cls, cfg: ParallelismConfig) -> dict[str, str]:
        """What a run's name shows of this sync, by the key that sets each part."""
        return {}

    # --- lifecycle ---------------------------------------------------------------------------
    def join(self) -> World:
        """Join (or make) the world of processes; its rank and size."""
        return World()

    def start(self, device: torch.device, shape: WorldShape) -> None:
        """Open the communication between the processes, once their devices are chosen; `device`,
        the replica's (first), is the one `wrap` wraps the model for. Overrides call this."""
        self.device = device

    def leave(self) -> None:
        pass

    def untraced_bytes(self, model: nn.Module) -> int:
        """Memory this sync holds on the device in a step that a memory forecast cannot follow
        in fake tensors (`accelexp.forecast`); this base: none."""
        return 0

    # --- model and optimizer ----------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        """The model as built, before it is placed (e.g. BatchNorm made synchronous)."""
        return model

    # True: `wrap` compiles the model itself (FSDP: each unit before it is sharded); otherwise
    # the placement compiles the wrapped model
    compiles_units = False

    def wrap(
        self, model: nn.Module, precision: Precision, compile_mode: str | None = None
    ) -> nn.Module:
        """The placed model (its first device: `self.device`), wrapped so replicas agree
        (`precision`: the run's, e.g. the dtypes FSDP gathers and reduces in; `compile_mode`: for
        a sync that `compiles_units`)."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's weights, on the main rank (collective: every rank calls it)."""
        return model.state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict | None) -> None:
        """Load the main rank's whole-model `state` (collective: every rank calls it)."""
        model.load_state_dict(state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The whole optimizer's state, on the main rank (collective: every rank calls it)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict | None
    ) -> None:
        """Load the main rank's whole optimizer `state` (collective: every rank calls it)."""
        optimizer.load_state_dict(state)

    # True: the training state is saved sharded, every rank writing its part in parallel
    # (`sharded_state_dict` through torch.distributed.checkpoint: `accelexp.checkpoint`), not
    # gathered to the main rank; it resumes on any number of ranks
    checkpoint_sharded = False

    def sharded_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The model's and optimizer's states as this rank holds them (DTensor shards under
        FSDP), by parameter name, for torch.distributed.checkpoint (collective)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_sharded_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """Load a `sharded_state_dict` that torch.distributed.checkpoint filled (collective)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )

    def lr_factor(self, samples_factor: int, rule: str) -> float:
        """The lr multiplier for `samples_factor` times the samples per step."""
        return {"linear": samples_factor, "sqrt": math.sqrt(samples_factor), "none": 1}[rule]

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, accumulate_steps: int
    ) -> torch.optim.Optimizer:
        return optimizer

    def optimizer_step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        precision.step(optimizer)

    def backward_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Where a backward pass runs; `sync=False` for the micro-batches that only accumulate."""
        return contextlib.nullcontext()

    def describe(self) -> dict[str, int | str]:
        return {}

    # --- communication time (accelexp.timing) -----------------------------------------------
    def take_comm_time(self) -> CommTime | None:
        """The communication this sync timed since the last call; None: it does none."""
        return None

    def comm_advice(self) -> list[tuple[str, str]]:
        """Overrides that cut this sync's communication, each with why (for a verdict)."""
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


class Strategy:
    """A placement × a sync, as the training loop sees it, and the run's `precision` (the
    `precision` config group's option, fp32 when none is given). `cfg`: the typed `parallelism`
    part (its preset's dataclass). `Strategy(ParallelismConfig())`: one device, alone, in
    fp32."""

    name = "single"

    def __init__(
        self,
        cfg: ParallelismConfig,
        device: str = "auto",
        placement: Placement | None = None,
        sync: Sync | None = None,
        precision: PrecisionConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self._precision_cfg = precision or PrecisionConfig()
        self.placement = placement or Placement(cfg, device)
        self.sync = sync or Sync(cfg)
        self.name = cfg.name
        self.world = World()  # the world `setup` joined
        self.shape = WorldShape()
        self.device = torch.device("cpu")  # where inputs go: the (first stage's) device
        self.optimizer: torch.optim.Optimizer | None = None
        self.model: nn.Module | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Join the world, choose the devices, build the world's shape, open communication."""
        self.world = world = self.sync.join()
        devices = self.placement.choose_devices(world.local_rank)
        self.shape = WorldShape.build(
            world, devices, self.sync.shards, self.placement.ranks_per_replica(world)
        )
        self.device = devices[0]
        self.__dict__.pop("precision", None)  # built again on the device chosen
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.sync.start(self.device, self.shape)
        self.placement.start(self.shape)

    @functools.cached_property
    def precision(self) -> Precision:
        """The run's precision, built once on the device `setup` chose (the CPU before it): the
        strategy owns it, as Lightning Fabric's strategy owns its precision plugin, and hands it
        to its parts (the model's wrap, the optimizer step); the loop reads it here."""
        return Precision.from_config(self._precision_cfg, self.device)

    def teardown(self) -> None:
        self.sync.leave()

    # --- what the loop asks of it (the world's facts: `shape`; collectives: `sync`) -----------
    @property
    def accumulate_steps(self) -> int:
        return self.cfg.accumulate_steps

    @property
    def pipeline(self):
        """The stages of a model split over devices (`model.Stages`), else None."""
        return getattr(self.placement, "pipeline", None)

    def describe(self) -> dict[str, int | str]:
        """Facts about the world that are logged with the run."""
        return {
            **self.shape.describe(),
            record.NUM_DEVICES: self.shape.world_size,
            record.DEVICE_TYPE: self.device.type,
            **self.placement.describe(),
            **self.sync.describe(),
        }

    def tags(self) -> dict[str, str]:
        """The two parts of the strategy, as tags to filter runs by (all DDP-synced runs, ddp's
        and hybrid's: `tags.sync = 'ddp'`)."""
        return {record.PLACEMENT: self.placement.name, record.SYNC: self.sync.name}

    # --- memory (a new peak at each epoch's start: `placement.reset_memory_stats`) ----------
    def memory_metrics(self) -> dict[str, float]:
        """Peak memory since the last reset, and what the model's state holds on this process:
        `state_mem_mb`, its parameters, gradients and optimizer state (a shard's, under FSDP)."""
        metrics = self.placement.memory_metrics(self.optimizer)
        if self.model is not None:
            params = list(self.unwrap(self.model).parameters())
            metrics[record.STATE_MEM_MB] = state_bytes(params, self.optimizer) / 2**20
        return metrics

    # --- model and optimizer ----------------------------------------------------------------
    def wrap_model(
        self,
        model: nn.Module,
        input_shape: Sequence[int] | None = None,
        compile_mode: str | None = None,
    ) -> nn.Module:
        """The model made ready for the strategy's `precision` (`Precision.prepare_model`:
        bf16_true's converted to bf16, fp8's linear layers to float8), placed, wrapped and, with
        a `compile_mode`, compiled (`torch.compile`)."""
        model = self.precision.prepare_model(model)
        placed = self.placement.place(self.sync.prepare(model), input_shape)
        self.model = self.sync.wrap(placed, self.precision, compile_mode)
        if compile_mode and not self.sync.compiles_units:
            self.model = self.placement.compile(self.model, compile_mode)
        return self.model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module, e.g. for saving a checkpoint that loads anywhere."""
        return self.placement.unwrap(self.sync.unwrap(model))

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on the main rank, None elsewhere; every rank calls it."""
        state = self.sync.model_state_dict(self.unwrap(model))
        state = self.placement.whole_state(state, self.sync)
        return state if self.shape.is_main else None

    def load_model_state_dict(self, model: nn.Module, state: dict | None) -> None:
        """The main rank's whole-model weights into every rank's model; every rank calls it."""
        self.sync.load_model_state_dict(self.unwrap(model), self.placement.own_state(state))

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict | None:
        """The whole optimizer's state on the main rank, None elsewhere; every rank calls it."""
        state = self.sync.optimizer_state_dict(self.unwrap(model), optimizer)
        state = self.placement.whole_state(state, self.sync)
        return state if self.shape.is_main else None

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict | None
    ) -> None:
        """The main rank's optimizer state into every rank's optimizer; every rank calls it."""
        self.sync.load_optimizer_state_dict(
            self.unwrap(model), optimizer, self.placement.own_state(state)
        )

    @property
    def checkpoint_sharded(self) -> bool:
        """True: every rank saves and loads its part of the training state (the sync's
        `sharded_state_dict`), none is gathered; False: the main rank's whole state."""
        return self.sync.checkpoint_sharded

    def sharded_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's part of the model's and optimizer's states; every rank calls it."""
        return self.sync.sharded_state_dict(self.unwrap(model), optimizer)

    def load_sharded_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """A filled `sharded_state_dict` into this rank's model and optimizer; every rank."""
        self.sync.load_sharded_state_dict(self.unwrap(model), optimizer, state)

    def scale_lr(self, lr: float) -> float:
        """`parallelism.lr_scaling` with the number of samples per optimizer step."""
        factor = self.shape.replicas * self.accumulate_steps
        return lr * self.sync.lr_factor(factor, self.cfg.lr_scaling)

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module
    ) -> torch.optim.Optimizer:
        self.optimizer = self.sync.wrap_optimizer(optimizer, model, self.accumulate_steps)
        return self.optimizer

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step through the sync, with the precision's loss scaling."""
        self.sync.optimizer_step(optimizer, self.precision)

    def backward_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Where a backward pass runs; `sync=False` for the micro-batches that only accumulate."""
        return self.sync.backward_context(model, sync)

    def forward_backward(
        self,
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        accumulate: int = 1,
        sync: bool = True,
        clock=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch's forward, loss and backward: (loss, logits) the same on every rank of a
        replica. The placement's: the model called in this process, or a pipeline schedule
        across ranks (`stages_per_rank`), which runs both passes itself. `clock` is told where
        the forward and backward phases end (`accelexp.step.PhaseMarks`)."""
        return self.placement.forward_backward(self, model, images, labels, accumulate, sync, clock)

    # --- data --------------------------------------------------------------------------------
    def train_sampler(self, num_samples: int, seed: int) -> Sampler[int]:
        """A shuffled shard per rank, reshuffled by `set_epoch`.

        Every strategy, one process included, draws from the same seeded permutation, so a run
        on N workers with batch B sees, step by step, the same samples as one process with
        batch N*B: the property the data-parallel correctness tests check.
        """
        return DistributedSampler(
            range(num_samples),
            num_replicas=self.shape.replicas,
            rank=self.shape.replica,
            shuffle=True,
            seed=seed,
        )

    def eval_sampler(self, num_samples: int) -> Sampler[int]:
        """This rank's share of an evaluation set: each sample once over all ranks, no padding."""
        return ShardSampler(num_samples, self.shape.replicas, self.shape.replica)

    # --- advice (a verdict's; what cuts communication: `sync.comm_advice`) -------------------
    def scale_out_advice(self, machine: Machine) -> Advice | None:
        """More workers where `machine` had idle devices (`Machine.room`: idle cores on a CPU,
        unused visible GPUs), with why (for a verdict); None where it had none. In a world the
        user's launcher made, that launcher's flags (a command: `accelexp.advice`); else
        `parallelism.nprocs`, with the preset that syncs replicas of this placement for a run of
        one process; on a CPU with each worker's `threads`."""
        room = machine.room(self.world.per_host, self.shape.devices_per_replica)
        if room is None:
            return None
        threads = f" threads={room.threads}" if room.threads else ""
        if self.world.launcher:
            return command(f"{self.world.relaunch(room.workers)} …{threads}", room.why)
        preset = f"parallelism={self.placement.replicated_as} " if self.sync.name == "none" else ""
        return f"{preset}parallelism.nprocs={room.workers}{threads}", room.why
