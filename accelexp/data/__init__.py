"""Data registry: `build_data(cfg.data, seed)` -> a `DataBundle` of train/val/test in memory;
`cfg.data` the typed `data` option (`accelexp.schema.DataConfig`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from accelexp.data.images import DataBundle, ImageSet
from accelexp.data.loaders import BatchLoader, resolve_on_device
from accelexp.data.sources import (
    DatasetNotFoundError,
    load_cifar10,
    load_fashion_mnist,
    make_synthetic,
)
from accelexp.errors import ConfigError
from accelexp.schema import DataConfig

SOURCES: dict[str, Callable[[Any], tuple[ImageSet, ImageSet]]] = {
    "fashion_mnist": load_fashion_mnist,
    "cifar10": load_cifar10,
    "synthetic": make_synthetic,
}

__all__ = [
    "BatchLoader",
    "DataBundle",
    "DatasetNotFoundError",
    "ImageSet",
    "build_data",
    "resolve_on_device",
]


def build_data(cfg: DataConfig, seed: int) -> DataBundle:
    """Load the dataset, hold out `val_fraction` of train (seeded) for validation."""
    if cfg.name not in SOURCES:
        raise ConfigError(f"data.name={cfg.name!r} is unknown: expected one of {sorted(SOURCES)}")
    train, test = SOURCES[cfg.name](cfg)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(train) * cfg.val_fraction)
    val, train = train.subset(order[:n_val]), train.subset(order[n_val:])
    if n_val == 0:  # no held-out split asked for: validate on the test set
        val = test
    num_classes = int(max(train.labels.max(), test.labels.max())) + 1
    mean, std = train.channel_stats()
    return DataBundle(cfg.name, train, val, test, num_classes, mean, std)
