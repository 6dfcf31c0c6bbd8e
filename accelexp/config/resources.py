"""What this machine can hold, checked before any worker starts (`launch` calls it).

`check_resources(cfg, workers)`: cores for the workers, their threads and loader processes
(unless `parallelism.oversubscribe=true`), memory for the data and the model, a full batch in
every worker's share of the training set, what the strategy needs of the machine (GPUs for a
NCCL backend, for FSDP's offloading: `accelexp.parallel.rules.resource_problems`), and fp8
tensor cores for `precision=fp8` (a CUDA GPU of compute capability >= 8.9:
`accelexp.precision.fp8_problem`).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from accelexp.errors import ConfigError
from accelexp.parallel import rules as strategy_rules
from accelexp.precision import Name, fp8_problem

if TYPE_CHECKING:
    from accelexp.data.sources import SetShape


def check_resources(cfg: DictConfig, workers: int = 1) -> None:
    """Raise `ConfigError` when this machine cannot run `cfg` with `workers` processes of it."""
    import torch

    gpus = torch.cuda.device_count() if cfg.device != "cpu" else 0
    problems = [
        *_core_problems(cfg, workers, on_cpu=not gpus),
        *_shard_problems(cfg, workers),
        *_memory_problems(cfg, workers, on_cpu=not gpus),
    ]
    problems += strategy_rules.resource_problems(cfg, gpus)
    problems += _precision_problems(cfg, gpus)
    if problems:
        raise ConfigError("Cannot run this configuration here:\n" + "\n".join(problems))


def _precision_problems(cfg: DictConfig, gpus: int) -> list[str]:
    """fp8 matmuls on a machine without fp8 tensor cores (every visible GPU's capability)."""
    if cfg.precision.name != Name.FP8:
        return []
    import torch

    capabilities = [torch.cuda.get_device_capability(i) for i in range(gpus)]
    problem = fp8_problem("cuda" if gpus else "cpu", capabilities)
    return [f"  {problem}"] if problem else []


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def _core_problems(cfg: DictConfig, workers: int, on_cpu: bool) -> list[str]:
    if cfg.parallelism.get("oversubscribe"):
        return []
    cores, problems = usable_cores(), []
    force = "or parallelism.oversubscribe=true to run it anyway (slower, not faster)"
    if on_cpu and workers > cores:
        problems.append(
            f"  parallelism.nprocs={workers} CPU workers, but this process may use {cores} "
            f"cores: use parallelism.nprocs<={cores}, {force}."
        )
    if cfg.threads and cfg.threads * workers > cores and workers <= cores:
        each = f" for each of {workers} workers" if workers > 1 else ""
        problems.append(
            f"  threads={cfg.threads}{each} is more than the {cores} usable cores: use "
            f"threads<={max(1, cores // workers)} (or null: chosen for you), {force}."
        )
    if cfg.data.num_workers > cores:
        problems.append(
            f"  data.num_workers={cfg.data.num_workers} loader processes is more than the "
            f"{cores} usable cores: use data.num_workers<={cores}, {force}."
        )
    return problems


def _shard_problems(cfg: DictConfig, workers: int) -> list[str]:
    """A full batch in each worker's share (DistributedSampler: ceil(n / workers) samples)."""
    from accelexp.data.sources import set_shape

    shape = set_shape(cfg.data)
    if shape is None:
        return []
    n_train = shape.num_train - int(shape.num_train * cfg.data.val_fraction)
    share = math.ceil(n_train / workers)
    if share >= cfg.data.batch_size:
        return []
    where = (
        f"each of the {workers} workers' share of the training set ({share} of {n_train} samples)"
        if workers > 1
        else f"the training set ({n_train} samples)"
    )
    return [
        f"  data.batch_size={cfg.data.batch_size} is larger than {where}: no full batch can be "
        f"formed. Use data.batch_size<={max(1, share)}"
        + (", or fewer parallelism.nprocs." if workers > 1 else ".")
    ]


def _memory_problems(cfg: DictConfig, workers: int, on_cpu: bool) -> list[str]:
    """Data and model that cannot fit in this machine's memory (only what surely cannot)."""
    from accelexp.data.sources import set_shape

    available = _available_memory()
    shape = set_shape(cfg.data)
    if available is None or shape is None:
        return []
    synthetic = cfg.data.name == "synthetic"  # the only set whose sizes are keys of `data`
    data_bytes = shape.peak_bytes(synthetic)
    params = _parameter_count(cfg, shape)
    # fp32 weights; on a CPU also their gradients and up to two optimizer states (on a GPU
    # those live in its memory, which this does not check)
    model_bytes = 4 * params * (4 if on_cpu else 1)
    need = workers * (data_bytes + model_bytes)
    if need <= available:
        return []
    per = f" for each of {workers} workers" if workers > 1 else ""
    images = f"images of {shape.channels}x{shape.image_size}x{shape.image_size}"
    if model_bytes >= data_bytes:
        what = (
            f"a model of {params:.3g} parameters ({_size(model_bytes)}{per}): use a smaller "
            f"model (model.hidden, model.widths, model.channels)"
            + (" or smaller data.image_size" if synthetic else "")
        )
    elif synthetic:
        what = (
            f"a data set of {_size(data_bytes)}{per} (data.num_train={shape.num_train}, "
            f"data.num_test={shape.num_test} {images}): use a smaller data.num_train, num_test, "
            f"image_size or channels"
        )
    else:  # a real set's size is its files'
        what = (
            f"data={cfg.data.name}, {_size(data_bytes)}{per} ({shape.num_train} + "
            f"{shape.num_test} {images}): use "
            + ("fewer parallelism.nprocs" if workers > 1 else "a machine with more memory")
        )
    return [
        f"  the run needs about {_size(need)} of memory, but this machine has {_size(available)} "
        f"available: {what}."
    ]


def _parameter_count(cfg: DictConfig, shape: SetShape) -> int:
    """Parameters of the model `cfg.model` builds, counted on the meta device (no memory)."""
    from accelexp.config.typed import typed_part
    from accelexp.models import build_shapes

    model_cfg = typed_part(cfg.model, "model")
    try:
        model = build_shapes(model_cfg, shape.channels, shape.num_classes, shape.image_size)
    except ConfigError:
        raise
    except Exception:  # the real build reports what is wrong with this model
        return 0
    return sum(p.numel() for p in model.parameters())


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _size(nbytes: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if nbytes < 1000:
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1000
    return f"{nbytes:.3g} TB"
