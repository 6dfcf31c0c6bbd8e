"""A memory forecast before launch (`python run.py estimate=true …`): no training, no GPU needed.

The composed run is built as `accelexp.train` builds it — model, speed switches (activation
checkpointing included), the precision, the strategy's wrapping and sharding, the optimizer — on
the meta device, then under PyTorch's `FakeTensorMode`: tensors have shapes, dtypes and devices
and no storage, so nothing is allocated and nothing is computed. One training step
(`accelexp.step.train_step`, the loop's) runs twice on fake inputs of one worker's batch; the
second, with the optimizer's state made by the first, is followed by PyTorch's `MemTracker` (the
tool that measures the step's peak after a run, `accelexp.diagnosis.max_batch.step_memory`),
which gives the peak of live tensors per device by kind: parameters, gradients, optimizer state,
activations, temporaries. As torchtitan's `scripts/estimate` does.

- **A world of N in one process**: FSDP runs in torch's fake process group (its collectives do
  nothing) of `parallelism.nprocs` ranks, so its shards are 1/N of the whole as in the real
  world. DDP and Horovod replicate the model: a worker holds what one process holds, plus what
  its sync holds that fake tensors cannot run (`Sync.untraced_bytes`: DDP's C++ reducer keeps
  its gradient buckets, a second copy of the gradients, which the measured peak counts).
  Horovod's fusion buffer (`HOROVOD_FUSION_THRESHOLD`, 64 MiB) is outside PyTorch's allocator,
  in neither the forecast nor the measured peak. Stages (model, hybrid) are forecast on the
  devices the run would use: on a CPU they share it; on GPUs each stage's device has its line.
  A pipeline across ranks (`parallelism=pipeline`): a line per pipeline rank (each replica's
  the same), its stages' state, the activations of the micro-batches its schedule holds at
  once (its actions replayed in the order of torch's schedule, `RankStages.pipeline_plan`,
  one micro-batch each) and its receive buffers.
- **Not in the forecast**: `speed.compile` (its graphs and workspaces are compiled, not traced:
  the forecast runs eager), the allocator's cache and fragmentation on a GPU, the libraries'
  memory (CUDA context, about 0.5 GiB), and the data loader's batches in flight.
- **The largest batch** that fits `max_batch.device_mem_gb` (null: the GPU's memory; on a CPU it
  must be given): the peak is linear in the batch (state + activations × batch), so two forecasts
  give the line, and a third checks the batch it points to.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from accelexp.errors import ConfigError
from accelexp.record import STEP_PEAK_MB, step_peak_kind_mb

log = logging.getLogger(__name__)

KINDS = {  # MemTracker's kinds, as the forecast names them
    "param": "parameters",
    "grad": "gradients",
    "opt": "optimizer state",
    "act": "activations",
    "temp": "temporaries",
    "buffer": "buffers",
    "sync": "the sync's own (DDP's gradient buckets)",
    "recv": "receive buffers",
}
UNTRACED = "sync"  # what the sync holds that fake tensors cannot follow (Sync.untraced_bytes)


@dataclass(frozen=True)
class Forecast:
    """One step's peak of live tensors per device (MiB), in total and by kind."""

    batch: int  # per worker
    world_size: int  # workers
    peaks: dict[str, dict[str, float]]  # device -> {STEP_PEAK_MB or step_peak_<kind>_mb: MiB}
    notes: dict[str, str] = field(default_factory=dict)  # device -> what its line adds
    caveat: str = ""  # what the whole forecast leaves out or bounds

    @property
    def peak_mb(self) -> float:
        """The fullest device's peak."""
        return max(device[STEP_PEAK_MB] for device in self.peaks.values())


@contextlib.contextmanager
def fake_world(size: int) -> Iterator[None]:
    """This process as rank 0 of `size`, in torch's fake process group, joined as torchrun's
    world (`accelexp.parallel.world.current_world` reads the environment)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = {"RANK": "0", "WORLD_SIZE": str(size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    with mock.patch.dict(os.environ, env):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
        try:
            yield
        finally:
            dist.destroy_process_group()


def forecast(cfg: DictConfig, batch: int | None = None) -> Forecast:
    """The step's peak per device for the run `cfg` composes, at `batch` per worker (default:
    `data.batch_size`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from accelexp.config.typed import typed
    from accelexp.data.sources import set_shape
    from accelexp.diagnosis.max_batch import Trial, step_memory
    from accelexp.models import build_shapes
    from accelexp.optim import build_optimizer
    from accelexp.parallel import build_strategy
    from accelexp.parallel.base import Sync
    from accelexp.speed import SpeedSwitches

    parts = typed(cfg)  # the builders' and the strategy's typed parts
    batch = batch or parts.data.batch_size
    shape = set_shape(parts.data)
    if shape is None:
        raise ConfigError(f"data.name={cfg.data.name}: no known image shape to forecast with")
    strategy = build_strategy(parts)
    sync, shards = strategy.sync, strategy.sync.shards
    per_rank = strategy.placement.stages_across_ranks
    if not shards and not per_rank:  # replicas: a worker holds what one process holds, and
        strategy.sync = Sync(parts.parallelism)  # what its sync adds
    world_size = parts.parallelism.nprocs
    world = fake_world(world_size) if shards or per_rank else contextlib.nullcontext()
    with world:
        strategy.setup()
        try:
            # a GradScaler's state is one number, and its step reads whether a gradient
            # overflowed: a value fake tensors do not have. The step's memory is the same
            strategy.precision.scaler = None
            sample = (shape.channels, shape.image_size, shape.image_size)
            # built on the meta device (no values: an initialisation by rejection sampling, as
            # trunc_normal_'s, cannot run on fake tensors), then made fake on the run's device
            model = build_shapes(parts.model, *sample[:1], shape.num_classes, shape.image_size)
            switches = SpeedSwitches.resolve(parts.speed, strategy.device, model)
            model = switches.prepare(model)
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = model.to_empty(device=strategy.device)
                if per_rank:
                    return _pipeline(strategy, model, batch, sample, shape.num_classes, parts)
                model = strategy.wrap_model(model, input_shape=(batch, *sample))
                optimizer = strategy.wrap_optimizer(
                    build_optimizer(
                        parts.optimizer, model.parameters(), parts.optimizer.lr,
                        **switches.optimizer_kwargs(),
                    ),
                    model,
                )  # fmt: skip
                trial = Trial(
                    model, optimizer, strategy, sample, shape.num_classes,
                    switches.memory_format,
                )  # fmt: skip
                trial.step(batch)  # the optimizer's state, as in every step after the first
                optimizer.zero_grad()
                peaks = step_memory(trial, batch, per_device=True)
                extra = sync.untraced_bytes(model) / 2**20
        finally:
            strategy.teardown()
    if extra:  # on the replica's first device, held through the step
        first = peaks[strategy.device]
        first[STEP_PEAK_MB] += extra
        first[step_peak_kind_mb(UNTRACED)] = extra
    return Forecast(batch, world_size, {str(device): p for device, p in peaks.items()})


def _pipeline(strategy, model, batch: int, sample, num_classes: int, parts) -> Forecast:
    """Each pipeline rank's peak (its stages' parameters, gradients and optimizer state, the
    activations of the micro-batches its schedule holds at once, its receive buffers): the
    rank's actions replayed in the schedule's order (`PipelinePlan.replay`) on fake tensors
    under MemTracker, the second step of two; a rank of every replica holds the same."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from accelexp.diagnosis.max_batch import in_mb
    from accelexp.optim import build_optimizer
    from accelexp.speed import SpeedSwitches

    placement, device, precision = strategy.placement, strategy.device, strategy.precision
    plan = placement.pipeline_plan(model)
    micro = -(-batch // plan.microbatches)  # torch's chunks: the first are the largest
    switches = SpeedSwitches.resolve(parts.speed, device, model)
    images = torch.randn(micro, *sample, device=device)
    images = images.contiguous(memory_format=switches.memory_format)
    labels = torch.randint(num_classes, (micro,), device=device)
    shapes = plan.input_shapes(images, precision)
    peaks, notes = {}, {}
    for rank in range(plan.ranks):
        mine = torch.nn.ModuleList(plan.stages[k] for k in plan.mine(rank))
        optimizer = build_optimizer(
            parts.optimizer, mine.parameters(), parts.optimizer.lr,
            **switches.optimizer_kwargs(),
        )  # fmt: skip
        buffers = plan.recv_buffers(rank, shapes)

        def step() -> None:
            plan.replay(rank, images, labels, precision, buffers)  # noqa: B023
            placement.average_over_replicas(mine.parameters())  # noqa: B023
            optimizer.step()  # noqa: B023
            optimizer.zero_grad()  # noqa: B023

        step()  # the optimizer's state, as in every step after the first
        tracker = MemTracker()
        tracker.track_external(mine, optimizer)
        with tracker:
            step()
        found = in_mb(tracker.get_tracker_snapshot("peak")[device])
        received = sum(b.numel() * b.element_size() for b in buffers.values()) / 2**20
        found[STEP_PEAK_MB] += received
        found[step_peak_kind_mb("recv")] = received
        stages = ", ".join(str(k) for k in plan.mine(rank))
        line = f"pipeline rank {rank} (stage {stages}, {device})"
        peaks[line] = found
        mine_count = len(plan.mine(rank))
        notes[line] = (
            f"{plan.in_flight(rank)} of {mine_count * plan.microbatches} "
            f"{'stage micro-batches' if mine_count > 1 else 'micro-batches'} of {micro} in flight"
        )
    caveat = (
        ""
        if plan.derived
        else "an upper bound: this torch's schedule does not say its "
        "order, so every micro-batch is counted in flight"
    )
    if any(kind in ("I", "W") for order in plan.orders.values() for kind, _, _ in order):
        caveat = "an upper bound: a micro-batch's activations are counted until its W"
    return Forecast(batch, parts.parallelism.nprocs, peaks, notes, caveat)


def largest_batch(cfg: DictConfig, memory_mb: float, first: Forecast) -> tuple[int, Forecast]:
    """The largest batch per worker whose forecast peak fits `memory_mb`, and its forecast: the
    line through the forecasts at the run's batch and at twice it, checked at its point."""
    second = forecast(cfg, first.batch * 2)
    per_sample = (second.peak_mb - first.peak_mb) / first.batch
    fixed = first.peak_mb - per_sample * first.batch
    if per_sample <= 0:
        raise ConfigError("the forecast peak did not grow with the batch: no largest batch")
    batch = max(0, math.floor((memory_mb - fixed) / per_sample))
    while batch > 0:
        found = forecast(cfg, batch)
        if found.peak_mb <= memory_mb:
            return batch, found
        batch = math.floor(batch * memory_mb / found.peak_mb)
    return 0, first


def report(cfg: DictConfig) -> str:
    """The forecast of `cfg` as the console prints it (`estimate=true`)."""
    from accelexp.speed import SpeedSwitches

    found = forecast(cfg)
    ac = SpeedSwitches(
        activation_checkpointing=cfg.speed.activation_checkpointing,
        selective_ac_option=str(cfg.speed.selective_ac_option),
    ).checkpointing
    lines = [
        f"Memory forecast of one training step (no training, fake tensors): model="
        f"{cfg.model.name} parallelism={cfg.parallelism.name} x {found.world_size} worker(s), "
        f"batch {found.batch} per worker, precision={cfg.precision.name}, "
        f"activation checkpointing {ac}; per device, MiB:",
    ]
    for device, peaks in found.peaks.items():
        parts = [
            f"{name} {peaks[step_peak_kind_mb(kind)]:.1f}"
            for kind, name in KINDS.items()
            if peaks.get(step_peak_kind_mb(kind), 0) >= 0.05
        ]
        note = f"; {found.notes[device]}" if device in found.notes else ""
        lines.append(f"  {device}: peak {peaks[STEP_PEAK_MB]:.1f} = " + " + ".join(parts) + note)
    if found.caveat:
        lines.append(f"  The forecast is {found.caveat}.")
    memory_gb = cfg.max_batch.device_mem_gb
    if memory_gb is None and torch.cuda.is_available() and cfg.device != "cpu":
        memory_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    if memory_gb is None:
        lines.append(
            "  The largest batch: give the device's memory, e.g. max_batch.device_mem_gb=80."
        )
    else:
        batch, at = largest_batch(cfg, memory_gb * 1024, found)
        lines.append(
            f"  The largest batch per worker within {memory_gb:g} GiB: {batch} (peak "
            f"{at.peak_mb:.0f} MiB)"
        )
    if cfg.speed.compile != "off":
        lines.append("  speed.compile is left out: the forecast runs the step eager.")
    return "\n".join(lines)
