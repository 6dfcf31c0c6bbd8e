"""What each placement and sync of the strategy table refuses of a run config, and advises.

The config's validation (`accelexp.config.validate`), the machine's check (`config.resources`)
and a verdict's advice (`accelexp.diagnosis.verdict`) ask here, so no module outside `parallel/`
names a strategy or its rules. Keyed by the table's names (`accelexp.parallel.PLACEMENTS`,
`SYNCS`), not by the classes: those load torch, and the config checks and `--help` run without
it.

- `key_rules()`: (key, ok, allowed) for the keys a strategy adds to `parallelism`, as
  `validate`'s range rules are written.
- `problems(cfg)`: combinations of the whole run config `cfg` the strategy cannot run (its
  placement's, then its sync's).
- `resource_problems(cfg, gpus)`: what the strategy needs of this machine beyond cores and memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from accelexp.parallel import HYBRID_ENGINES, STRATEGIES, SYNCS

GRANULARITIES = ("block", "model")  # fsdp's units: one per block of the layer sequence | one
# the override that puts more devices to work on one device (`base.Placement.scale_out_advice`;
# a verdict's when it knows no strategy)
ONE_DEVICE_SCALE_OUT = ("parallelism=ddp parallelism.nprocs=2", "more devices")
# the strategies' ways to need less memory per device (a memory-bound verdict's, after the
# run's own: precision, accumulation)
MEMORY_ADVICE = [
    (
        "parallelism=fsdp",
        "parameters, gradients and optimizer state sharded over the data-parallel workers",
    ),
    (
        "parallelism.reshard_after_forward=true",
        "free each unit's gathered weights after its forward",
    ),
    ("parallelism=model", "the layers (and their memory) split over several GPUs"),
    ("parallelism=hybrid", "stages over GPUs within each data-parallel replica"),
]


def key_rules() -> list[tuple[str, Callable[[Any], bool], str]]:
    """The choices of hybrid's `engine` and fsdp's `granularity`. An engine that names a sync
    which cannot pair with stages (fsdp) passes here: `problems` says why it cannot."""
    return [
        (
            "parallelism.engine",
            lambda v: v in SYNCS and v != "none",
            " or ".join(HYBRID_ENGINES),
        ),
        ("parallelism.granularity", lambda v: v in GRANULARITIES, " or ".join(GRANULARITIES)),
    ]


def problems(cfg: DictConfig) -> list[str]:
    """What the strategy of the run config `cfg` refuses of it, one indented line each."""
    placement, sync = _parts(cfg.parallelism)
    found = PLACEMENT_PROBLEMS.get(placement, _none)(cfg)
    return found + SYNC_PROBLEMS.get(sync, _none)(cfg)


def resource_problems(cfg: DictConfig, gpus: int) -> list[str]:
    """What the strategy of `cfg` needs of a machine with `gpus` usable GPUs and lacks."""
    _, sync = _parts(cfg.parallelism)
    return SYNC_RESOURCE_PROBLEMS.get(sync, lambda cfg, gpus: [])(cfg, gpus)


def several_workers() -> list[str]:
    """The strategies that run `nprocs` worker processes (those whose replicas keep in sync),
    by name."""
    return sorted(name for name, (_, sync) in STRATEGIES.items() if sync != "none")


def _parts(parallelism: DictConfig) -> tuple[str | None, str | None]:
    """The table's placement and sync names of `parallelism` (None: not in the table), without
    refusing an engine: its problems are reported with the others."""
    placement, sync = STRATEGIES.get(parallelism.name, (None, None))
    if placement is not None and sync is None:
        sync = parallelism.get("engine")
    return placement, sync


def _none(cfg: DictConfig) -> list[str]:
    return []


def _stages_problems(cfg: DictConfig) -> list[str]:
    """Keys of `model` and `hybrid` that only make sense together."""
    parallelism, batch_size = cfg.parallelism, cfg.data.batch_size
    problems = []
    chunks, stages = parallelism.chunks, parallelism.stages
    if chunks >= 1 and (chunks > batch_size or batch_size % chunks):
        divisors = [c for c in range(1, min(batch_size, 64) + 1) if batch_size % c == 0]
        problems.append(
            f"  parallelism.chunks={chunks} does not cut data.batch_size={batch_size} into equal "
            f"micro-batches: use chunks in {divisors} or a batch size divisible by {chunks}."
        )
    split_points = parallelism.split_points
    if split_points is not None and stages is not None and len(split_points) != stages - 1:
        problems.append(
            f"  parallelism.split_points={list(split_points)} gives {len(split_points) + 1} "
            f"stages, but parallelism.stages={stages}: give {stages - 1} split point(s) or set "
            f"parallelism.stages={len(split_points) + 1}."
        )
    per_replica = parallelism.get("devices_per_replica")
    if per_replica and stages is not None and stages < per_replica:
        problems.append(
            f"  parallelism.stages={stages} is fewer than parallelism.devices_per_replica="
            f"{per_replica}: some devices would sit idle. Use stages>={per_replica} or null."
        )
    return problems


def _fsdp_problems(cfg: DictConfig) -> list[str]:
    """FSDP's shards as hybrid's engine; CUDA graphs over weights FSDP frees every step."""
    if STRATEGIES[cfg.parallelism.name][0] == "stages":
        return [
            "  parallelism=hybrid with parallelism.engine=fsdp: FSDP shards one model over the "
            "data-parallel workers, and hybrid's replicas are pipelines of stages; sharding "
            "pipeline stages (2-D parallelism) is not supported. Use parallelism=fsdp (shards, "
            "one device per worker), or hybrid with parallelism.engine=ddp or horovod."
        ]
    if cfg.speed.compile == "reduce-overhead":
        return [
            "  speed.compile=reduce-overhead with parallelism=fsdp: CUDA graphs replay fixed "
            "memory addresses, and FSDP frees and re-gathers the weights every step. Use "
            "speed.compile=default or max-autotune with fsdp (each block compiled before it is "
            "sharded), or parallelism=ddp for CUDA graphs."
        ]
    return []


def _fsdp_resource_problems(cfg: DictConfig, gpus: int) -> list[str]:
    if cfg.parallelism.get("cpu_offload") and not gpus:
        return [
            "  parallelism.cpu_offload=true moves FSDP's shards from GPU memory to host memory, "
            f"but this run has no GPU (device={cfg.device}): drop parallelism.cpu_offload."
        ]
    return []


PLACEMENT_PROBLEMS: dict[str, Callable[[DictConfig], list[str]]] = {"stages": _stages_problems}
SYNC_PROBLEMS: dict[str, Callable[[DictConfig], list[str]]] = {"fsdp": _fsdp_problems}
SYNC_RESOURCE_PROBLEMS: dict[str, Callable[[DictConfig, int], list[str]]] = {
    "fsdp": _fsdp_resource_problems,
}
