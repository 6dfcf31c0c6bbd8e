"""What each placement and sync of the strategy table refuses of a run config, and advises.

The config's validation (`accelexp.config.validate`), the machine's check (`config.resources`)
and a verdict's advice (`accelexp.diagnosis.verdict`) ask here, so no module outside `parallel/`
names a strategy or its rules. Keyed by the table's names (`accelexp.parallel.PLACEMENTS`,
`SYNCS`), not by the classes: those load torch, and the config checks and `--help` run without
it.

- `KEY_RULES`: (key, ok, allowed) for every key of `parallelism` (its dataclasses: `config.py`),
  as `validate`'s range rules are written, in the common words of `accelexp.keys`.
- `problems(cfg)`: combinations of the whole run config `cfg` the strategy cannot run: a
  placement or sync its preset does not offer (naming the preset that does), else its
  placement's, then its sync's.
- `resource_problems(cfg, gpus)`: what the strategy needs of this machine beyond cores and memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import pairwise

from omegaconf import DictConfig, OmegaConf

from accelexp.keys import (
    AT_LEAST_ONE,
    OPTIONAL_AT_LEAST_ONE,
    POSITIVE,
    Rule,
    declared_choices,
    either,
)
from accelexp.parallel import PLACEMENTS, STRATEGIES, SYNCS

GRANULARITIES = ("block", "model")  # fsdp's units: one per block of the layer sequence | one
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
# pairs no preset offers, and why (the others: no preset was made of them)
UNPAIRED = {
    ("stages", "fsdp"): (
        "FSDP shards one model over the data-parallel workers, and hybrid's replicas are "
        "pipelines of stages; sharding pipeline stages (2-D parallelism) is not supported"
    ),
    ("stages per rank", "horovod"): (
        "a pipeline's ranks send activations to each other point to point "
        "(torch.distributed.pipelining), which Horovod's collectives-only API does not offer"
    ),
    ("stages per rank", "ddp"): (
        "parallelism=pipeline makes data-parallel replicas itself: parallelism.pp ranks per "
        "pipeline, nprocs / pp pipelines, each stage's gradients averaged over the mesh's dp "
        "dimension"
    ),
    ("stages per rank", "fsdp"): (
        "parallelism=pipeline shards each stage over its data-parallel replicas itself (FSDP2 "
        "over the mesh's dp dimension): parallelism.pp ranks per pipeline and "
        "parallelism.dp_shard=true"
    ),
}


def problems(cfg: DictConfig) -> list[str]:
    """What the strategy of the run config `cfg` refuses of it, one indented line each."""
    parallelism = cfg.parallelism
    unoffered = _unoffered(parallelism)
    if unoffered:  # the preset's other keys are another pair's: their rules would not apply
        return [unoffered]
    found = PLACEMENT_PROBLEMS.get(parallelism.placement, _none)(cfg)
    return found + SYNC_PROBLEMS.get(parallelism.sync, _none)(cfg)


def resource_problems(cfg: DictConfig, gpus: int) -> list[str]:
    """What the strategy of `cfg` needs of a machine with `gpus` usable GPUs and lacks: its
    process group's backend, then its sync's needs."""
    needs = SYNC_RESOURCE_PROBLEMS.get(cfg.parallelism.sync, lambda cfg, gpus: [])
    return _backend_resource_problems(cfg, gpus) + needs(cfg, gpus)


def several_workers() -> list[str]:
    """The strategies that run `nprocs` worker processes (those whose replicas keep in sync),
    by name."""
    return sorted(name for name, preset in STRATEGIES.items() if "none" not in preset.syncs)


def _either(names: Iterable[str]) -> str:
    """The names as "a, b or c"."""
    *rest, last = names
    return f"{', '.join(rest)} or {last}" if rest else last


def _pick(name: str, sync: str) -> str:
    """The override that picks preset `name` with `sync`: `parallelism=hybrid
    parallelism.sync=horovod` where the preset chooses its sync, else `parallelism=ddp`."""
    chosen = len(STRATEGIES[name].syncs) > 1
    return f"parallelism={name}" + (f" parallelism.sync={sync}" if chosen else "")


def _unoffered(parallelism: DictConfig) -> str:
    """A placement or sync the preset `parallelism.name` does not offer, said with the preset
    to pick instead; "" when it offers both (or a name is unknown: others say so)."""
    preset = STRATEGIES.get(parallelism.name)
    placement, sync = parallelism.placement, parallelism.sync
    if preset is None or placement not in PLACEMENTS or sync not in SYNCS:
        return ""
    if placement == preset.placement and sync in preset.syncs:
        return ""
    typed = [f"parallelism.placement={placement}"] if placement != preset.placement else []
    typed += [f"parallelism.sync={sync}"] if sync not in preset.syncs else []
    said = (  # the preset first: `validate`'s example fix is then `parallelism=...`
        f"  parallelism={parallelism.name} is a preset of {preset.placement} × "
        f"{_either(preset.syncs)}, whose other keys are that pair's"
    )
    offering = [n for n, p in STRATEGIES.items() if p.placement == placement and sync in p.syncs]
    if offering:
        return f"{said}: for {' '.join(typed)} use {_pick(offering[0], sync)}."
    # the presets of the same sync (every sync has one), then this one where it chooses its sync
    near = [_pick(name, sync) for name, p in STRATEGIES.items() if sync in p.syncs]
    if len(preset.syncs) > 1:
        near.append(_pick(parallelism.name, preset.syncs[0]))
    reason = UNPAIRED.get((placement, sync))
    return (
        f"{said}, and no preset is {placement} × {sync} ({' '.join(typed)})"
        f"{f': {reason}' if reason else ''}. Use {_either(near)}."
    )


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


def _rank_stages_problems(cfg: DictConfig) -> list[str]:
    """A pipeline across ranks (`parallelism=pipeline`): its micro-batches, and what its
    schedule does not run."""
    parallelism, batch_size = cfg.parallelism, cfg.data.batch_size
    micro, schedule, nprocs = parallelism.microbatches, parallelism.schedule, parallelism.nprocs
    pp = parallelism.get("pp")
    ranks = nprocs if pp is None else pp  # the ranks of one pipeline
    problems = []
    if pp is not None and pp >= 1 and nprocs % pp:
        problems.append(
            f"  parallelism.pp={pp} does not divide parallelism.nprocs={nprocs} into pipelines: "
            f"use nprocs a multiple of pp (e.g. parallelism.nprocs={pp * -(-nprocs // pp)})."
        )
    if micro >= 1 and (micro > batch_size or batch_size % micro):
        divisors = [m for m in range(1, min(batch_size, 64) + 1) if batch_size % m == 0]
        problems.append(
            f"  parallelism.microbatches={micro} does not cut data.batch_size={batch_size} into "
            f"equal micro-batches: use microbatches in {divisors} or a batch size divisible by "
            f"{micro}."
        )
    if ranks < 2:
        named = "nprocs" if pp is None else "pp"
        problems.append(
            f"  parallelism.{named}={ranks}: a pipeline across ranks needs at least 2 (one "
            f"process is parallelism=model)."
        )
    elif micro >= 1 and _schedule_refuses(schedule, micro, ranks):
        problems.append(
            f"  parallelism.microbatches={micro} with parallelism.schedule={schedule} over "
            f"{ranks} ranks: {_schedule_refuses(schedule, micro, ranks)}."
        )
    if parallelism.get("dp_shard") and nprocs == ranks:
        problems.append(
            f"  parallelism.dp_shard=true shards each stage over the pipelines, but "
            f"parallelism.nprocs={nprocs} makes one pipeline of {ranks} ranks: set parallelism.pp "
            f"to the ranks of one pipeline (e.g. parallelism.pp={max(2, nprocs // 2)} for "
            f"{nprocs // max(2, nprocs // 2)} pipelines), or parallelism.dp_shard=false."
        )
    if parallelism.accumulate_steps != 1:
        problems.append(
            f"  parallelism.accumulate_steps={parallelism.accumulate_steps} with "
            f"parallelism=pipeline: the schedule's micro-batches are its accumulation; use "
            f"parallelism.microbatches and a larger data.batch_size."
        )
    refused = {
        "speed.compile": (cfg.speed.compile != "off", "the stages run eager"),
        "speed.activation_checkpointing": (
            cfg.speed.activation_checkpointing != "none",
            "not tried with the schedules' split backward",
        ),
        "max_batch.search": (cfg.max_batch.search, "a schedule's micro-batch shapes are fixed"),
    }
    for key, (asked, why) in refused.items():
        if asked:
            problems.append(
                f"  {key}={OmegaConf.select(cfg, key)} with parallelism=pipeline: {why}; "
                f"drop it, or use parallelism=model."
            )
    return problems


def _schedule_refuses(schedule: str, micro: int, ranks: int) -> str:
    """What torch's `schedule` asks of `micro` micro-batches over `ranks` ranks and they lack
    ("" where nothing): 1F1B at least one per rank; the interleaved schedules a multiple of
    their rounds (max(1, micro // ranks))."""
    if schedule == "1f1b" and micro < ranks:
        return f"1F1B needs at least one micro-batch per rank (parallelism.microbatches>={ranks})"
    rounds = max(1, micro // ranks)
    if schedule in ("interleaved_1f1b", "zero_bubble") and micro % rounds:
        near = rounds * (micro // rounds)
        return (
            f"the interleaved schedules need a multiple of their rounds ({rounds}), e.g. "
            f"parallelism.microbatches={near or ranks}"
        )
    return ""


def _fsdp_problems(cfg: DictConfig) -> list[str]:
    """CUDA graphs over weights FSDP frees every step."""
    if cfg.speed.compile == "reduce-overhead":
        return [
            "  speed.compile=reduce-overhead with parallelism=fsdp: CUDA graphs replay fixed "
            "memory addresses, and FSDP frees and re-gathers the weights every step. Use "
            "speed.compile=default or max-autotune with fsdp (each block compiled before it is "
            "sharded), or parallelism=ddp for CUDA graphs."
        ]
    return []


def _backend_resource_problems(cfg: DictConfig, gpus: int) -> list[str]:
    """NCCL without a GPU, wherever the preset has torch.distributed's `backend` key."""
    if cfg.parallelism.get("backend") == "nccl" and not gpus:
        return [
            "  parallelism.backend=nccl needs CUDA GPUs, and this run has none (device="
            f"{cfg.device}): use parallelism.backend=gloo or auto."
        ]
    return []


def _fsdp_resource_problems(cfg: DictConfig, gpus: int) -> list[str]:
    if cfg.parallelism.get("cpu_offload") and not gpus:
        return [
            "  parallelism.cpu_offload=true moves FSDP's shards from GPU memory to host memory, "
            f"but this run has no GPU (device={cfg.device}): drop parallelism.cpu_offload."
        ]
    return []


PLACEMENT_PROBLEMS: dict[str, Callable[[DictConfig], list[str]]] = {
    "stages": _stages_problems,
    "stages per rank": _rank_stages_problems,
}
SYNC_PROBLEMS: dict[str, Callable[[DictConfig], list[str]]] = {"fsdp": _fsdp_problems}
SYNC_RESOURCE_PROBLEMS: dict[str, Callable[[DictConfig, int], list[str]]] = {
    "fsdp": _fsdp_resource_problems,
}


def _declared(name: str) -> Rule:
    """`parallelism.{name}` takes one of the choices its presets' schemas declare: "expected
    a, b or c"."""
    key = f"parallelism.{name}"
    return either(key, declared_choices(key, [preset.schema for preset in STRATEGIES.values()]))


# the range of every key of the `parallelism` group, in the order validation lists problems in
# (`accelexp.config.validate` reads it). A part its preset does not offer passes here:
# `problems` names the preset that does.
KEY_RULES: list[Rule] = [
    ("parallelism.nprocs", *AT_LEAST_ONE),
    ("parallelism.accumulate_steps", *AT_LEAST_ONE),
    _declared("lr_scaling"),
    _declared("backend"),
    ("parallelism.bucket_cap_mb", *POSITIVE),
    _declared("comm_hook"),
    _declared("compression"),
    _declared("op"),
    ("parallelism.master_port", lambda v: v is None or 1 <= v <= 65535, "null or a port 1-65535"),
    (
        "parallelism.devices",
        lambda v: v is None or (len(v) >= 1 and all(isinstance(d, str) or d >= 0 for d in v)),
        "null or a non-empty list of devices",
    ),
    ("parallelism.stages", *OPTIONAL_AT_LEAST_ONE),
    ("parallelism.chunks", *AT_LEAST_ONE),
    _declared("balance"),
    (
        "parallelism.split_points",
        lambda v: v is None or (all(b > a for a, b in pairwise(v)) and min(v, default=1) > 0),
        "null or strictly increasing layer indices >= 1, e.g. [4, 9]",
    ),
    ("parallelism.placement", lambda v: v in PLACEMENTS, _either(PLACEMENTS)),
    ("parallelism.sync", lambda v: v in SYNCS, _either(SYNCS)),
    ("parallelism.granularity", lambda v: v in GRANULARITIES, " or ".join(GRANULARITIES)),
    ("parallelism.devices_per_replica", *AT_LEAST_ONE),
    _declared("schedule"),
    ("parallelism.microbatches", *AT_LEAST_ONE),
    ("parallelism.pp", *OPTIONAL_AT_LEAST_ONE),
]
