"""The `parallelism` config group's keys: one dataclass per preset of the strategy table
(`accelexp.parallel.STRATEGIES` holds each preset's), each key with its type, default, help and
what it affects (`accelexp.keys`). `accelexp.config.schema` registers them with the other groups'.

Torch-free, and imports nothing of accelexp but the key declarations: the config checks, `--help`
and the report read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelexp.keys import Affects, key, like, option_name


@dataclass
class ParallelismConfig:
    """Keys every strategy has: its two parts (`accelexp.parallel`: each option is a preset of
    a pair, its other keys that pair's); `nprocs` is the number of worker processes (one per
    GPU)."""

    name: str = option_name("single")
    placement: str = key("one device", "where a replica's layers live: the option's")
    sync: str = key("none", "how the replicas agree: the option's")
    nprocs: int = key(1, "worker processes (one per GPU)")
    lr_scaling: str = key(
        "linear", "lr scaling with the world size", choices=("linear", "sqrt", "none")
    )
    accumulate_steps: int = key(1, "micro-batches per optimizer step")
    oversubscribe: bool = key(
        False, "more CPU workers than usable cores (else refused)", affects=Affects.SPEED
    )


@dataclass
class DataParallelConfig(ParallelismConfig):
    """torch.nn.DataParallel: one process, `devices` GPUs (null: all visible)."""

    name: str = option_name("dp")
    placement: str = like(ParallelismConfig, "placement", "dataparallel")
    devices: list[int] | None = key(None, "GPU indices to use; null: all visible")


@dataclass
class DDPConfig(ParallelismConfig):
    """torch DistributedDataParallel: one process per device, gradients allreduced in buckets."""

    name: str = option_name("ddp")
    sync: str = like(ParallelismConfig, "sync", "ddp")
    backend: str = key(
        "auto", "process group (auto: nccl on CUDA)", choices=("auto", "nccl", "gloo")
    )
    sync_batchnorm: bool = key(False, "batch-norm statistics over all workers")
    bucket_cap_mb: float = key(25.0, "MB of gradients allreduced together")
    static_graph: bool = key(False, "same parameters used every step (DDP optimizes)")
    find_unused_parameters: bool = key(False, "look for parameters a step did not use")
    comm_hook: str = key("none", "allreduce compression", choices=("none", "fp16", "bf16"))
    master_port: int | None = key(None, "workers' rendezvous port; null: a free one")
    max_restarts: int = key(0, "torchrun restarts after a failure (workers resume)")


@dataclass
class FSDPConfig(ParallelismConfig):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over workers."""

    name: str = option_name("fsdp")
    sync: str = like(ParallelismConfig, "sync", "fsdp")
    nprocs: int = like(ParallelismConfig, "nprocs", 2)
    backend: str = like(DDPConfig, "backend")
    granularity: str = key("block", "FSDP units: block (one per block of layers), model")
    reshard_after_forward: bool = key(True, "free gathered parameters after each forward")
    reduce_in_fp32: bool = key(True, "reduce-scatter gradients in fp32 under bf16 or amp")
    cpu_offload: bool = key(False, "keep the shards in host memory (CUDA only)")
    master_port: int | None = like(DDPConfig, "master_port")
    max_restarts: int = like(DDPConfig, "max_restarts")


@dataclass
class HorovodConfig(ParallelismConfig):
    """Horovod: one process per device, gradients allreduced by horovodrun's workers."""

    name: str = option_name("horovod")
    sync: str = like(ParallelismConfig, "sync", "horovod")
    compression: str = key("none", "allreduce compression", choices=("none", "fp16"))
    op: str = key("average", "how gradients are combined", choices=("average", "adasum"))


@dataclass
class PipelineFields:
    """How a model is cut into stages and fed with micro-batches (model and hybrid)."""

    stages: int | None = key(2, "pipeline stages the layers are cut into")
    chunks: int = key(1, "micro-batches per batch (GPipe); 1: no pipelining")
    balance: str = key("params", "stages balanced by", choices=("params", "compute"))
    split_points: list[int] | None = key(None, "layers starting stages 1, 2...; null: balanced")


@dataclass
class ModelParallelConfig(PipelineFields, ParallelismConfig):
    """One process; stage k on devices[k % len(devices)] (None: one GPU each, or the CPU)."""

    name: str = option_name("model")
    placement: str = like(ParallelismConfig, "placement", "stages")
    devices: list[str] | None = key(None, "devices of the stages, in turn; null: a GPU each or CPU")


@dataclass
class HybridConfig(PipelineFields, HorovodConfig, DDPConfig):
    """`nprocs` replicas, each a model-parallel pipeline over `devices_per_replica` devices."""

    name: str = option_name("hybrid")
    placement: str = like(ParallelismConfig, "placement", "stages")
    sync: str = key("ddp", "how the replicas agree: ddp, horovod")
    nprocs: int = like(ParallelismConfig, "nprocs", 2)
    devices_per_replica: int = key(2, "devices each replica's pipeline spans")
    stages: int | None = key(None, "pipeline stages per replica; null: one per device")


# the schedules of torch.distributed.pipelining `parallelism=pipeline` offers (the installed
# torch's: `stages_per_rank.SCHEDULES`), and the virtual stages each rank holds under each
PIPELINE_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}


@dataclass
class PipelineConfig(ParallelismConfig):
    """Stages across ranks (torch.distributed.pipelining): `nprocs` processes, pipelines of `pp`
    ranks (null: one pipeline of all of them), pipeline rank p holding stage p (interleaved
    schedules: stages p and p + pp), activations sent between the processes; a schedule drives
    each step's micro-batches. nprocs / pp pipelines are data-parallel replicas: a 2-D mesh
    `pp` x `dp`, each stage's gradients averaged over `dp` (`dp_shard`: each stage sharded
    over `dp` by FSDP2, torchtitan's pp x fsdp)."""

    name: str = option_name("pipeline")
    placement: str = like(ParallelismConfig, "placement", "stages per rank")
    sync: str = like(ParallelismConfig, "sync", "p2p")
    nprocs: int = like(ParallelismConfig, "nprocs", 2)
    schedule: str = key(
        "1f1b",
        "micro-batch order: gpipe, 1f1b, interleaved_1f1b, zero_bubble (interleaved: 2 "
        "stages per rank)",
        choices=tuple(PIPELINE_SCHEDULES),
    )
    microbatches: int = key(4, "micro-batches per batch, pipelined by the schedule")
    pp: int | None = key(
        None,
        "ranks per pipeline; null: all nprocs. Fewer: nprocs / pp pipelines in data "
        "parallel (gradients averaged over the mesh's dp dimension)",
    )
    dp_shard: bool = key(
        False,
        "shard each stage over the dp dimension (FSDP2: its parameters, gradients and "
        "optimizer state split over the pipelines); false: each pipeline a whole copy",
    )
    backend: str = like(DDPConfig, "backend")
    master_port: int | None = like(DDPConfig, "master_port")
    max_restarts: int = like(DDPConfig, "max_restarts")
