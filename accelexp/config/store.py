"""The schemas in Hydra's ConfigStore, where `conf/`'s defaults lists find them
(`- /schema/<group>/<name>@_here_`)."""

from __future__ import annotations

import functools

from hydra.core.config_store import ConfigStore

from accelexp.config.schema import SCHEMAS
from accelexp.schema import Config


@functools.cache  # once a process: the store is Hydra's singleton (tests compose hundreds of times)
def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
