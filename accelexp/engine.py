"""The training loop: epochs of train and evaluate, knowing only the component interfaces.

`Trainer` sees a `Strategy` (where the work runs, how ranks agree), a `Precision` (autocast and
loss scaling) and a plain optimizer and scheduler. Per-step work is the forward pass, backward
pass, optimizer and scheduler step and two on-device additions for the epoch's loss and accuracy;
the host reads numbers back only every `log_every` steps for the progress bar (on a terminal; a
plain line at most every `LINE_EVERY_S` seconds when the output is piped, e.g. a Slurm log, so no
`\r` frames land in it), and at the end of
the epoch, once, summed over all ranks.

With a compiled model the first `warmup_steps` steps of the first epoch compile it: they are
timed apart (`EpochResult.compile_seconds`) and left out of the epoch's throughput, never
folded into `samples_per_s`; their loss and accuracy still count.

Every step tells a `StepClock` where its phases end (input, forward, backward, optimizer, the
loop's bookkeeping): `EpochResult.breakdown` is where the timed steps' time went, averaged over
ranks (`accelexp.diagnosis.accounting`). A `profiler` (`profile=true`) is stepped after each step.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from accelexp.data import BatchLoader
from accelexp.diagnosis.accounting import (
    BACKWARD,
    FORWARD,
    INPUT,
    OPTIMIZER,
    OTHER,
    Breakdown,
    StepClock,
)
from accelexp.errors import AccelexpError
from accelexp.parallel.base import Strategy
from accelexp.precision import Precision

log = logging.getLogger(__name__)
LINE_EVERY_S = 10.0  # the least time between two progress lines of piped output


@dataclass
class EpochResult:
    loss: float
    accuracy: float
    samples: int  # timed samples (all but the compile warm-up's), over all ranks
    seconds: float
    compile_seconds: float | None = None  # the compile warm-up steps, slowest rank
    breakdown: Breakdown = field(default_factory=Breakdown)  # the timed steps, mean over ranks

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


def batches_per_epoch(num_batches: int, max_steps: int | None) -> int:
    return min(num_batches, max_steps) if max_steps else num_batches


def optimizer_steps_per_epoch(num_batches: int, max_steps: int | None, accumulate: int) -> int:
    """One step per `accumulate` batches; a last, shorter group of batches steps too."""
    return math.ceil(batches_per_epoch(num_batches, max_steps) / accumulate)


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        precision: Precision,
        strategy: Strategy,
        max_steps_per_epoch: int | None = None,
        log_every: int = 20,
        progress: bool = True,
        warmup_steps: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.precision = precision
        self.strategy = strategy
        self.device = strategy.device
        self.max_steps = max_steps_per_epoch
        self.log_every = log_every
        self.progress = progress and strategy.is_main
        self.bar = self.progress and sys.stderr.isatty()  # piped: plain lines instead
        self.warmup_steps = warmup_steps  # of the next epoch trained, then 0
        self.clock = StepClock(self.device)
        self.profiler = None  # a StepProfiler (profile=true), stepped after each step

    def batches_per_epoch(self, loader: BatchLoader) -> int:
        return batches_per_epoch(len(loader), self.max_steps)

    def _sum_over_ranks(self, *values: torch.Tensor | float) -> list[float]:
        stacked = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values]
        )
        return self.strategy.reduce_sum(stacked).tolist()

    def train_epoch(self, loader: BatchLoader, epoch: int) -> EpochResult:
        self.model.train()
        loader.set_epoch(epoch)
        steps = self.batches_per_epoch(loader)
        warmup = min(self.warmup_steps, steps - 1)  # leave at least one step to time
        self.warmup_steps = 0
        compile_seconds = None
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
        clock, profiler = self.clock, self.profiler
        synchronize(self.device)
        start = last_line = time.perf_counter()
        clock.start()
        for step, (images, labels) in enumerate(loader):
            if step == steps:
                break
            clock.mark(INPUT)
            step_now = (step + 1) % accumulate == 0 or step + 1 == steps
            with self.strategy.backward_context(self.model, sync=step_now):
                with self.precision.autocast():
                    logits = self.model(images)
                    loss = F.cross_entropy(logits, labels)
                clock.mark(FORWARD)
                self.precision.backward(loss / accumulate if accumulate > 1 else loss)
            clock.mark(BACKWARD)
            if step_now:
                self.strategy.optimizer_step(self.optimizer, self.precision)
                self.optimizer.zero_grad()  # set_to_none by default since torch 2.0
                self.scheduler.step()
            clock.mark(OPTIMIZER)
            loss_sum += loss.detach() * len(labels)
            correct += (logits.argmax(1) == labels).sum()
            seen += len(labels)
            bar.update()
            if profiler is not None:
                profiler.step()
            if step + 1 == warmup:  # compiled: time the steps from here on
                synchronize(self.device)
                now = time.perf_counter()
                compile_seconds, start, timed_from = now - start, now, seen
                self.strategy.take_comm_time()  # the compile steps' communication is not timed
                clock.start()
            elif self.progress and (step + 1) % self.log_every == 0:
                now = time.perf_counter()
                figures = {
                    "loss": f"{loss_sum.item() / seen:.4f}",
                    "acc": f"{correct.item() / seen:.4f}",
                    "img_s": f"{(seen - timed_from) * self.strategy.replicas / (now - start):.0f}",
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
        synchronize(self.device)
        seconds = time.perf_counter() - start
        breakdown = clock.stop(self.strategy.take_comm_time())
        bar.close()
        total_loss, total_correct, total_seen, total_timed = self._sum_over_ranks(
            loss_sum, correct, seen, seen - timed_from
        )
        # the slowest rank sets the pace of a synchronous step
        seconds, compile_seconds = self.strategy.reduce_max(
            torch.tensor([seconds, compile_seconds or 0.0], device=self.device)
        ).tolist()
        return EpochResult(
            total_loss / total_seen,
            total_correct / total_seen,
            int(total_timed),
            seconds,
            compile_seconds if warmup > 0 else None,
            self._mean_over_ranks(breakdown),
        )

    def _mean_over_ranks(self, breakdown: Breakdown) -> Breakdown:
        total = self.strategy.reduce_sum(breakdown.to_tensor(self.device))
        return Breakdown.from_tensor(total / self.strategy.world_size)

    @torch.no_grad()
    def evaluate(self, loader: BatchLoader) -> tuple[float, float]:
        """(loss, accuracy) over the whole set: each rank's share, summed over ranks."""
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.long, device=self.device)
        seen = 0
        for images, labels in loader:
            with self.precision.autocast():
                logits = self.model(images)
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
            correct += (logits.argmax(1) == labels).sum()
            seen += len(labels)
        total_loss, total_correct, total_seen = self._sum_over_ranks(loss_sum, correct, seen)
        return total_loss / total_seen, total_correct / total_seen
