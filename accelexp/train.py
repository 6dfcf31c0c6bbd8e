"""One run, start to end: build every component from the config, train, test, track.

    strategy -> tracker check -> data -> model -> speed switches -> loaders -> wrapped model
    -> optimizer -> precision -> scheduler
    -> epochs (train, validate, best checkpoint, metrics) -> best checkpoint on the test set

`run(cfg, output_dir)` is what `run.py` calls inside the Hydra job, and what tests call directly.
"""

from __future__ import annotations

import logging
import platform
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from accelexp.config import ConfigError, validate
from accelexp.data import BatchLoader, DataBundle, build_data, resolve_on_device
from accelexp.engine import Trainer, check_diverged, optimizer_steps_per_epoch
from accelexp.models import build_model
from accelexp.optim import build_optimizer, build_scheduler
from accelexp.parallel import build_strategy
from accelexp.parallel.base import Strategy
from accelexp.precision import Precision
from accelexp.speed import SpeedSwitches
from accelexp.tracking import Tracker, flatten
from accelexp.tracking.runs import RUN_ID_FILE, run_name, run_tags

log = logging.getLogger(__name__)


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:  # cuDNN autotuning and TF32 too: see SpeedSwitches.resolve
        torch.use_deterministic_algorithms(True, warn_only=True)


def make_loaders(
    cfg: DictConfig,
    data: DataBundle,
    strategy: Strategy,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> tuple[BatchLoader, BatchLoader, BatchLoader]:
    """Train, val and test loaders; `data.on_device` decided once for all three."""
    on_device = resolve_on_device(
        cfg.data.on_device, strategy.device, data.nbytes, cfg.data.num_workers
    )
    common = {
        "device": strategy.device,
        "mean": data.mean,
        "std": data.std,
        "num_workers": cfg.data.num_workers,
        "on_device": on_device,
        "memory_format": memory_format,
    }
    train = BatchLoader(
        data.train,
        cfg.data.batch_size,
        strategy.train_sampler(len(data.train), cfg.seed),
        augment=cfg.data.augment,
        drop_last=True,
        seed=cfg.seed + strategy.rank,
        max_batches=cfg.max_steps_per_epoch,
        **common,
    )
    val, test = (
        BatchLoader(split, cfg.data.eval_batch_size, strategy.eval_sampler(len(split)), **common)
        for split in (data.val, data.test)
    )
    if len(train) == 0:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} is larger than this rank's share of the "
            f"training set ({len(train.sampler)} samples): no full batch can be formed. "
            f"Use a smaller data.batch_size."
        )
    return train, val, test


class FailingLoader:
    """Test hook (`debug.raise_on_rank`): the loader of one rank raises at a given step."""

    def __init__(self, loader: BatchLoader, at_step: int, rank: int) -> None:
        self.loader, self.at_step, self.rank = loader, at_step, rank

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self):
        for step, batch in enumerate(self.loader, start=1):
            if step == self.at_step:
                raise RuntimeError(f"debug.raise_on_rank={self.rank}: failing at step {step}")
            yield batch


def run(cfg: DictConfig, output_dir: str | Path, overrides: Sequence[str] = ()) -> dict[str, float]:
    """Train and test one configuration; returns the final metrics."""
    validate(cfg)
    output_dir = Path(output_dir)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    strategy = build_strategy(cfg)
    strategy.setup()
    try:
        return _run(cfg, output_dir, overrides, strategy)
    except BaseException as error:
        # when it failed, before the teardown below makes the other ranks fail in turn: the
        # launcher names the earliest failure as the cause (accelexp.worker, launch)
        error.failed_at_ns = time.time_ns()
        raise
    finally:
        strategy.teardown()


def _run(
    cfg: DictConfig, output_dir: Path, overrides: Sequence[str], strategy: Strategy
) -> dict[str, float]:
    tracker = Tracker(cfg.mlflow, enabled=strategy.is_main)
    tracker.connect()  # fail now, not after training, when the store is unreachable
    seed_everything(cfg.seed, cfg.deterministic)
    data = build_data(cfg.data, cfg.seed)
    model = build_model(cfg.model, data.in_channels, data.num_classes, data.image_size)
    switches = SpeedSwitches.resolve(cfg.speed, strategy.device, model, cfg.deterministic)
    switches.apply_backends()
    train_loader, val_loader, test_loader = make_loaders(
        cfg, data, strategy, switches.memory_format
    )
    placement = train_loader.placement
    if cfg.debug.raise_on_rank == strategy.rank:
        train_loader = FailingLoader(train_loader, cfg.debug.raise_at_step, strategy.rank)
    model = strategy.wrap_model(
        switches.prepare(model),
        # a batch's shape, for strategies that time the model (parallelism.balance=compute)
        input_shape=(cfg.data.batch_size, data.in_channels, data.image_size, data.image_size),
    )
    if switches.compile_mode:
        model = strategy.compile(model, switches.compile_mode)
    optimizer = strategy.wrap_optimizer(
        build_optimizer(
            cfg.optimizer,
            model.parameters(),
            strategy.scale_lr(cfg.optimizer.lr),
            **switches.optimizer_kwargs(),
        ),
        model,
    )
    precision = Precision(
        cfg.precision.name, strategy.device, cfg.precision.init_scale, cfg.precision.growth_interval
    )
    steps = optimizer_steps_per_epoch(
        len(train_loader), cfg.max_steps_per_epoch, strategy.accumulate_steps
    )
    scheduler = build_scheduler(cfg.scheduler, optimizer, steps, cfg.epochs)
    trainer = Trainer(
        model,
        optimizer,
        scheduler,
        precision,
        strategy,
        cfg.max_steps_per_epoch,
        cfg.log_every_n_steps,
        cfg.progress,
        warmup_steps=switches.warmup_steps,
    )

    resolved = OmegaConf.to_container(cfg, resolve=True)
    params = {
        **flatten(resolved),
        **strategy.describe(),
        "torch_version": torch.__version__,
        "num_params": sum(p.numel() for p in model.parameters()),
        "train_samples": len(data.train),
        "data_placement": placement,
    }
    tags = {
        **run_tags(cfg, strategy.world_size, overrides),
        **switches.tags(),
        "data_placement": placement,
        "host": platform.node(),
    }
    tracker.start(run_name(cfg, switches.summary()), params, tags)
    if tracker.run_id:  # a failure later on is recorded on this run (tracking.record_failure)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RUN_ID_FILE).write_text(tracker.run_id)
    try:
        _log_run_files(tracker, output_dir, resolved)
        metrics = _fit(
            cfg, output_dir, trainer, tracker, train_loader, val_loader, test_loader, resolved
        )
    except KeyboardInterrupt:
        tracker.end("KILLED")
        raise
    except BaseException:
        tracker.end("FAILED")
        raise
    tracker.end("FINISHED")
    return metrics


def _fit(
    cfg: DictConfig,
    output_dir: Path,
    trainer: Trainer,
    tracker: Tracker,
    train_loader: BatchLoader,
    val_loader: BatchLoader,
    test_loader: BatchLoader,
    resolved: dict,
) -> dict[str, float]:
    strategy, device = trainer.strategy, trainer.device
    checkpoint = output_dir / "checkpoints" / "best.pt"
    best_val_acc, time_to_target = -1.0, None
    run_start = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        strategy.reset_memory_stats()
        lr = trainer.optimizer.param_groups[0]["lr"]
        train = trainer.train_epoch(train_loader, epoch)
        val_loss, val_acc = trainer.evaluate(val_loader)
        elapsed = time.perf_counter() - run_start
        metrics = {
            "train_loss": train.loss,
            "train_acc": train.accuracy,
            "val_loss": val_loss,
            "val_acc": val_acc,
            "lr": lr,
            "epoch_time_s": train.seconds,
            "samples_per_s": train.samples_per_s,
            "samples_per_s_per_device": train.samples_per_s / strategy.num_devices,
            **strategy.memory_metrics(),
            "grad_scale": trainer.precision.grad_scale(),
            "compile_s": train.compile_seconds,
            "elapsed_s": elapsed,
        }
        tracker.log_metrics(metrics, step=epoch)
        check_diverged(train, epoch, trainer.precision, lr)
        if strategy.is_main:
            log.info(
                "epoch %d/%d  train_loss %.4f  train_acc %.4f  val_loss %.4f  val_acc %.4f  "
                "%.0f samples/s  %.1fs",
                epoch, cfg.epochs, train.loss, train.accuracy, val_loss, val_acc,
                train.samples_per_s, train.seconds,
            )  # fmt: skip
        if val_acc > best_val_acc:
            best_val_acc = val_acc
            if strategy.is_main:
                save_checkpoint(
                    checkpoint, strategy.unwrap(trainer.model), epoch, val_acc, resolved
                )
        if time_to_target is None and cfg.target_accuracy and val_acc >= cfg.target_accuracy:
            time_to_target = elapsed
    strategy.barrier()  # the checkpoint is written before any rank reads it
    load_checkpoint(checkpoint, strategy.unwrap(trainer.model), device)
    test_loss, test_acc = trainer.evaluate(test_loader)
    final = {
        "best_val_acc": best_val_acc,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "total_time_s": time.perf_counter() - run_start,
        "time_to_target_s": time_to_target,
    }
    tracker.log_metrics(final, step=cfg.epochs)
    if strategy.is_main:
        log.info("best val_acc %.4f  test_acc (best checkpoint) %.4f", best_val_acc, test_acc)
        if cfg.mlflow.log_checkpoint:
            tracker.log_artifact(checkpoint, "checkpoints")
    return {k: v for k, v in final.items() if v is not None}


def save_checkpoint(
    path: Path, model: torch.nn.Module, epoch: int, val_acc: float, config: dict
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"model": model.state_dict(), "epoch": epoch, "val_acc": val_acc, "config": config}, tmp
    )
    tmp.replace(path)  # never leave a half-written best checkpoint


def load_checkpoint(path: Path, model: torch.nn.Module, device: torch.device) -> dict:
    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    return state


def _log_run_files(tracker: Tracker, output_dir: Path, resolved: dict) -> None:
    """The resolved config, and Hydra's own record of the job (config, overrides) when present."""
    if not tracker.enabled:
        return
    config_file = output_dir / "config_resolved.yaml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    tracker.log_artifact(config_file)
    tracker.log_artifact(output_dir / ".hydra", "hydra")
