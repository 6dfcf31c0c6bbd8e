"""Ways of splitting training work, one module each, behind `accelexp.parallel.base.Strategy`.

`build_strategy(cfg)` imports the chosen module lazily, so torch.distributed and Horovod are
imported only by the runs that use them.
"""

from __future__ import annotations

import importlib

from omegaconf import DictConfig

from accelexp.config import ConfigError
from accelexp.parallel.base import Strategy

STRATEGIES = {
    "single": "accelexp.parallel.single:SingleDevice",
    "dp": "accelexp.parallel.dp:DataParallel",
    "ddp": "accelexp.parallel.ddp:DDP",
    "horovod": "accelexp.parallel.horovod:Horovod",
    "model": "accelexp.parallel.model:ModelParallel",
    "hybrid": "accelexp.parallel.hybrid:Hybrid",
}


def strategy_class(cfg: DictConfig) -> type[Strategy]:
    """The class that runs the `parallelism` config `cfg`."""
    if cfg.name not in STRATEGIES:
        raise ConfigError(
            f"parallelism.name={cfg.name!r} is unknown: expected one of {sorted(STRATEGIES)}"
        )
    module, cls = STRATEGIES[cfg.name].split(":")
    return getattr(importlib.import_module(module), cls).for_config(cfg)


def build_strategy(cfg: DictConfig) -> Strategy:
    return strategy_class(cfg.parallelism)(cfg.parallelism, cfg.device)
