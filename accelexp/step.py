"""One training step: the one function the loop, the largest-batch search and the benchmarks share.

Forward (the batch cast as the precision's model takes it: `Precision.cast_inputs`) and loss
(in fp32, as autocast computes it, whatever the logits' dtype) under the precision's autocast,
backward with its loss scaling inside the strategy's backward context (`sync=False` for the
micro-batches that only accumulate, the loss divided by `accumulate`) — the strategy's
`forward_backward`, which a pipeline across ranks runs as its schedule —, and on the step that
completes a group of micro-batches the strategy's optimizer step, `zero_grad` and the
scheduler's step. It knows only the interfaces (`Strategy` and its `precision`), never a
concrete strategy.

The loop's step clock is told where the forward, backward and optimizer phases end (`clock`, a
`accelexp.timing.StepClock` or anything with its `mark`); the input and the loop's own
bookkeeping are the loop's to mark. Without a clock nothing is timed.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

from accelexp.parallel.base import Strategy
from accelexp.timing import OPTIMIZER


class PhaseMarks(Protocol):
    """What the step tells a clock: the `phase` (`accelexp.timing.PHASES`) ends now."""

    def mark(self, phase: int) -> None: ...


class Unmarked:
    """A clock that takes no marks: a step timed by no one."""

    def mark(self, phase: int) -> None:
        pass


def train_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    strategy: Strategy,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    accumulate: int = 1,
    step_now: bool = True,
    clock: PhaseMarks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step on (`images`, `labels`); returns (loss, logits), neither detached.

    `step_now=False`: a micro-batch that only accumulates its gradients (no gradient sync, no
    optimizer step); every micro-batch's loss is divided by `accumulate`."""
    if clock is None:
        clock = Unmarked()
    loss, logits = strategy.forward_backward(
        model, images, labels, accumulate=accumulate, sync=step_now, clock=clock
    )
    if step_now:
        strategy.optimizer_step(optimizer)
        optimizer.zero_grad()  # set_to_none by default since torch 2.0
        if scheduler is not None:
            scheduler.step()
    clock.mark(OPTIMIZER)
    return loss, logits
