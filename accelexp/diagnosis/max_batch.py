"""The largest per-worker batch that fits on the device, searched after training (`max_batch`).

With `max_batch.search=true` (the memory-vs-speed study turns it on), a run that trained on a
CUDA GPU goes on, after its test evaluation, to double the per-worker batch from
`data.batch_size` — each trial one real training step (`accelexp.step.train_step`, the loop's:
forward and loss under the run's autocast, backward with its loss scaling, the strategy's
optimizer step) on random inputs of the sample's shape — until a trial runs out of memory or the
batch would pass `max_batch.limit`. Every rank takes part in every trial, and the ranks agree each
trial's outcome through the strategy's `reduce_max` (one rank out of memory ends the search for
all), so no rank waits in a collective for a rank that stopped. The allocator's cache is emptied
between trials.

It records the metric `max_batch` (the largest batch that fit, per worker) and the tag
`max_batch` saying how it was found. On a CPU there is no search — no out-of-memory signal, the
operating system swaps instead — and the tag says so, with no metric. What a CPU gives instead is
the step's memory, measured: one training step at the run's batch under PyTorch's `MemTracker`
(`torch.distributed._tools.mem_tracker`, which follows every tensor's storage through the
dispatcher), whose peak of live tensors is logged as `step_peak_mb`, split into
`step_peak_<kind>_mb` (parameters, gradients, optimizer state, activations, temporaries such as
FSDP's all-gathered weights). The process's peak RSS (`peak_mem_mb` on a CPU) cannot compare
strategies: about a GiB of it is the libraries, and more libraries load under FSDP.

The trials change the weights, optimizer state and loss scale of the trained model: the search
runs after the last checkpoint and the test, so nothing of it is saved or reported as training.
Ranks on devices of the same size run out of memory at the same step; a world of unlike devices
could see one rank fail inside a collective of the step (e.g. DDP's gradient allreduce) while
another waits there — give such a world no search.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from accelexp.diagnosis.run import is_out_of_memory
from accelexp.parallel.base import Strategy
from accelexp.record import MAX_BATCH, STEP_PEAK_MB, step_peak_kind_mb
from accelexp.step import train_step
from accelexp.tracking import Tracker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MaxBatch:
    """What the search found: the largest batch that fit (None: none, or not searched), and how."""

    batch_size: int | None
    how: str


def not_searched_on(device: torch.device) -> MaxBatch:
    return MaxBatch(None, f"not searched: needs a CUDA GPU (device {device.type})")


@dataclass(frozen=True)
class Trial:
    """One training step at a given batch on random inputs of `sample_shape` (laid out as the
    run's batches: `memory_format`), through the run's model, optimizer, precision and strategy;
    calling it says whether every rank's step fit."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    sample_shape: Sequence[int]
    num_classes: int
    memory_format: torch.memory_format = torch.contiguous_format

    def __call__(self, batch: int) -> bool:
        fits = True
        try:
            self.step(batch)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            fits = False
        # here, not in the handler: the error's frames, and the tensors they hold, are gone
        self.optimizer.zero_grad()
        torch.cuda.empty_cache()
        failed = torch.tensor(0.0 if fits else 1.0, device=self.strategy.device)
        fits = self.strategy.sync.reduce_max(failed).item() == 0.0
        if self.strategy.shape.is_main:
            log.info("max_batch search: batch %d %s", batch, "fits" if fits else "is too big")
        return fits

    def step(self, batch: int) -> None:
        device, strategy = self.strategy.device, self.strategy
        images = torch.randn(batch, *self.sample_shape, device=device)
        images = images.contiguous(memory_format=self.memory_format)
        labels = torch.randint(self.num_classes, (batch,), device=device)
        train_step(self.model, images, labels, self.optimizer, strategy)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an asynchronous failure surfaces inside the trial


def search(trial: Trial, start: int, limit: int) -> MaxBatch:
    """Double the per-worker batch from `start` while a training step (`trial`) fits, up to
    `limit`.

    Every rank must call this with the same arguments (the trials are collective). On a device
    other than CUDA nothing is tried (`not_searched_on`)."""
    device = trial.strategy.device
    if device.type != "cuda":
        return not_searched_on(device)
    if start > limit:
        return MaxBatch(
            None, f"not searched: data.batch_size={start} is above max_batch.limit={limit}"
        )
    fit = too_big = None
    batch = start
    trial.model.train()
    while batch <= limit:
        if not trial(batch):
            too_big = batch
            break
        fit, batch = batch, batch * 2
    origin = f"doubling the per-worker batch from data.batch_size={start}"
    if fit is None:
        return MaxBatch(None, f"{origin}: even {start} ran out of memory after training")
    if too_big is None:
        return MaxBatch(
            fit, f"{origin}: {fit} fit; stopped at max_batch.limit={limit} with memory to spare"
        )
    return MaxBatch(fit, f"{origin}: {fit} fit, {too_big} ran out of memory")


def step_memory(trial: Trial, batch: int, per_device: bool = False):
    """The peak of live tensors over one training step at `batch`, in MiB: `step_peak_mb`, and
    by kind `step_peak_<kind>_mb` (every rank steps; the figures are this rank's), of the
    strategy's device; with `per_device`, a dict of them for every device the step used."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(trial.model, trial.optimizer)
    trial.model.train()
    with tracker:
        trial.step(batch)
    trial.optimizer.zero_grad()
    snapshot = tracker.get_tracker_snapshot("peak")
    by_device = {device: in_mb(peaks) for device, peaks in snapshot.items()}
    return by_device if per_device else by_device[trial.strategy.device]


def in_mb(peaks: dict) -> dict[str, float]:
    """MemTracker's peaks of one device (bytes by kind) as the record's metrics, in MiB."""
    metrics = {STEP_PEAK_MB: peaks["Total"] / 2**20}
    for kind, size in peaks.items():
        if kind != "Total":
            metrics[step_peak_kind_mb(kind.name.lower())] = size / 2**20
    return metrics


def after_training(cfg: DictConfig, trial: Trial, tracker: Tracker) -> MaxBatch | None:
    """With `max_batch.search=true`: the search (`search`) with the run's `trial` step, its tag
    and metric recorded (and on a CPU the step's memory, `step_memory`); None (nothing
    recorded) when the search is off."""
    settings = OmegaConf.select(cfg, "max_batch")
    if settings is None or not settings.search:
        return None
    result = search(trial, cfg.data.batch_size, settings.limit)
    tracker.set_tags({MAX_BATCH: result.how})
    if result.batch_size is not None:
        tracker.log_metrics({MAX_BATCH: result.batch_size}, step=cfg.epochs)
    strategy = trial.strategy
    if strategy.device.type == "cpu":
        tracker.log_metrics(step_memory(trial, cfg.data.batch_size), step=cfg.epochs)
    if strategy.shape.is_main:
        log.info("max_batch: %s", result.how)
    return result
