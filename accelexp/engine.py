"""The training loop: epochs of train and evaluate, knowing only the component interfaces.

`Trainer` sees a `Strategy` (where the work runs, how ranks agree) with its `Precision` (autocast
and loss scaling) and a plain optimizer and scheduler. Per-step work is one training step
(`accelexp.step.train_step`: forward, backward, optimizer and scheduler step) and two on-device
additions for the epoch's loss and accuracy; the host reads numbers back only for the progress
bar (at steps 1, 2, 4, ... then every `log_every` steps: `figures_due`; a bar on a terminal, a
plain line at most every `LINE_EVERY_S` seconds when the output is piped, e.g. a Slurm log, so no
`\r` frames land in it), and at the end of the epoch, once, summed over all ranks.

The first epoch a `Trainer` trains starts with warm-up steps that are left out of the epoch's
timing, so that even a one-epoch run's `samples_per_s` is steady-state (`timed_steps` says over
how many steps it was measured); their loss and accuracy still count. With a compiled model they
are the steps that compile it (`compile_steps`), timed apart as `EpochResult.compile_seconds`;
an eager model leaves out `eager_warmup_steps` of them: the first steps pay once for the CUDA
context and cuBLAS/cuDNN handles, cuDNN's autotuning of each shape, the caching allocator growing
its pool, DDP's bucket rebuild after the first iteration and the communicator's first collective —
all done within two or three steps, five leave a margin; a quarter of the epoch at most, so a
short epoch keeps three quarters of its steps timed.

Every step tells a `StepClock` where its phases end (input, forward, backward, optimizer, the
loop's bookkeeping): `EpochResult.breakdown` is where the timed steps' time went, averaged over
ranks (`accelexp.timing`); the times between step ends (`EpochResult.step_seconds`)
give the throughput's interval (`throughput`, batch means). Over the same timed steps a
`ContentionProbe` samples what shows a shared machine (`EpochResult.noise`, the worst rank's;
`accelexp.diagnosis.noise`). A `profiler` (`profile=true`) is stepped after each step.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from accelexp import stats
from accelexp.data import BatchLoader
from accelexp.diagnosis.noise import ContentionProbe, NoiseSample, judge
from accelexp.errors import AccelexpError
from accelexp.lockstep.gate import Gate, NoGate
from accelexp.parallel.base import Strategy
from accelexp.precision.runtime import Precision
from accelexp.stats import Estimate
from accelexp.step import train_step
from accelexp.timing import INPUT, OTHER, Breakdown, StepClock

log = logging.getLogger(__name__)
LINE_EVERY_S = 10.0  # the least time between two progress lines of piped output
EAGER_WARMUP_STEPS = 5  # untimed steps of an eager model's first epoch, at most (module doc)


@dataclass
class EpochResult:
    loss: float
    accuracy: float
    samples: int  # timed samples (all but the warm-up steps'), over all ranks
    seconds: float  # the timed steps', slowest rank
    timed_steps: int  # the steps `samples` and `seconds` count (all but the warm-up steps)
    compile_seconds: float | None = None  # the compile warm-up steps, slowest rank
    breakdown: Breakdown = field(default_factory=Breakdown)  # the timed steps, mean over ranks
    step_seconds: list[float] = field(default_factory=list)  # each timed step's, this rank's
    noise: NoiseSample | None = None  # what shows a shared machine, worst over ranks

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


def throughput(epochs: Sequence[EpochResult]) -> Estimate:
    """Samples/s over the timed steps of `epochs` (their samples over their seconds, as the
    slowest rank measured them with the device synchronised), with the relative 95 % interval
    of the batch means of their step times (`accelexp.stats.rate`): consecutive steps are
    correlated (a neighbour's burst, a clock change slows several), so steps are not independent
    observations, batches of them nearly are."""
    samples = sum(e.samples for e in epochs)
    seconds = sum(e.seconds for e in epochs)
    steps = [s for e in epochs for s in e.step_seconds]
    measured = samples / seconds if seconds > 0 else math.nan
    if not steps or sum(steps) <= 0 or math.isnan(measured):
        return stats.Estimate(measured, n=len(steps))
    estimate = stats.rate(steps, 1.0)
    if not estimate.has_interval:
        return stats.Estimate(measured, n=len(steps))
    return estimate.scaled(measured / estimate.value)


@dataclass
class Slice:
    """One lockstep turn's training steps (`accelexp.lockstep`): all of them timed, none a
    warm-up step; `samples` over all replicas, `seconds` this rank's, device synchronised."""

    round: int
    epoch: int
    samples: int
    seconds: float
    contended: bool = False  # the machine was shared during it (`accelexp.diagnosis.noise`)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


class TrainingDivergedError(AccelexpError):
    """The training loss stopped being a number; the message says where and what to try."""


def check_diverged(result: EpochResult, epoch: int, precision: Precision, lr: float) -> None:
    """Raise `TrainingDivergedError` when an epoch's mean training loss is not finite.

    Checked once per epoch on the loss already summed over all ranks, so every rank decides
    alike (no rank is left waiting in a collective) and no step pays a host sync for it. Under a
    GradScaler a non-finite loss is a step it skips; only a collapsed scale (below 1, after
    halving at every skip) means the run cannot recover.
    """
    if math.isfinite(result.loss):
        return
    scale = precision.grad_scale()
    if scale is not None and scale >= 1.0:
        return
    collapsed = f" and the GradScaler's scale collapsed to {scale:g}" if scale is not None else ""
    raise TrainingDivergedError(
        f"Training diverged in epoch {epoch}: the mean training loss is {result.loss}"
        f"{collapsed}. Try a smaller learning rate (optimizer.lr, "
        f"{lr:g} at the epoch's start), a warm-up (scheduler.warmup_epochs=1), or precision=fp32 "
        f"if this ran in amp/bf16. What was logged up to here is kept in MLflow."
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def figures_due(step: int, every: int) -> bool:
    """Steps whose loss and accuracy are read back for the progress bar: 1, 2, 4, 8, ... below
    `every`, then every `every`th — shown at once, for about log2(every) more host syncs an epoch
    (not one a step)."""
    return step % every == 0 or (step < every and step & (step - 1) == 0)


def batches_per_epoch(num_batches: int, max_steps: int | None) -> int:
    return min(num_batches, max_steps) if max_steps else num_batches


def eager_warmup_steps(steps: int) -> int:
    """Untimed steps of an eager model's first epoch of `steps`: 5, at most a quarter of it."""
    return min(EAGER_WARMUP_STEPS, steps // 4)


def optimizer_steps_per_epoch(num_batches: int, max_steps: int | None, accumulate: int) -> int:
    """One step per `accumulate` batches; a last, shorter group of batches steps too."""
    return math.ceil(batches_per_epoch(num_batches, max_steps) / accumulate)


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        strategy: Strategy,
        max_steps_per_epoch: int | None = None,
        log_every: int = 20,
        progress: bool = True,
        warmup_steps: int = 0,
    ) -> None:
        """`warmup_steps`: the steps that compile a compiled model (`SpeedSwitches.warmup_steps`),
        0 for an eager one (which leaves out `eager_warmup_steps` instead)."""
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.strategy = strategy
        self.device = strategy.device
        self.max_steps = max_steps_per_epoch
        self.log_every = log_every
        self.progress = progress and strategy.shape.is_main
        self.bar = self.progress and sys.stderr.isatty()  # piped: plain lines instead
        self.compile_steps = warmup_steps  # compiled: the first epoch's steps that compile
        self.warmed_up = False  # the first epoch trained leaves out its warm-up steps
        self.clock = StepClock(self.device)
        self.profiler = None  # a StepProfiler (profile=true), stepped after each step
        # what shows a shared machine, sampled over each epoch's timed steps
        self.probe = ContentionProbe(self.device, torch.get_num_threads())
        self.gate: Gate = NoGate()  # lockstep: passed before each slice of steps
        self.slices: list[Slice] = []  # lockstep: the timed slices trained, all epochs
        self.slice_s: float | None = None  # lockstep: slices of about this many seconds
        self.slice_steps: int | None = None  # ... as many steps, once sized (`_Turns.size`)
        self.step_times: list[float] = []  # lockstep: when each step ended (time.monotonic)

    def batches_per_epoch(self, loader: BatchLoader) -> int:
        return batches_per_epoch(len(loader), self.max_steps)

    def _sum_over_ranks(self, *values: torch.Tensor | float) -> list[float]:
        """Each value summed over the replicas: over the ranks, each replica counted once (the
        ranks of a pipeline across processes all hold their replica's figures)."""
        stacked = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values]
        )
        total = self.strategy.sync.reduce_sum(stacked)
        return (total / self.strategy.shape.ranks_per_replica).tolist()

    def train_epoch(self, loader: BatchLoader, epoch: int) -> EpochResult:
        self.model.train()
        loader.set_epoch(epoch)
        steps = self.batches_per_epoch(loader)
        warmup = 0 if self.warmed_up else self.untimed_steps(steps)
        self.warmed_up = True
        warmup_seconds = 0.0
        accumulate = self.strategy.accumulate_steps
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), dtype=torch.long, device=self.device)
        seen = timed_from = 0
        bar = tqdm(
            total=steps,
            desc=f"epoch {epoch}",
            disable=not self.bar,
            leave=False,
            mininterval=0.5,
        )
        clock, profiler, probe = self.clock, self.profiler, self.probe
        turns = _Turns(self, epoch, warmup) if self.gate.slice_steps else None
        synchronize(self.device)
        start = last_line = time.perf_counter()
        clock.start()
        if not warmup:  # else it starts with the timed steps
            probe.start()
        batches = iter(loader)
        for step in range(steps):
            if turns is not None:  # the turn is taken before the batch is made
                turns.at(step, seen)
            images, labels = next(batches)
            clock.mark(INPUT)
            loss, logits = train_step(
                self.model, images, labels, self.optimizer, self.strategy,
                scheduler=self.scheduler, accumulate=accumulate,
                step_now=(step + 1) % accumulate == 0 or step + 1 == steps, clock=clock,
            )  # fmt: skip
            loss_sum += loss.detach() * len(labels)
            correct += (logits.argmax(1) == labels).sum()
            seen += len(labels)
            bar.update()
            if profiler is not None:
                profiler.step()
            timing_starts = step + 1 == warmup
            if timing_starts:  # time the steps from here on
                synchronize(self.device)
                now = time.perf_counter()
                warmup_seconds, start, timed_from = now - start - clock.excluded, now, seen
                self.strategy.sync.take_comm_time()  # the warm-up steps' communication is not timed
            elif self.progress and figures_due(step + 1, self.log_every):
                now = time.perf_counter()
                all_ranks = (seen - timed_from) * self.strategy.shape.replicas
                figures = {
                    "loss": f"{loss_sum.item() / seen:.4f}",
                    "acc": f"{correct.item() / seen:.4f}",
                    "img_s": f"{all_ranks / (now - start):.0f}",
                }
                if self.bar:
                    bar.set_postfix(figures, refresh=False)
                elif now - last_line >= LINE_EVERY_S:
                    last_line = now
                    log.info(
                        "epoch %d step %d/%d  %s", epoch, step + 1, steps,
                        "  ".join(f"{k} {v}" for k, v in figures.items()),
                    )  # fmt: skip
            clock.mark(OTHER)
            if turns is not None:
                self.step_times.append(time.monotonic())
            if timing_starts:
                clock.start()
                probe.start()
        synchronize(self.device)
        seconds = time.perf_counter() - start - clock.excluded
        if turns is not None:  # the last slice; the turn is kept for evaluation and logging
            turns.at(steps, seen, last=True)
        breakdown = clock.stop(self.strategy.sync.take_comm_time())
        step_seconds = clock.step_seconds()
        noise = self._worst_over_ranks(probe.stop(step_seconds))
        bar.close()
        total_loss, total_correct, total_seen, total_timed = self._sum_over_ranks(
            loss_sum, correct, seen, seen - timed_from
        )
        # the slowest rank sets the pace of a synchronous step
        seconds, warmup_seconds = self.strategy.sync.reduce_max(
            torch.tensor([seconds, warmup_seconds], device=self.device)
        ).tolist()
        return EpochResult(
            total_loss / total_seen,
            total_correct / total_seen,
            int(total_timed),
            seconds,
            steps - warmup,
            warmup_seconds if warmup and self.compile_steps else None,
            self._mean_over_ranks(breakdown),
            step_seconds,
            noise,
        )

    def untimed_steps(self, steps: int) -> int:
        """The untimed steps of the first epoch trained, of `steps`; at least one step is timed."""
        if self.compile_steps:
            return min(self.compile_steps, steps - 1)
        return eager_warmup_steps(steps)

    def _worst_over_ranks(self, sample: NoiseSample) -> NoiseSample:
        return NoiseSample.worst_of(
            self.strategy.sync.reduce_max(sample.to_tensor(self.device)), sample
        )

    def _mean_over_ranks(self, breakdown: Breakdown) -> Breakdown:
        total = self.strategy.sync.reduce_sum(breakdown.to_tensor(self.device))
        return Breakdown.from_tensor(total / self.strategy.shape.world_size)

    @torch.no_grad()
    def evaluate(self, loader: BatchLoader, name: str = "eval") -> tuple[float, float]:
        """(loss, accuracy) over the whole set: each rank's share, summed over ranks.

        Its progress shows as the training's does, as `name`: a bar on a terminal, a plain line
        at most every `LINE_EVERY_S` seconds when piped; counting batches needs no host sync.
        """
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.long, device=self.device)
        seen = 0
        batches = len(loader)
        bar = tqdm(total=batches, desc=name, disable=not self.bar, leave=False, mininterval=0.5)
        last_line = time.perf_counter()
        for batch, (images, labels) in enumerate(loader, start=1):
            with self.strategy.precision.autocast():
                logits = self.model(self.strategy.precision.cast_inputs(images))
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
            correct += (logits.argmax(1) == labels).sum()
            seen += len(labels)
            bar.update()
            if self.progress and not self.bar and time.perf_counter() - last_line >= LINE_EVERY_S:
                last_line = time.perf_counter()
                log.info("%s: batch %d/%d", name, batch, batches)
        bar.close()
        total_loss, total_correct, total_seen = self._sum_over_ranks(loss_sum, correct, seen)
        return total_loss / total_seen, total_correct / total_seen


class _Turns:
    """One epoch's lockstep slices: the gate passed every `gate.slice_steps` steps (or, with
    `Trainer.slice_s`, as many as last that long: `size`), the time spent waiting taken out of
    the epoch's clock and contention probe, each whole slice of timed steps recorded
    (`Trainer.slices`) with its own verdict: did a neighbour on this host take CPU during it
    (`accelexp.diagnosis.noise`).

    Python's garbage collector runs at the gates, not in the slices: a full collection of a
    training process takes about 200 ms here, and landing in one side's 0.5-s slice it read as
    that side 30-45 % slower for the round (in pairs of rounds, every ~15 s: bf16 vs fp32 in one
    process). So a lockstep job's process collects by hand (torchtitan's way): the young
    generations at each gate, in its own turn and off the clock; everything after each epoch's
    last step, untimed."""

    def __init__(self, trainer: Trainer, epoch: int, warmup: int) -> None:
        self.trainer, self.epoch, self.warmup = trainer, epoch, warmup
        self.every = trainer.slice_steps or trainer.gate.slice_steps or 0
        self.threads = torch.get_num_threads()
        self.probe = ContentionProbe(trainer.device, self.threads)
        self.open: tuple[int, int, int, float] | None = None  # round, first step, seen, start
        gc.disable()  # a lockstep job's process: collected at the gates (class doc)

    def at(self, step: int, seen: int, last: bool = False) -> None:
        """Before `step` (or after the epoch's `last`): close the slice that ran, take a turn."""
        if not last and self.open is not None and step - self.open[1] < self.every:
            return
        trainer = self.trainer
        synchronize(trainer.device)  # no work of this job queued during another's turn
        now = time.perf_counter()
        if self.open is not None:
            round_, first, seen_then, began = self.open
            if step - first == self.every and first >= self.warmup:
                times = trainer.clock.step_seconds()[-self.every :]
                # a neighbour on this host sets a slice aside; the hypervisor's steal does not:
                # it drifts over seconds like the host's speed, and the round's pairing takes it
                # out (and it is in the run's own verdict)
                local = replace(self.probe.stop(times), steal=None)
                noise = judge([local], trainer.device.type, self.threads)
                samples = (seen - seen_then) * trainer.strategy.shape.replicas
                trainer.slices.append(
                    Slice(round_, self.epoch, samples, now - began, noise.contended)
                )
                self.size(times)
            self.open = None
        if last:
            gc.collect()
            return
        trainer.clock.pause()
        trainer.probe.pause()
        gc.collect(1)
        round_ = trainer.gate.turn()
        trainer.clock.resume()
        trainer.probe.resume()
        self.probe.start()
        self.open = (round_, step, seen, time.perf_counter())

    def size(self, step_seconds: list[float]) -> None:
        """`Trainer.slice_s`: after the process's first timed slice, a slice is as many steps as
        last `slice_s` at the slowest rank's median step, so that jobs whose steps differ in
        length (fp32 and bf16) sample the host's drift over the same time and their slices
        pair evenly. Every rank reaches it at the same step (its turn) and agrees."""
        trainer = self.trainer
        if trainer.slice_s is None or trainer.slice_steps is not None:
            return
        median = torch.tensor(statistics.median(step_seconds), dtype=torch.float64)
        step_s = trainer.strategy.sync.reduce_max(median.to(trainer.device)).item()
        trainer.slice_steps = self.every = max(1, round(trainer.slice_s / step_s))
        if trainer.strategy.shape.is_main:
            log.info(
                "lockstep: slices of %d steps (%.0f ms a step, lockstep.slice_s=%g)",
                self.every, step_s * 1e3, trainer.slice_s,
            )  # fmt: skip
