"""The run's config typed: the schema's dataclasses (`accelexp.schema.Config`, each group
its option's dataclass: `SimpleCNNConfig`, `SyntheticDataConfig`, `DDPConfig`...), built once
from the validated DictConfig by `accelexp.train`, so that the layers below take the part they
need, typed (`build_model(cfg.model)`, `build_data(cfg.data, seed)`...).

A config as Hydra composes it is already a structured config (`conf/`'s options name their
schemas); one read back from a resolved file (a worker's, `accelexp.launch`) is plain, and each
group's schema is found again by its keys: within a group, no two schemas have the same keys.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accelexp.config.schema import SCHEMAS
from accelexp.errors import ConfigError
from accelexp.schema import Config


def typed(cfg: DictConfig) -> Config:
    """`cfg` (composed, or read back from a resolved file) as the schema's dataclasses, every
    interpolation resolved."""
    config = OmegaConf.to_object(structured(cfg))
    assert isinstance(config, Config)
    return config


def structured(cfg: DictConfig) -> DictConfig:
    """`cfg` with the schema's types: as composed, itself; read back from a file, merged onto
    the schema (`Config`, and each group's option's dataclass)."""
    if OmegaConf.get_type(cfg) is Config:
        return cfg
    groups = {
        group: OmegaConf.structured(schema_of(group, cfg[group]))
        for group in SCHEMAS
        if group in cfg
    }
    merged = OmegaConf.merge(OmegaConf.structured(Config), groups, cfg)
    assert isinstance(merged, DictConfig)
    return merged


def typed_part(node: DictConfig, group: str) -> Any:
    """One group's option (`cfg.model`...) as its dataclass: for the config's own checks, which
    build a part before the run's config is typed (`accelexp.config.resources`)."""
    if OmegaConf.get_type(node) in SCHEMAS[group].values():
        return OmegaConf.to_object(node)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema_of(group, node)), node))


def schema_of(group: str, node: DictConfig) -> type:
    """The dataclass of `group` whose keys are `node`'s."""
    keys = set(node.keys())
    for schema in SCHEMAS[group].values():
        if {field.name for field in fields(schema)} == keys:
            return schema
    raise ConfigError(
        f"{group}: no schema of this group has the keys {sorted(keys)}: "
        f"expected those of one of {sorted(s.__name__ for s in SCHEMAS[group].values())}"
    )
