"""Structured-config schema: every key of every config group, with its type and default.

Each YAML option in `conf/<group>/` names its schema in its defaults list
(`- /schema/<group>/<name>@_here_`), so Hydra rejects unknown keys and wrong types while
composing, before any code of ours runs. Range checks live in `accelexp.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from accelexp.parallel import STRATEGIES

# --- model ---------------------------------------------------------------------------------


@dataclass
class SimpleCNNConfig:
    """Two conv+pool blocks then fully connected layers (Horovod's CIFAR-10 example shape)."""

    name: str = "simple_cnn"
    channels: list[int] = field(default_factory=lambda: [32, 64])
    hidden: int = 128
    dropout: float = 0.25


@dataclass
class MLPConfig:
    """Fully connected layers of these widths on the flattened image."""

    name: str = "mlp"
    widths: list[int] = field(default_factory=lambda: [256, 128])
    dropout: float = 0.1


@dataclass
class ResNetConfig:
    """A torchvision ResNet with its head resized to the data's classes."""

    name: str = "resnet18"
    pretrained: bool = False
    # Replace the 7x7/2 stem and max-pool by a 3x3/1 conv for images smaller than this.
    small_input_max_size: int = 64


@dataclass
class ViTConfig:
    """A Vision Transformer: patches of `patch_size` px, `depth` pre-norm blocks of width `dim`."""

    name: str = "vit_tiny"
    patch_size: Any = "auto"  # auto (16 patches: 7 for 28 px, 8 for 32 px) | an integer
    dim: int = 192
    depth: int = 6
    heads: int = 3  # must divide dim
    mlp_ratio: float = 4.0
    dropout: float = 0.0


@dataclass
class TorchvisionViTConfig:
    """torchvision's ViT-B/16 resized to the data (channels, image size, classes)."""

    name: str = "vit_b_16"
    pretrained: bool = False


# --- data ----------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Keys every data option has: how the set is batched, split and held."""

    name: str = "fashion_mnist"
    batch_size: int = 128
    eval_batch_size: int = 512
    num_workers: int = 0
    # auto | true | false: hold the whole uint8 set on the device and gather batches there
    # (auto: on a GPU when it fits comfortably; on a CPU the set already is where compute is)
    on_device: Any = "auto"
    augment: bool = True
    val_fraction: float = 0.1


@dataclass
class StoredDataConfig(DataConfig):
    """A real dataset read from its files (fashion_mnist, cifar10): its shape is the files'."""

    root: str | None = None
    download: bool = True


@dataclass
class SyntheticDataConfig(DataConfig):
    """A set generated in memory: the sizes of its splits and the image shape are chosen here."""

    name: str = "synthetic"
    num_train: int = 8192
    num_test: int = 2048
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10


# --- precision / parallelism --------------------------------------------------------------


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | amp | bf16


@dataclass
class AmpConfig(PrecisionConfig):
    """fp16 autocast with a GradScaler on CUDA (a CPU runs bf16 autocast, without a scaler)."""

    name: str = "amp"
    init_scale: float = 65536.0  # the GradScaler's first loss scale
    growth_interval: int = 2000  # steps without an inf before the scale doubles


@dataclass
class ParallelismConfig:
    """Keys every strategy has; `nprocs` is the number of worker processes (one per GPU)."""

    name: str = "single"
    nprocs: int = 1
    # lr multiplier with the world size (and accumulation): linear (Horovod's rule), sqrt, none
    lr_scaling: str = "linear"
    # micro-batches per optimizer step (DDP: no_sync between; Horovod: backward_passes_per_step)
    accumulate_steps: int = 1
    # true: start more CPU workers (and threads, loader processes) than this machine's usable
    # cores; refused otherwise, since they would only share the cores and run slower
    oversubscribe: bool = False


@dataclass
class DataParallelConfig(ParallelismConfig):
    """torch.nn.DataParallel: one process, `devices` GPUs (null: all visible)."""

    name: str = "dp"
    devices: list[int] | None = None


@dataclass
class DDPConfig(ParallelismConfig):
    name: str = "ddp"
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    sync_batchnorm: bool = False
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    find_unused_parameters: bool = False
    comm_hook: str = "none"  # none | fp16 | bf16: gradient compression for the allreduce
    master_port: int | None = None  # rendezvous port when accelexp starts the workers; None: free
    max_restarts: int = 0  # torchrun restarts the workers this often after a failure; they resume


@dataclass
class FSDPConfig(ParallelismConfig):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over workers."""

    name: str = "fsdp"
    nprocs: int = 2
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    granularity: str = "block"  # block: one FSDP unit per block of the layer sequence | model
    reshard_after_forward: bool = True  # free gathered parameters after each unit's forward
    reduce_in_fp32: bool = True  # reduce-scatter gradients in fp32 under bf16/amp
    cpu_offload: bool = False  # shards in host memory (CUDA only)
    master_port: int | None = None  # rendezvous port when accelexp starts the workers; None: free
    max_restarts: int = 0  # torchrun restarts the workers this often after a failure; they resume


@dataclass
class HorovodConfig(ParallelismConfig):
    name: str = "horovod"
    compression: str = "none"  # none | fp16
    op: str = "average"  # average | adasum


@dataclass
class PipelineFields:
    """How a model is cut into stages and fed with micro-batches (model and hybrid)."""

    stages: int | None = 2
    chunks: int = 1  # micro-batches per batch (GPipe); 1: plain sequential model parallelism
    balance: str = "params"  # params | compute (measured forward time per layer)
    split_points: list[int] | None = None  # layer indices starting stages 1..; None: balanced


@dataclass
class ModelParallelConfig(PipelineFields, ParallelismConfig):
    """One process; stage k on devices[k % len(devices)] (None: one GPU each, or the CPU)."""

    name: str = "model"
    devices: list[str] | None = None


@dataclass
class HybridConfig(PipelineFields, HorovodConfig, DDPConfig):
    """`nprocs` replicas, each a model-parallel pipeline over `devices_per_replica` devices."""

    name: str = "hybrid"
    nprocs: int = 2
    engine: str = "ddp"  # ddp | horovod: what keeps the replicas in sync
    devices_per_replica: int = 2
    stages: int | None = None  # None: one stage per device of the replica


# --- speed switches -----------------------------------------------------------------------


@dataclass
class SpeedConfig:
    """Switches that change how fast a run goes, never what it computes (beyond rounding)."""

    channels_last: Any = "auto"  # auto (on with CUDA for a conv model) | true | false
    cudnn_benchmark: bool = True  # autotune conv algorithms for the run's fixed shapes
    tf32: bool = False  # TF32 for fp32 matmuls and convolutions (Ampere+); false: IEEE fp32
    compile: str = "off"  # off | default | reduce-overhead (CUDA graphs) | max-autotune
    optimizer_impl: str = "auto"  # auto (torch's choice) | for_loop | foreach | fused


# --- optimizer -----------------------------------------------------------------------------


@dataclass
class SGDConfig:
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = False


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01


# --- scheduler (stepped once per optimizer step; lengths are in epochs) --------------------


@dataclass
class SchedulerConfig:
    name: str = "none"
    warmup_epochs: float = 0.0
    warmup_start_factor: float = 0.1


@dataclass
class StepLRConfig(SchedulerConfig):
    name: str = "steplr"
    step_size: int = 30
    gamma: float = 0.1


@dataclass
class CosineConfig(SchedulerConfig):
    name: str = "cosine"
    min_lr_factor: float = 0.0


@dataclass
class OneCycleConfig(SchedulerConfig):
    """torch's OneCycleLR; `warmup_epochs` sets its rising phase (pct_start) when > 0."""

    name: str = "onecycle"
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4


# --- top level ----------------------------------------------------------------------------


@dataclass
class MlflowConfig:
    tracking_uri: str = "sqlite:///outputs/mlflow.db"
    experiment: str = "accelexp"
    run_name: str | None = None  # None: derived from the choices, e.g. simple_cnn-single-amp
    # None: `mlartifacts/` beside a SQLite store; the server's default for a tracking server
    artifact_location: str | None = None
    log_checkpoint: bool = False
    log_model: bool = False  # the best weights as an MLflow model (mlflow.pytorch): disk, time
    log_system_metrics: bool = False
    tags: dict[str, str] = field(default_factory=dict)  # extra tags for the run, e.g. a study's


@dataclass
class ProfilerConfig:
    """`profile=true`: torch.profiler on every rank for a few steps of one epoch."""

    epoch: int = 1  # the epoch profiled (its steps are numbered from 1)
    wait: int = 1  # steps skipped first
    warmup: int = 1  # steps traced but discarded (the profiler's own start-up)
    active: int = 3  # steps recorded into the trace
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False


@dataclass
class MaxBatchConfig:
    """`search=true`: after training, on a CUDA GPU, double the per-worker batch from
    data.batch_size until a training step runs out of memory (accelexp.diagnosis.max_batch)."""

    search: bool = False
    limit: int = 65536  # the largest per-worker batch tried


@dataclass
class DebugConfig:
    raise_on_rank: int | None = None
    raise_at_step: int = 1
    input_delay_ms: float = 0.0  # each training batch arrives this much later (a slow pipeline)
    raise_oom_at_step: int | None = None  # a real torch.OutOfMemoryError raised at this step


@dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    parallelism: Any = MISSING
    precision: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    seed: int = 42
    # each configuration of a sweep run this many times, round-robin (accelexp.sweeper)
    repeats: int = 1
    repeat_seed: str = "same"  # same: speed noise alone | vary: seed + repeat_index (accuracy)
    repeat_index: int = 0  # which repeat this job is (set by the sweeper)
    epochs: int = 5
    max_steps_per_epoch: int | None = None
    target_accuracy: float | None = None
    device: str = "auto"  # auto | cpu | cuda
    threads: int | None = None  # torch intra-op threads; None leaves torch's default
    deterministic: bool = False
    progress: bool = True
    log_every_n_steps: int = 20
    resume: str | None = None  # auto | <MLflow run id> | <run folder or last.pt>: continue a run
    profile: bool = False  # torch.profiler traces of a few steps (see `profiler`), MLflow artifacts
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    max_batch: MaxBatchConfig = field(default_factory=MaxBatchConfig)  # the largest batch that fits
    # test hooks: a crashed worker, a slow input pipeline, an out-of-memory error, on purpose
    debug: DebugConfig = field(default_factory=DebugConfig)


SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "simple_cnn": SimpleCNNConfig,
        "mlp": MLPConfig,
        "resnet": ResNetConfig,
        "vit": ViTConfig,
        "torchvision_vit": TorchvisionViTConfig,
    },
    "data": {"stored": StoredDataConfig, "synthetic": SyntheticDataConfig},
    "precision": {"precision": PrecisionConfig, "amp": AmpConfig},
    "parallelism": {
        "single": ParallelismConfig,
        "dp": DataParallelConfig,
        "ddp": DDPConfig,
        "fsdp": FSDPConfig,
        "horovod": HorovodConfig,
        "model": ModelParallelConfig,
        "hybrid": HybridConfig,
    },
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig},
    "scheduler": {
        "none": SchedulerConfig,
        "steplr": StepLRConfig,
        "cosine": CosineConfig,
        "onecycle": OneCycleConfig,
    },
}


# one schema per strategy of the strategy table, and no other
assert SCHEMAS["parallelism"].keys() == STRATEGIES.keys(), "parallelism schemas != STRATEGIES"


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
