"""Ways of splitting training work: where a replica's layers live × how replicas agree.

| parallelism | placement (where a replica's layers live)   | sync (how replicas agree)   |
|-------------|---------------------------------------------|-----------------------------|
| single      | one device (`base.Placement`)               | none (`base.Sync`)          |
| dp          | DataParallel over its GPUs (`dp`)           | none                        |
| ddp         | one device                                  | DDP allreduce (`ddp`)       |
| fsdp        | one device                                  | FSDP2 shards (`fsdp`)       |
| horovod     | one device                                  | Horovod (`horovod`)         |
| model       | stages over devices (`model.Stages`)        | none                        |
| hybrid      | stages over devices                         | DDP or Horovod (`engine`)   |

`build_strategy(cfg)` composes the pair into the `base.Strategy` the loop talks to; `connect(cfg)`
sets it up and resolves the run's `Precision` with it, once. The modules
are imported lazily, so torch.distributed and Horovod load only in the runs that use them, and
this table is read without torch (the config checks and the report order by it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from accelexp.errors import ConfigError

if TYPE_CHECKING:
    from accelexp.parallel.base import Placement, Strategy, Sync
    from accelexp.precision import Precision

PLACEMENTS = {
    "one device": "accelexp.parallel.base:Placement",
    "dataparallel": "accelexp.parallel.dp:DataParallelPlacement",
    "stages": "accelexp.parallel.model:Stages",
}
SYNCS = {
    "none": "accelexp.parallel.base:Sync",
    "ddp": "accelexp.parallel.ddp:DDPSync",
    "fsdp": "accelexp.parallel.fsdp:FSDPSync",
    "horovod": "accelexp.parallel.horovod:HorovodSync",
}
# parallelism.name -> (placement, sync); None: the sync is `parallelism.engine`. In the order
# the report lists runs by.
STRATEGIES: dict[str, tuple[str, str | None]] = {
    "single": ("one device", "none"),
    "dp": ("dataparallel", "none"),
    "ddp": ("one device", "ddp"),
    "horovod": ("one device", "horovod"),
    "fsdp": ("one device", "fsdp"),
    "model": ("stages", "none"),
    "hybrid": ("stages", None),
}
HYBRID_ENGINES = ("ddp", "horovod")


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def composition(cfg: DictConfig) -> tuple[type[Placement], type[Sync]]:
    """The placement and sync classes of the `parallelism` config `cfg`."""
    if cfg.name not in STRATEGIES:
        raise ConfigError(
            f"parallelism.name={cfg.name!r} is unknown: expected one of {sorted(STRATEGIES)}"
        )
    placement, sync = STRATEGIES[cfg.name]
    if sync is None:
        if cfg.engine not in HYBRID_ENGINES:
            raise ConfigError(
                f"parallelism.engine={cfg.engine!r} cannot keep hybrid's replicas in sync: "
                f"expected one of {', '.join(HYBRID_ENGINES)}."
            )
        sync = cfg.engine
    return _load(PLACEMENTS[placement]), _load(SYNCS[sync])


def run_label(cfg: DictConfig) -> dict[str, str]:
    """What a run's name says of its parallelism, by the key that sets each part: the
    strategy's own description (e.g. {'parallelism': 'hybrid', 'parallelism.engine': 'ddp',
    'parallelism.nprocs': 'np2', 'parallelism.chunks': 's2c1'})."""
    placement, sync = composition(cfg)
    label = {"parallelism": cfg.name}
    if STRATEGIES[cfg.name][1] is None:  # the sync is a choice of its own: say which
        label["parallelism.engine"] = sync.name
    if cfg.nprocs > 1:
        label["parallelism.nprocs"] = f"np{cfg.nprocs}"
    return label | placement.label(cfg) | sync.label(cfg)


def build_strategy(cfg: DictConfig) -> Strategy:
    """The strategy of the whole run config `cfg`, not yet set up."""
    from accelexp.parallel.base import Strategy

    placement, sync = composition(cfg.parallelism)
    return Strategy(
        cfg.parallelism,
        cfg.device,
        placement=placement(cfg.parallelism, cfg.device),
        sync=sync(cfg.parallelism),
    )


def connect(cfg: DictConfig) -> tuple[Strategy, Precision]:
    """The run's strategy, set up (its world joined, its devices chosen), and its `Precision`,
    built on the device the strategy chose: the one place the two are resolved, together, as
    Lightning Fabric's connector pairs a strategy with its precision. The strategy then gets the
    object (`Strategy.wrap_model`, `optimizer_step`), never the option's name."""
    from accelexp.precision import Precision

    strategy = build_strategy(cfg)
    strategy.setup()
    return strategy, Precision.from_config(cfg.precision, strategy.device)
