"""One run, start to end: build every component from the config, train, test, track.

    strategy and precision -> tracker check -> data -> model -> speed switches -> loaders
    -> wrapped model -> optimizer -> scheduler
    -> resume from a checkpoint (accelexp.checkpoint), if asked or restarted
    -> epochs (train, validate, metrics, best and last checkpoints) -> best weights on the test set

`run(cfg, output_dir)` is what `run.py` calls inside the Hydra job, and what tests call directly.

The typed boundary: `run` validates the DictConfig, then turns it into the schema's dataclasses
once (`accelexp.config.typed`); the builders take the part they need, typed (`cfg.model`,
`cfg.data`, `cfg.optimizer`, `cfg.scheduler`, `cfg.speed`...), and the strategy its own
(`connect(cfg)`: `cfg.parallelism`, `cfg.device`, `cfg.precision`). The DictConfig goes on only
where a config's tree is the point: the params and identity MLflow records (`resolved`), the
run's name and tags, and the diagnosis (which tries its advice as overrides).
"""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from accelexp import activation_checkpoint, checkpoint, outcome, record
from accelexp.config import ConfigError, typed, validate
from accelexp.config.catalog import flatten
from accelexp.config.identity import config_hash, config_id, setting_id
from accelexp.data import SOURCES, BatchLoader, DataBundle, build_data, resolve_on_device
from accelexp.data.sources import SYNTHETIC_SEED
from accelexp.diagnosis import flops
from accelexp.diagnosis.profiler import StepProfiler
from accelexp.diagnosis.run import RunDiagnosis, is_out_of_memory
from accelexp.engine import (
    EpochResult,
    Trainer,
    check_diverged,
    optimizer_steps_per_epoch,
    throughput,
)
from accelexp.errors import AccelexpError
from accelexp.lockstep import gate as lockstep_gate
from accelexp.models import build_model
from accelexp.optim import build_optimizer, build_scheduler
from accelexp.parallel import connect, run_label
from accelexp.parallel.base import Strategy
from accelexp.parallel.world import current_world
from accelexp.schema import Config, DataConfig, DebugConfig
from accelexp.speed import SpeedSwitches, has_conv2d
from accelexp.tracking import Tracker
from accelexp.tracking.life import RUN_ID_FILE
from accelexp.tracking.names import run_name, run_tags
from accelexp.tracking.runs import significant

log = logging.getLogger(__name__)


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:  # cuDNN autotuning and TF32 too: see SpeedSwitches.resolve
        torch.use_deterministic_algorithms(True, warn_only=True)


class Loaders(NamedTuple):
    """A run's batches: its training, validation and test sets'."""

    train: BatchLoader
    val: BatchLoader
    test: BatchLoader


def make_loaders(
    data_cfg: DataConfig,
    data: DataBundle,
    strategy: Strategy,
    seed: int,
    max_batches: int | None = None,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> Loaders:
    """Train, val and test loaders; `data.on_device` decided once for all three. `seed`: the
    run's (the training order's, each rank's augmentation's); `max_batches`: the training
    loader's cut (`max_steps_per_epoch`)."""
    on_device = resolve_on_device(
        data_cfg.on_device, strategy.device, data.nbytes, data_cfg.num_workers
    )
    common = {
        "device": strategy.device,
        "mean": data.mean,
        "std": data.std,
        "num_workers": data_cfg.num_workers,
        "on_device": on_device,
        "memory_format": memory_format,
    }
    train = BatchLoader(
        data.train,
        data_cfg.batch_size,
        strategy.train_sampler(len(data.train), seed),
        augment=data_cfg.augment,
        drop_last=True,
        seed=seed + strategy.shape.rank,
        max_batches=max_batches,
        **common,
    )
    val, test = (
        BatchLoader(split, data_cfg.eval_batch_size, strategy.eval_sampler(len(split)), **common)
        for split in (data.val, data.test)
    )
    if len(train) == 0:
        raise ConfigError(
            f"data.batch_size={data_cfg.batch_size} is larger than this rank's share of the "
            f"training set ({len(train.sampler)} samples): no full batch can be formed. "
            f"Use a smaller data.batch_size."
        )
    return Loaders(train, val, test)


class DebugLoader:
    """Test hooks: the loader of one rank raises at a given step (`debug.raise_on_rank`), or its
    process dies by a signal there (`debug.raise_as`: SIGKILL as from the OOM killer), the
    loaders raise a real `torch.OutOfMemoryError` (`debug.raise_oom_at_step`), each batch
    arrives `debug.input_delay_ms` late (a slow input pipeline)."""

    def __init__(self, loader: BatchLoader, debug: DebugConfig, rank: int) -> None:
        self.loader, self.debug, self.rank = loader, debug, rank

    @classmethod
    def wrap(cls, loader: BatchLoader, debug: DebugConfig, rank: int) -> BatchLoader:
        wanted = debug.raise_on_rank == rank or debug.raise_oom_at_step or debug.input_delay_ms
        return cls(loader, debug, rank) if wanted else loader

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self):
        debug = self.debug
        for step, batch in enumerate(self.loader, start=1):
            if debug.raise_on_rank == self.rank and step == debug.raise_at_step:
                if debug.raise_as != "error":  # as the OOM killer, a segfault: no error, no record
                    os.kill(os.getpid(), signal.Signals[debug.raise_as])
                raise RuntimeError(f"debug.raise_on_rank={self.rank}: failing at step {step}")
            if step == debug.raise_oom_at_step:
                raise torch.OutOfMemoryError(
                    f"debug.raise_oom_at_step={step}: out of memory. Tried to allocate 2.00 GiB"
                )
            if debug.input_delay_ms:
                time.sleep(debug.input_delay_ms / 1e3)
            yield batch


def run(
    cfg: DictConfig,
    output_dir: str | Path,
    overrides: Sequence[str] = (),
    gate: lockstep_gate.Gate | None = None,
) -> dict[str, float]:
    """Train and test one configuration; returns the final metrics (as logged to MLflow).
    `gate`: the turns this job takes in a lockstep sweep whose jobs share one process
    (`accelexp.lockstep.together`); else a lockstep job's gate comes from its environment."""
    validate(cfg)
    parts = typed(cfg)  # the typed boundary: below, each layer takes its part
    # in a sweep's process (Hydra's basic launcher, lockstep in one process), what the job before
    # left — its model, data and optimizer, held in reference cycles — is collected now, not by
    # the collector in the middle of this job's timed steps (full collections ~200 ms here)
    gc.collect()
    output_dir = Path(output_dir)
    if parts.threads:
        torch.set_num_threads(parts.threads)
    strategy = connect(parts)
    # compare=lockstep: the turns this job takes (a job of any other sweep passes no gate)
    gate = gate or lockstep_gate.from_environment(
        strategy.shape.rank,
        strategy.shape.world_size,
        parts.lockstep.slice_steps,
        parts.lockstep.epochs_per_process,
        launched=current_world().joined,
    )
    try:
        return _run(parts, cfg, output_dir, overrides, strategy, gate)
    except lockstep_gate.Reincarnation:
        gate.close(again=True)  # the same job, back in a moment as a fresh process
        raise
    except BaseException as error:
        # when it failed, before the teardown below makes the other ranks fail in turn: the
        # launcher names the earliest failure as the cause (accelexp.worker, launch)
        error.failed_at_ns = time.time_ns()
        gate.close(why=f"{type(error).__name__}: {error}".splitlines()[0][:200])
        raise
    finally:
        gate.close()  # the turn is handed on once the run is closed, whatever its end
        strategy.teardown()


def _run(
    cfg: Config,
    tree: DictConfig,
    output_dir: Path,
    overrides: Sequence[str],
    strategy: Strategy,
    gate: lockstep_gate.Gate,
) -> dict[str, float]:
    """`cfg`: the run's config, typed; `tree`: the same as a DictConfig, for what reads a
    config's tree (MLflow's params and the run's identity, its name and tags, the diagnosis)."""
    tracker = Tracker(tree.mlflow, enabled=strategy.shape.is_main)
    tracker.connect()  # fail now, not after training, when the store is unreachable
    resolved = OmegaConf.to_container(tree, resolve=True)
    state, resume_from = _state_to_resume(cfg, output_dir, tracker, strategy, resolved)
    seed_everything(cfg.seed, cfg.deterministic)
    data = build_data(cfg.data, cfg.seed)
    model = build_model(cfg.model, data.in_channels, data.num_classes, data.image_size)
    switches = SpeedSwitches.resolve(cfg.speed, strategy.device, model, cfg.deterministic)
    switches.apply_backends()
    loaders = make_loaders(
        cfg.data, data, strategy, cfg.seed, cfg.max_steps_per_epoch, switches.memory_format
    )
    placement, generator = loaders.train.placement, loaders.train.generator
    loaders = loaders._replace(
        train=DebugLoader.wrap(loaders.train, cfg.debug, strategy.shape.rank)
    )
    model = switches.prepare(model)
    sample_shape = (data.in_channels, data.image_size, data.image_size)
    flops_per_sample = flops.train_flops_per_sample(model, sample_shape)  # before placement
    model = strategy.wrap_model(
        model,
        # a batch's shape, for strategies that time the model (parallelism.balance=compute)
        input_shape=(cfg.data.batch_size, data.in_channels, data.image_size, data.image_size),
        compile_mode=switches.compile_mode,
    )
    optimizer = strategy.wrap_optimizer(
        build_optimizer(
            cfg.optimizer,
            model.parameters(),
            strategy.scale_lr(cfg.optimizer.lr),
            **switches.optimizer_kwargs(),
        ),
        model,
    )
    steps = optimizer_steps_per_epoch(
        len(loaders.train), cfg.max_steps_per_epoch, strategy.accumulate_steps
    )
    scheduler = build_scheduler(cfg.scheduler, optimizer, steps, cfg.epochs)
    trainer = Trainer(
        model,
        optimizer,
        scheduler,
        strategy,
        cfg.max_steps_per_epoch,
        cfg.log_every_n_steps,
        cfg.progress,
        warmup_steps=switches.warmup_steps,
    )
    trainer.gate = gate  # its turns and the steps' ends are kept in the job's folder
    trainer.slice_s = cfg.lockstep.slice_s
    gate.keep_record(output_dir / record.lockstep_file(strategy.shape.rank), trainer.step_times)
    profiler = StepProfiler(tree, output_dir, strategy.shape.rank, strategy.device)
    trainer.profiler = profiler if profiler.enabled else None
    in_effect = {
        f"speed.{key}": value for key, value in switches.tags().items() if key != record.SPEED
    }
    diagnosis = RunDiagnosis(
        strategy,
        tree,
        flops_per_sample,
        in_effect,
        has_conv2d(model),
        activation_checkpoint.checkpointable(strategy.unwrap(model)),
    )
    name = run_name(tree, switches.summary(), overrides, run_label(cfg.parallelism))
    progress = checkpoint.Progress()
    if state is not None:
        progress = restore(state, strategy, model, optimizer, scheduler, generator)
        log.info("Resuming after epoch %d of %d from %s", progress.epoch, cfg.epochs, resume_from)
        kept = resume_from.parent if resume_from is not None else None  # rank 0's: the files
        tracker.resume(state["run_id"], progress.epoch, output_dir, kept)
        if len(state["rng"]) != strategy.shape.world_size:  # resharded on another world
            tracker.set_tags({record.RESUMED_WORLD_SIZE: str(strategy.shape.world_size)})
    elif strategy.shape.is_main and checkpoint.restarted() and (output_dir / RUN_ID_FILE).is_file():
        # restarted before its first checkpoint: the same run starts over
        tracker.resume((output_dir / RUN_ID_FILE).read_text().strip(), 0, output_dir)
    else:
        params = {
            **flatten(resolved, empty=False),  # as MLflow params (str, cut to its limit)
            **strategy.describe(),
            **strategy.precision.describe(),  # param_dtype
            record.TORCH_VERSION: torch.__version__,
            record.NUM_PARAMS: sum(p.numel() for p in model.parameters()),
            record.TRAIN_SAMPLES: len(data.train),
            record.DATA_PLACEMENT: placement,
        }
        tags = {
            **run_tags(tree, strategy.shape.world_size, overrides),
            **strategy.tags(),
            **switches.tags(),
            record.DATA_PLACEMENT: placement,
            record.DEVICE: device_label(strategy),
            record.CONFIG_HASH: config_hash(resolved),
            record.CONFIG_ID: config_id(resolved),
            record.SETTING_ID: setting_id(resolved),
            record.OUTPUT_DIR: str(output_dir.resolve()),
            record.COMPARE: record.COMPARE_LOCKSTEP if gate.slice_steps else record.COMPARE_REPEATS,
            **({record.LOCKSTEP_PROCESS: gate.process} if gate.slice_steps else {}),
        }
        tracker.start(name, params, tags)
        tracker.log_dataset(cfg.data.name, dataset_identity(cfg, data), dataset_source(cfg.data))
    if tracker.run_id:  # a failure later on is recorded on this run (tracking.record_failure)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RUN_ID_FILE).write_text(tracker.run_id)
    if strategy.shape.is_main:
        world = strategy.shape
        log.info(
            "Training %s on %s: %d process(es), %d replica(s) x %d device(s) each; output in %s",
            name, strategy.device, world.world_size, world.replicas,
            world.devices_per_replica, output_dir.resolve(),
        )  # fmt: skip
    new_model = partial(build_model, cfg.model, data.in_channels, data.num_classes, data.image_size)
    fit = Fit(
        cfg, output_dir, trainer, tracker, generator, resolved, diagnosis, profiler,
        new_model, sample_shape,
    )  # fmt: skip
    try:
        if state is None:
            _log_run_files(tracker, output_dir, resolved)
        metrics = fit(loaders, progress)
        diagnosis.finish(tracker, name)
        from accelexp.diagnosis import max_batch  # max_batch.search=true: the largest batch

        trial = max_batch.Trial(
            trainer.model, optimizer, strategy, sample_shape, data.num_classes,
            switches.memory_format,
        )  # fmt: skip
        max_batch.after_training(tree, trial, tracker)
    except lockstep_gate.Reincarnation:  # the run goes on in the next process: still RUNNING
        tracker.flush()  # what this process logged is sent before it ends
        raise
    except BaseException as error:  # KILLED by a signal or submitit's requeue, else FAILED
        tracker.end(outcome.status_of(error))
        raise
    tracker.end(outcome.FINISHED)
    diagnosis.say_noise()
    return metrics


def restore(
    state: dict,
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
) -> checkpoint.Progress:
    """A checkpoint's training state into this rank's objects (`checkpoint.restore`): its whole
    state from the main rank, or its shards, each rank reading its part (every rank calls it)."""

    def load_shards(folder: Path) -> None:
        shards = strategy.sharded_state_dict(model, optimizer)  # the shapes to read into
        checkpoint.read_shards(folder, shards)
        strategy.load_sharded_state_dict(model, optimizer, shards)

    return checkpoint.restore(
        state,
        load_model=partial(strategy.load_model_state_dict, model),
        load_optimizer=partial(strategy.load_optimizer_state_dict, model, optimizer),
        load_shards=load_shards,
        scheduler=scheduler,
        load_scaler=strategy.precision.load_state_dict,
        generator=generator,
        rank=strategy.shape.rank,
        world_size=strategy.shape.world_size,
    )


def _state_to_resume(
    cfg: Config, output_dir: Path, tracker: Tracker, strategy: Strategy, resolved: dict
) -> tuple[dict | None, Path | None]:
    """The training state to continue from (`resume`, or a restarted job's own), and its file.
    The main rank finds and reads it; the other ranks get it by broadcast, not from its disk,
    or the main rank's error, so every rank stops with the same message.

    A checkpoint that cannot be read fails its run: the run is this job's (`RUN_ID_FILE`), and
    closed FAILED with the error (`accelexp.tracking.life.record_failure`), unless it FINISHED."""
    resume_from = state = failure = None
    if strategy.shape.is_main:
        try:
            resume_from = checkpoint.find_resume(
                cfg.resume,
                output_dir,
                tracker.run_folder,
                lambda: tracker.unfinished_run_folders(config_hash(resolved)),
                lambda run_id: tracker.run_status(run_id) == outcome.FINISHED,
            )
            if resume_from is not None:
                state = checkpoint.load(resume_from)
                sharded = bool(state.get("shards"))  # resumes on another world size too
                checkpoint.check_same_training(state["config"], resolved, resume_from, sharded)
                checkpoint.adopt_best(resume_from, output_dir / "checkpoints")
        except AccelexpError as error:
            failure = error
            run_id = getattr(error, "run_id", None)
            if run_id and tracker.run_status(run_id) not in (None, outcome.FINISHED):
                output_dir.mkdir(parents=True, exist_ok=True)
                (output_dir / RUN_ID_FILE).write_text(run_id)
    state, failure = strategy.sync.broadcast_object((state, failure))
    if failure is not None:
        raise failure
    return state, resume_from


class Fit:
    """The epochs of one run, from where `progress` stands, then the best weights' test.

    Every epoch ends with its metrics logged (with where its time went: `accelexp.diagnosis`),
    the best weights kept (`best.pt`) and the whole training state written (`last.pt`, see
    `accelexp.checkpoint`). Running out of memory ends the run with one message (the peak
    reached, the ways out), not a traceback.
    """

    def __init__(
        self,
        cfg: Config,
        output_dir: Path,
        trainer: Trainer,
        tracker: Tracker,
        generator: torch.Generator,
        resolved: dict,
        diagnosis: RunDiagnosis,
        profiler: StepProfiler,
        new_model: Callable[[], nn.Module],
        sample_shape: tuple[int, int, int],
    ) -> None:
        """`new_model` builds the model afresh, on the CPU, for inputs of `sample_shape` (C, H,
        W): the best weights go into it for `mlflow.log_model`, whatever strategy, placement or
        compilation trained them."""
        self.cfg, self.trainer, self.tracker = cfg, trainer, tracker
        self.diagnosis, self.profiler = diagnosis, profiler
        self.new_model, self.sample_shape = new_model, sample_shape
        self.strategy = trainer.strategy
        self.generator, self.resolved = generator, resolved
        self.checkpoints = output_dir / "checkpoints"
        self.output_dir = output_dir

    def __call__(self, loaders: Loaders, progress: checkpoint.Progress) -> dict[str, float]:
        try:
            return self.epochs(loaders, progress)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            failure = self.diagnosis.out_of_memory(error, progress.epoch + 1)
        # raised here, not in the handler: the error's frames, and the tensors they hold, are
        # freed before a sweep's next job starts
        raise failure

    def epochs(self, loaders: Loaders, progress: checkpoint.Progress) -> dict[str, float]:
        cfg, trainer, strategy = self.cfg, self.trainer, self.strategy
        run_start = time.perf_counter() - progress.elapsed_s
        trained: list[EpochResult] = []  # the epochs this process trained
        for epoch in range(progress.epoch + 1, cfg.epochs + 1):
            strategy.placement.reset_memory_stats()
            lr = trainer.optimizer.param_groups[0]["lr"]
            with self.profiler.epoch(epoch):
                train = trainer.train_epoch(loaders.train, epoch)
            trained.append(train)
            self.diagnosis.profiled(self.profiler.collect(strategy, self.tracker))
            val_loss, val_acc = trainer.evaluate(loaders.val, "val")
            elapsed = time.perf_counter() - run_start
            memory = strategy.memory_metrics()
            per_device = train.samples_per_s / strategy.shape.world_size
            metrics = {
                record.TRAIN_LOSS: train.loss,
                record.TRAIN_ACC: train.accuracy,
                record.VAL_LOSS: val_loss,
                record.VAL_ACC: val_acc,
                record.LR: lr,
                record.EPOCH_TIME_S: train.seconds,
                record.SAMPLES_PER_S: train.samples_per_s,
                record.SAMPLES_PER_S_PER_DEVICE: per_device,
                record.TIMED_STEPS: train.timed_steps,
                **memory,
                record.GRAD_SCALE: strategy.precision.grad_scale(),
                record.COMPILE_S: train.compile_seconds,
                record.ELAPSED_S: elapsed,
                **self.diagnosis.epoch(
                    train.breakdown, per_device, memory.get(record.PEAK_MEM_MB), train.noise
                ),
            }
            self.tracker.log_metrics(metrics, step=epoch)
            self.log_slices(epoch)
            check_diverged(train, epoch, strategy.precision, lr)
            progress.epoch, progress.elapsed_s = epoch, elapsed
            if val_acc > progress.best_val_acc:
                progress.best_val_acc = val_acc
                self.save_best(epoch, val_acc)
            target = cfg.target_accuracy
            if progress.time_to_target_s is None and target and val_acc >= target:
                progress.time_to_target_s = elapsed
            self.save_last(progress)
            if strategy.shape.is_main:  # said once the epoch is logged and saved
                log.info(
                    "epoch %d/%d  train_loss %.4f  train_acc %.4f  val_loss %.4f  val_acc %.4f  "
                    "%.0f samples/s  %.1fs",
                    epoch, cfg.epochs, train.loss, train.accuracy, val_loss, val_acc,
                    train.samples_per_s, train.seconds,
                )  # fmt: skip
            renew = trainer.gate.epochs_per_process  # lockstep: a fresh process goes on
            if renew and len(trained) >= renew and epoch < cfg.epochs:
                raise lockstep_gate.Reincarnation(epoch)
        return self.test(loaders.test, progress, time.perf_counter() - run_start, trained)

    def log_slices(self, epoch: int) -> None:
        """Lockstep: the epoch's steady slices, by round (`record.LOCKSTEP_SAMPLES_PER_S`), with
        the process they ran in (`record.LOCKSTEP_INCARNATION`): its first
        `lockstep.warmup_rounds` slices are left out (and the untimed warm-up steps of a
        process's first epoch are in none)."""
        trainer = self.trainer
        if not trainer.gate.slice_steps:
            return
        steady = [s for s in trainer.slices if s.epoch == epoch]
        steady = steady[self.cfg.lockstep.warmup_rounds :]
        incarnation = float(trainer.gate.incarnation)
        self.tracker.log_series(
            {
                record.LOCKSTEP_SAMPLES_PER_S: {s.round: s.samples_per_s for s in steady},
                record.LOCKSTEP_CONTENDED: {s.round: float(s.contended) for s in steady},
                record.LOCKSTEP_INCARNATION: {s.round: incarnation for s in steady},
            }
        )

    def save_best(self, epoch: int, val_acc: float) -> None:
        """The whole model's weights; every rank takes part (FSDP gathers its shards)."""
        weights = self.strategy.model_state_dict(self.trainer.model)
        if not self.strategy.shape.is_main:
            return
        payload = {"model": weights, "epoch": epoch, "val_acc": val_acc}
        checkpoint.save(self.checkpoints / checkpoint.BEST, {**payload, "config": self.resolved})

    def save_last(self, progress: checkpoint.Progress) -> None:
        """The whole training state; every rank takes part (its RNG states are gathered; the
        model and optimizer gathered too, or each rank writes its shards of them)."""
        strategy, trainer, world = self.strategy, self.trainer, self.strategy.shape
        rng = strategy.sync.gather_object(checkpoint.rng_state(self.generator))
        model = optimizer = shards = None
        if strategy.checkpoint_sharded:
            shards = checkpoint.save_shards(
                self.checkpoints,
                strategy.sharded_state_dict(trainer.model, trainer.optimizer),
                progress.epoch, strategy.sync, world.rank, world.world_size,
            )  # fmt: skip
        else:
            model = strategy.model_state_dict(trainer.model)
            optimizer = strategy.optimizer_state_dict(trainer.model, trainer.optimizer)
        if not strategy.shape.is_main:
            return
        state = checkpoint.training_state(
            model=model,
            optimizer=optimizer,
            shards=shards,
            scheduler=trainer.scheduler,
            scaler=strategy.precision.state_dict(),
            progress=progress,
            rng=rng,
            run_id=self.tracker.run_id,
            config=self.resolved,
        )
        checkpoint.save(self.checkpoints / checkpoint.LAST, state, keep_previous=True)

    def test(
        self,
        test_loader: BatchLoader,
        progress: checkpoint.Progress,
        total_s: float,
        trained: Sequence[EpochResult] = (),
    ) -> dict[str, float]:
        """The best weights (read by the main rank, sent to the others) on the test set; and the
        run's steady-state throughput with its interval, over the epochs `trained` after the
        first (whose warm-up steps are left out, but whose caches and allocator are still
        settling), or over its only epoch."""
        strategy, trainer, cfg = self.strategy, self.trainer, self.cfg
        best = self.checkpoints / checkpoint.BEST
        weights = checkpoint.load(best)["model"] if strategy.shape.is_main else None
        strategy.load_model_state_dict(trainer.model, strategy.sync.broadcast_object(weights))
        test_loss, test_acc = trainer.evaluate(test_loader, "test")
        final = {
            record.BEST_VAL_ACC: progress.best_val_acc,
            record.TEST_LOSS: test_loss,
            record.TEST_ACC: test_acc,
            record.TOTAL_TIME_S: total_s,
            record.TIME_TO_TARGET_S: progress.time_to_target_s,
        }
        if trained:
            steady = throughput(trained[1:] or trained)  # accelexp.stats
            final |= {
                record.THROUGHPUT: steady.value,
                record.THROUGHPUT_LOW: steady.low,
                record.THROUGHPUT_HIGH: steady.high,
                record.THROUGHPUT_STEPS: steady.n,
            }
        self.tracker.log_metrics(final, step=cfg.epochs)
        if strategy.shape.is_main:
            log.info(
                "best val_acc %.4f  test_acc (best checkpoint) %.4f",
                progress.best_val_acc,
                test_acc,
            )
            target = ""
            if progress.time_to_target_s is not None:
                target = (
                    f", val_acc {cfg.target_accuracy:g} reached after "
                    f"{progress.time_to_target_s:.1f} s"
                )
            log.info("Trained in %.1f s%s; best checkpoint %s", total_s, target, best.resolve())
            if cfg.mlflow.log_checkpoint:
                self.tracker.log_artifact(best, "checkpoints")
            if cfg.mlflow.log_model:
                self.log_model(weights)
        # as logged: what a caller gets is what the MLflow UI shows
        return {k: significant(v) for k, v in final.items() if v is not None}

    def log_model(self, weights: dict[str, torch.Tensor]) -> None:
        """The best weights as an MLflow model: a fresh CPU model holding them, traced from a
        batch of two (zero) images, so the batch size of the model it loads as is free."""
        model = self.new_model()
        model.load_state_dict(weights)
        self.tracker.log_model(model.eval(), torch.zeros(2, *self.sample_shape))


def device_label(strategy: Strategy) -> str:
    """What one process computes on, for the `device` tag and the report's titles: `cpu`,
    `NVIDIA H200`, or `NVIDIA H200 x2` for a process driving two devices (dp, model)."""
    device = strategy.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    per_process = strategy.shape.world_size // strategy.shape.replicas
    return f"{name} x{per_process}" if per_process > 1 else name


def dataset_identity(cfg: Config, data: DataBundle) -> dict[str, int]:
    """What tells this training set apart from another of its name (the run input's digest):
    the sizes of its splits, the image shape, the seed of the validation hold-out, and for the
    synthetic set the seed it is generated from."""
    identity = {
        "train": len(data.train),
        "val": len(data.val),
        "test": len(data.test),
        "image_size": data.image_size,
        "channels": data.in_channels,
        "classes": data.num_classes,
        "split_seed": cfg.seed,
    }
    if cfg.data.name == "synthetic":
        identity["generator_seed"] = SYNTHETIC_SEED
    return identity


def dataset_source(data_cfg: DataConfig) -> Path | str:
    """Where the set comes from: the folder `data.root` names, else the reader that found it in
    its default places or generated it (`accelexp.data.SOURCES`)."""
    if getattr(data_cfg, "root", None):  # a StoredDataConfig's
        return Path(data_cfg.root).expanduser()
    reader = SOURCES[data_cfg.name]
    return f"{reader.__module__}.{reader.__name__}"


def _log_run_files(tracker: Tracker, output_dir: Path, resolved: dict) -> None:
    """The resolved config, and Hydra's own record of the job (config, overrides) when present."""
    if not tracker.enabled:
        return
    config_file = output_dir / "config_resolved.yaml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    tracker.log_artifact(config_file)
    tracker.log_artifact(output_dir / ".hydra", "hydra")
