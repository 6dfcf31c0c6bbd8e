"""The config's schema: one dataclass per option of every config group and per section, every
key with its type, default, help and what it affects (`accelexp.keys`); `Config` is the whole.

`accelexp.train` turns the validated config into these dataclasses once (`accelexp.config.typed`)
and hands each layer the part it needs: `build_model(cfg.model: ModelConfig)`,
`build_data(cfg.data: DataConfig)`, `build_optimizer(cfg.optimizer: OptimizerConfig)`...

Each YAML option in `conf/<group>/` names its schema in its defaults list
(`- /schema/<group>/<name>@_here_`), so Hydra rejects unknown keys and wrong types while
composing, before any code of ours runs (`accelexp.config.schema.SCHEMAS`, registered by
`accelexp.config.store`). Range checks live in `accelexp.config.validate`; `--help` shows each
key's help, and which keys a run's identity leaves out follows from what they affect
(`accelexp.config.identity`). The `parallelism` group's dataclasses are `parallel/`'s
(`accelexp.parallel.config`): that group is parallel/'s whole.

A leaf: imports nothing of accelexp but the key declarations and the objectives' names
(`accelexp.objective`), nor Hydra or torch, so the builders below the config (models, data,
optim, speed), the config's checks and the report all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from accelexp import objective
from accelexp.keys import Affects, key, like, option_name, section
from accelexp.precision import Name

RESULTS, SPEED, NOTHING = Affects.RESULTS, Affects.SPEED, Affects.NOTHING

# --- model ---------------------------------------------------------------------------------


@dataclass
class SimpleCNNConfig:
    """Two conv+pool blocks then fully connected layers (Horovod's CIFAR-10 example shape)."""

    name: str = option_name("simple_cnn")
    channels: list[int] = key([32, 64], "output channels of the two conv+pool blocks")
    hidden: int = key(128, "width of the fully connected hidden layer")
    dropout: float = key(0.25, "dropout probability before the last layer")


@dataclass
class MLPConfig:
    """Fully connected layers of these widths on the flattened image."""

    name: str = option_name("mlp")
    widths: list[int] = key([256, 128], "widths of the hidden layers, in order")
    dropout: float = key(0.1, "dropout probability after each hidden layer")


@dataclass
class ResNetConfig:
    """A torchvision ResNet with its head resized to the data's classes."""

    name: str = option_name("resnet18")
    pretrained: bool = key(False, "start from torchvision's ImageNet weights (downloaded once)")
    small_input_max_size: int = key(
        64, "images up to this size get a 3x3/1 conv stem instead of 7x7/2 and max-pool"
    )


@dataclass
class ViTConfig:
    """A Vision Transformer: patches of `patch_size` px, `depth` pre-norm blocks of width `dim`."""

    name: str = option_name("vit_tiny")
    patch_size: Any = key("auto", "patch side in px; auto: 16 patches (7 for 28 px, 8 for 32 px)")
    dim: int = key(192, "embedding width of every block")
    depth: int = key(6, "number of transformer blocks")
    heads: int = key(3, "attention heads per block; must divide dim")
    mlp_ratio: float = key(4.0, "hidden width of each block's MLP, as a multiple of dim")
    dropout: float = key(0.0, "dropout probability in the blocks and on the embeddings")


@dataclass
class TorchvisionViTConfig:
    """torchvision's ViT-B/16 resized to the data (channels, image size, classes)."""

    name: str = option_name("vit_b_16")
    pretrained: bool = like(ResNetConfig, "pretrained")


ModelConfig = SimpleCNNConfig | MLPConfig | ResNetConfig | ViTConfig | TorchvisionViTConfig
"""A `model` option's keys (the type `build_model` takes)."""

# --- data ----------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Keys every data option has: how the set is batched, split and held."""

    name: str = option_name("fashion_mnist")
    batch_size: int = key(128, "training samples per step on each worker")
    eval_batch_size: int = key(512, "samples per step when evaluating (no gradients)", RESULTS)
    num_workers: int = key(0, "DataLoader processes gathering batches on the host")
    on_device: Any = key("auto", "hold the set on the device; auto: on a GPU if it fits")
    augment: bool = key(True, "random crops and flips of the training images")
    val_fraction: float = key(0.1, "share of the training set held out for validation")


@dataclass
class StoredDataConfig(DataConfig):
    """A real dataset read from its files (fashion_mnist, cifar10): its shape is the files'."""

    root: str | None = key(None, "the dataset's folder; null: the default places", RESULTS)
    download: bool = key(True, "download the files when they are missing", RESULTS)


@dataclass
class SyntheticDataConfig(DataConfig):
    """A set generated in memory: the sizes of its splits and the image shape are chosen here."""

    name: str = option_name("synthetic")
    num_train: int = key(8192, "training samples (validation included)")
    num_test: int = key(2048, "test samples", RESULTS)
    image_size: int = key(32, "image height and width in px")
    channels: int = key(3, "image channels")
    num_classes: int = key(10, "number of classes")


# --- precision ----------------------------------------------------------------------------


@dataclass
class PrecisionConfig:
    """fp32, amp, bf16, bf16_true or fp8: the dtypes of the forward and backward passes and of
    the weights (accelexp.precision); only amp has keys of its own."""

    name: str = option_name(Name.FP32.value)


@dataclass
class AmpConfig(PrecisionConfig):
    """fp16 autocast with a GradScaler on CUDA (a CPU runs bf16 autocast, without a scaler)."""

    name: str = option_name(Name.AMP.value)
    init_scale: float = key(65536.0, "the GradScaler's first loss scale")
    growth_interval: int = key(2000, "steps without an inf before the loss scale doubles")


# --- speed switches -----------------------------------------------------------------------


@dataclass
class SpeedConfig:
    """Switches that change how fast a run goes, never what it computes (beyond rounding)."""

    channels_last: Any = key("auto", "NHWC memory layout; auto: on with CUDA for a conv model")
    cudnn_benchmark: bool = key(True, "autotune conv algorithms for the run's fixed shapes")
    tf32: bool = key(False, "TF32 matmuls and convolutions (Ampere+); false: IEEE fp32")
    compile: str = key(
        "off", "torch.compile mode", choices=("off", "default", "reduce-overhead", "max-autotune")
    )
    optimizer_impl: str = key(
        "auto", "optimizer kernels", choices=("auto", "for_loop", "foreach", "fused")
    )
    activation_checkpointing: str = key(
        "none",
        "recompute blocks' activations in the backward: less memory, more compute",
        choices=("none", "full", "selective"),
    )
    selective_ac_option: str = key(
        "2", "under selective: k (every k-th block) or op (keep matmul/conv outputs)"
    )
    heap: str = key(
        "auto",
        "glibc malloc's thresholds: pinned (a CPU run's speed independent of its history) or "
        "dynamic (glibc's default); auto: pinned on a CPU",
        SPEED,
        choices=("auto", "pinned", "dynamic"),
    )


# --- optimizer -----------------------------------------------------------------------------


@dataclass
class SGDConfig:
    """SGD with momentum (torch.optim.SGD)."""

    name: str = option_name("sgd")
    lr: float = key(0.1, "lr of one worker (scaled by parallelism.lr_scaling)")
    momentum: float = key(0.9, "momentum factor")
    weight_decay: float = key(5e-4, "L2 penalty")
    nesterov: bool = key(False, "Nesterov momentum")


@dataclass
class AdamWConfig:
    """AdamW (torch.optim.AdamW): Adam with decoupled weight decay."""

    name: str = option_name("adamw")
    lr: float = like(SGDConfig, "lr", 1e-3)
    betas: list[float] = key([0.9, 0.999], "decay rates of the gradient's running averages")
    eps: float = key(1e-8, "added to the denominator for numerical stability")
    weight_decay: float = key(0.01, "decoupled weight decay")


OptimizerConfig = SGDConfig | AdamWConfig
"""An `optimizer` option's keys (the type `build_optimizer` takes)."""

# --- scheduler (stepped once per optimizer step; lengths are in epochs) --------------------


@dataclass
class SchedulerConfig:
    """A constant learning rate, after the warm-up."""

    name: str = option_name("none")
    warmup_epochs: float = key(0.0, "epochs of linear warm-up to the full lr")
    warmup_start_factor: float = key(0.1, "the warm-up's first lr, as a fraction of the full lr")


@dataclass
class StepLRConfig(SchedulerConfig):
    """The lr times `gamma` every `step_size` epochs."""

    name: str = option_name("steplr")
    step_size: int = key(30, "epochs between two decays")
    gamma: float = key(0.1, "factor of each decay")


@dataclass
class CosineConfig(SchedulerConfig):
    """Cosine decay of the lr over the run."""

    name: str = option_name("cosine")
    min_lr_factor: float = key(0.0, "the final lr, as a fraction of the full lr")


@dataclass
class OneCycleConfig(SchedulerConfig):
    """torch's OneCycleLR; `warmup_epochs` sets its rising phase (pct_start) when > 0."""

    name: str = option_name("onecycle")
    pct_start: float = key(0.3, "share of the run spent raising the lr")
    div_factor: float = key(25.0, "the first lr is the maximum lr divided by this")
    final_div_factor: float = key(1e4, "the last lr is the first lr divided by this")


# --- top level ----------------------------------------------------------------------------


@dataclass
class MlflowConfig:
    """Where and how the run is recorded in MLflow."""

    tracking_uri: str = key("sqlite:///outputs/mlflow.db", "MLflow store: a SQLite file or a URL")
    experiment: str = key("accelexp", "MLflow experiment the run is recorded in")
    run_name: str | None = key(None, "null: from the choices, e.g. simple_cnn-single-amp")
    artifact_location: str | None = key(
        None, "null: mlartifacts/ beside a SQLite store, else the server's"
    )
    log_checkpoint: bool = key(False, "log the checkpoints as artifacts")
    log_model: bool = key(False, "the best weights as an MLflow model (disk, time)")
    log_system_metrics: bool = key(False, "MLflow's CPU, GPU and memory metrics while running")
    tags: dict[str, str] = key({}, "extra tags for the run, e.g. a study's")
    outage_budget_s: float = key(
        300.0,
        "seconds a tracking server may be gone mid-run: training goes on, its records wait; "
        "longer stops the run, resume to continue",
    )


@dataclass
class ProfilerConfig:
    """`profile=true`: torch.profiler on every rank for a few steps of one epoch."""

    epoch: int = key(1, "the epoch profiled (its steps are numbered from 1)")
    wait: int = key(1, "steps skipped first")
    warmup: int = key(1, "steps traced but discarded (the profiler's own start-up)")
    active: int = key(3, "steps recorded into the trace")
    record_shapes: bool = key(False, "record the input shapes of each operator")
    profile_memory: bool = key(False, "record tensor allocations and frees")
    with_stack: bool = key(False, "record the Python stack of each operator")


@dataclass
class MaxBatchConfig:
    """`search=true`: after training, on a CUDA GPU, double the per-worker batch from
    data.batch_size until a training step runs out of memory (accelexp.diagnosis.max_batch)."""

    search: bool = key(False, "after training, on CUDA: double the batch until out of memory")
    limit: int = key(65536, "the largest per-worker batch tried")
    device_mem_gb: float | None = key(
        None, "the forecast's largest batch fits this much device memory (GiB); null: the GPU's"
    )


@dataclass
class AutotuneConfig:
    """`-m +experiment=autotune`: the verdict's advice tried in short measured runs, each kept
    only when faster beyond doubt at no cost in accuracy (accelexp.autotune)."""

    budget_s: float = key(1800.0, "no trial starts once this many seconds have passed")
    max_trials: int = key(40, "no trial run starts after this many")
    accuracy_tolerance: float = key(
        0.01, "a candidate whose test accuracy is lower by more than this is rejected"
    )
    freeze: list[str] = key([], "keys autotune never changes, e.g. [data.batch_size,parallelism]")


@dataclass
class LockstepConfig:
    """`compare=lockstep`: a sweep's configurations as live jobs taking turns (lockstep)."""

    process: str = key(
        "auto",
        "shared: every job a thread of one process (no per-process bias); own: a process each; "
        "auto: shared where every job is one process that does not compile",
        choices=("auto", "shared", "own"),
    )
    slice_steps: int = key(8, "training steps in one job's turn (a slice)")
    slice_s: float | None = key(
        None,
        "seconds in a slice: each job's steps per slice sized from its first timed slice, so "
        "jobs whose steps differ in length sample the host alike; null: slice_steps throughout",
    )
    warmup_rounds: int = key(2, "rounds of each epoch left out of the ratios (caches, allocator)")
    epochs_per_process: int | None = key(
        1, "a one-process job goes on in a fresh process after this many epochs; null: never"
    )
    turn_timeout_s: float = key(
        600.0,
        "a job that holds its turn this long without handing it back is hung: it is stopped "
        "and named, the others go on (a turn also holds its evaluation and checkpoint)",
    )


@dataclass
class DebugConfig:
    """Test hooks: a crashed worker, a slow input pipeline, an out-of-memory error, on purpose."""

    raise_on_rank: int | None = key(None, "this rank raises an error at raise_at_step")
    raise_at_step: int = key(1, "the step raise_on_rank raises at")
    raise_as: str = key(
        "error",
        "how raise_on_rank fails: an error, or death by SIGKILL (as the OOM killer's)",
        choices=("error", "SIGKILL"),
    )
    input_delay_ms: float = key(0.0, "each training batch arrives this much later")
    raise_oom_at_step: int | None = key(None, "a real torch.OutOfMemoryError at this step")


@dataclass
class Config:
    """The whole config: one option of each config group, then the top-level keys."""

    model: Any = key(MISSING, "the model (conf/model/)")
    data: Any = key(MISSING, "the dataset and how it is batched (conf/data/)")
    parallelism: Any = key(MISSING, "the strategy and its workers (conf/parallelism/)")
    precision: Any = key(MISSING, "fp32, amp, bf16, bf16_true or fp8 (conf/precision/)")
    optimizer: Any = key(MISSING, "the optimizer (conf/optimizer/)")
    scheduler: Any = key(MISSING, "the lr schedule (conf/scheduler/)")
    mlflow: MlflowConfig = section(MlflowConfig, "where the run is recorded", NOTHING)
    speed: SpeedConfig = section(SpeedConfig, "switches that change how fast a run goes")
    seed: int = key(42, "seed of the weights, the data's split and order, augmentation", RESULTS)
    repeats: int = key(
        1, "each configuration of a sweep runs this many times, round-robin", NOTHING
    )
    repeat_seed: str = key(
        "same",
        "repeats' seeds (same: speed noise alone; vary: seed + i)",
        NOTHING,
        ("same", "vary"),
    )
    repeat_index: int = key(0, "which repeat this job is (set by the sweeper)", RESULTS)
    compare: str = key(
        "repeats",
        "how a sweep pairs its configurations: whole runs round-robin, or live jobs taking turns",
        NOTHING,
        ("repeats", "lockstep"),
    )
    precision_target: float | None = key(
        None,
        "a sweep adds repeats until each ratio's 95 % half-width is at most this over 5+ repeats",
        NOTHING,
    )
    max_repeats: int = key(10, "precision_target's budget: at most this many repeats", NOTHING)
    objective: Any = key(
        objective.DEFAULT,
        "what run.py returns to a sweeper (Optuna), or a list of them",
        NOTHING,
        objective.NAMES,
    )
    epochs: int = key(5, "epochs to train")
    max_steps_per_epoch: int | None = key(None, "cut each epoch after this many steps")
    target_accuracy: float | None = key(
        None, "log time_to_target_s when val_acc first reaches it; null: off", RESULTS
    )
    device: str = key("auto", "what to compute on", RESULTS, ("auto", "cpu", "cuda"))
    threads: int | None = key(None, "torch intra-op threads; null: torch's default", SPEED)
    deterministic: bool = key(
        False, "deterministic algorithms; also turns cuDNN autotuning and TF32 off"
    )
    progress: bool = key(True, "a progress bar per epoch", NOTHING)
    log_every_n_steps: int = key(
        20, "progress figures every this many steps (after 1, 2, 4...)", NOTHING
    )
    resume: str | None = key(
        None,
        "continue a run: auto, an MLflow run id, a run folder or last.pt (sharded: any nprocs)",
        NOTHING,
    )
    profile: bool = key(False, "torch.profiler traces of a few steps, logged to MLflow", SPEED)
    estimate: bool = key(
        False, "print one step's memory per device (fake tensors) instead of training", NOTHING
    )
    profiler: ProfilerConfig = section(ProfilerConfig, "what profile true traces", SPEED)
    max_batch: MaxBatchConfig = section(MaxBatchConfig, "the largest batch that fits", NOTHING)
    autotune: AutotuneConfig = section(AutotuneConfig, "the autotune loop's budget", NOTHING)
    lockstep: LockstepConfig = section(
        LockstepConfig, "the turns of a lockstep comparison", NOTHING
    )
    debug: DebugConfig = section(DebugConfig, "test hooks", SPEED)
