"""Ways of splitting training work: where a replica's layers live × how replicas agree.

A `parallelism` config names both parts, `parallelism.placement` and `parallelism.sync`; each
option of `conf/parallelism/` is a preset of a pair, and its other keys belong to that pair
(`STRATEGIES`, in the report's order):

| preset  | placement: where a replica's layers live  | sync: how replicas agree         |
|---------|-------------------------------------------|----------------------------------|
| single  | one device (`base.Placement`)             | none (`base.Sync`)               |
| dp      | dataparallel: over its GPUs (`dp`)        | none                             |
| ddp     | one device                                | ddp: DDP allreduce (`ddp`)       |
| horovod | one device                                | horovod (`horovod`)              |
| fsdp    | one device                                | fsdp: FSDP2 shards (`fsdp`)      |
| model   | stages over devices (`model.Stages`)      | none                             |
| hybrid  | stages over devices                       | ddp or horovod: its choice       |
| pipeline| a stage per rank (`stages_per_rank`)      | p2p: activations sent; pp x dp   |

`composition(parallelism)` loads the classes the two keys name; `build_strategy(cfg)` composes
them into the `base.Strategy` the loop talks to, which owns the run's `Precision`; `connect(cfg)`
sets it up. Both take the run's typed config (`accelexp.schema.Config`, as `config.typed` makes
it at the typed boundary): the strategy, its placement and its sync hold the typed
`parallelism` part (`config.py`'s dataclass of its preset) and read its keys as attributes. A
pair its preset does not offer is refused by the strategy's rules (`rules.problems`, which
validation asks of the DictConfig, before it is typed). The modules are imported lazily, so
torch.distributed and Horovod load only in the runs that use them, and this table is read
without torch (the config checks and the report order by it).

Each preset's keys are a dataclass of `config.py` (`Preset.schema`), which the config's schema
registers for Hydra: this package owns the `parallelism` config group whole.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

from accelexp.errors import ConfigError
from accelexp.parallel.config import (
    DataParallelConfig,
    DDPConfig,
    FSDPConfig,
    HorovodConfig,
    HybridConfig,
    ModelParallelConfig,
    ParallelismConfig,
    PipelineConfig,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from accelexp.parallel.base import Placement, Strategy, Sync
    from accelexp.schema import Config

PLACEMENTS = {
    "one device": "accelexp.parallel.base:Placement",
    "dataparallel": "accelexp.parallel.dp:DataParallelPlacement",
    "stages": "accelexp.parallel.model:Stages",
    "stages per rank": "accelexp.parallel.stages_per_rank:RankStages",
}
SYNCS = {
    "none": "accelexp.parallel.base:Sync",
    "ddp": "accelexp.parallel.ddp:DDPSync",
    "fsdp": "accelexp.parallel.fsdp:FSDPSync",
    "horovod": "accelexp.parallel.horovod:HorovodSync",
    "p2p": "accelexp.parallel.stages_per_rank:StageLinks",
}


class Preset(NamedTuple):
    """An option of `conf/parallelism/`: its placement, the syncs it offers (the first is its
    default; more than one: `parallelism.sync` chooses), its keys (`schema`, a dataclass of
    `config.py`, which Hydra checks the option against), and, for a preset whose sync shards the
    training state (parameters, gradients, optimizer state) over its workers, the preset that
    replicates it on each instead, otherwise alike (`unsharded`: the memory report weighs the
    one against the other), and for one whose ranks hold different parts of one replica, why
    rank 0's state and step peak are no figure of the replica's fullest device (`per_rank`: the
    memory report says it instead of comparing them)."""

    placement: str
    syncs: tuple[str, ...]
    schema: type
    unsharded: str | None = None
    per_rank: str | None = None

    @property
    def shards(self) -> bool:
        """Its workers each hold a shard of the training state, not a whole copy."""
        return self.unsharded is not None


# parallelism.name -> its preset, in the order the report lists runs by
STRATEGIES: dict[str, Preset] = {
    "single": Preset("one device", ("none",), ParallelismConfig),
    "dp": Preset("dataparallel", ("none",), DataParallelConfig),
    "ddp": Preset("one device", ("ddp",), DDPConfig),
    "horovod": Preset("one device", ("horovod",), HorovodConfig),
    "fsdp": Preset("one device", ("fsdp",), FSDPConfig, unsharded="ddp"),
    "model": Preset("stages", ("none",), ModelParallelConfig),
    "hybrid": Preset("stages", ("ddp", "horovod"), HybridConfig),
    "pipeline": Preset(
        "stages per rank",
        ("p2p",),
        PipelineConfig,
        per_rank="state and step peak not compared: a pipeline's ranks hold different stages and "
        "rank 0 logs its own only (stage<r>_peak_mem_mb: each rank's peak)",
    ),
}
# a preset and the one it shards the training state of are otherwise alike: same placement
assert all(
    STRATEGIES[p.unsharded].placement == p.placement for p in STRATEGIES.values() if p.shards
), "a sharding preset's unsharded preset has another placement"
# each preset's schema is its own: its name, and its placement and (first) sync as defaults
assert {
    name: (preset.schema.name, preset.schema.placement, preset.schema.sync)
    for name, preset in STRATEGIES.items()
} == {name: (name, preset.placement, preset.syncs[0]) for name, preset in STRATEGIES.items()}, (
    "parallelism schemas != STRATEGIES"
)


def shards(name: str) -> bool:
    """Whether the preset `name` (a run's `parallelism`) shards the training state over its
    workers; False for a name no preset has (an old run's)."""
    preset = STRATEGIES.get(name)
    return preset is not None and preset.shards


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def composition(cfg: ParallelismConfig | DictConfig) -> tuple[type[Placement], type[Sync]]:
    """The placement and sync classes the `parallelism` config `cfg` names (`cfg.placement`,
    `cfg.sync`), typed or not; whether its preset offers the pair is `rules.problems`'s to say."""
    if cfg.name not in STRATEGIES:
        raise ConfigError(
            f"parallelism.name={cfg.name!r} is unknown: expected one of {sorted(STRATEGIES)}"
        )
    for key, table in (("placement", PLACEMENTS), ("sync", SYNCS)):
        if getattr(cfg, key) not in table:
            raise ConfigError(
                f"parallelism.{key}={getattr(cfg, key)!r} is unknown: expected one of "
                f"{', '.join(table)}."
            )
    return _load(PLACEMENTS[cfg.placement]), _load(SYNCS[cfg.sync])


def run_label(cfg: ParallelismConfig | DictConfig) -> dict[str, str]:
    """What a run's name says of its parallelism, by the key that sets each part: the
    strategy's own description (e.g. {'parallelism': 'hybrid', 'parallelism.sync': 'ddp',
    'parallelism.nprocs': 'np2', 'parallelism.chunks': 's2c1'}). Of the typed part, or of the
    DictConfig a sweep's callbacks and a failed job's record hold: read by attribute alike."""
    placement, sync = composition(cfg)
    label = {"parallelism": cfg.name}
    if len(STRATEGIES[cfg.name].syncs) > 1:  # the sync is the preset's choice: say which
        label["parallelism.sync"] = sync.name
    if cfg.nprocs > 1:
        label["parallelism.nprocs"] = f"np{cfg.nprocs}"
    return label | placement.label(cfg) | sync.label(cfg)


def build_strategy(cfg: Config) -> Strategy:
    """The strategy of the whole run config `cfg`, typed (`config.typed`), with its precision,
    not yet set up."""
    from accelexp.parallel.base import Strategy

    placement, sync = composition(cfg.parallelism)
    return Strategy(
        cfg.parallelism,
        cfg.device,
        placement=placement(cfg.parallelism, cfg.device),
        sync=sync(cfg.parallelism),
        precision=cfg.precision,
    )


def connect(cfg: Config) -> Strategy:
    """The run's strategy, set up (its world joined, its devices chosen), its `Precision`
    built on the device it chose (`Strategy.precision`): the one place the two are paired, as
    Lightning Fabric's connector pairs a strategy with its precision. The loop, the step and
    the diagnosis get the strategy, and its precision from it, never the option's name."""
    strategy = build_strategy(cfg)
    strategy.setup()
    return strategy
