"""Model registry: `build_model(cfg.model, in_channels, num_classes, image_size)`.

Input channels, class count and image size come from the data, never from the user.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from omegaconf import DictConfig

from accelexp.config import ConfigError
from accelexp.models.resnet import build_resnet
from accelexp.models.simple_cnn import SimpleCNN

Builder = Callable[[DictConfig, int, int, int], nn.Module]

MODELS: dict[str, Builder] = {
    "simple_cnn": lambda cfg, c, k, s: SimpleCNN(
        c, k, s, list(cfg.channels), cfg.hidden, cfg.dropout
    ),
    "resnet18": lambda cfg, c, k, s: build_resnet("resnet18", cfg, c, k, s),
    "resnet50": lambda cfg, c, k, s: build_resnet("resnet50", cfg, c, k, s),
}


def build_model(cfg: DictConfig, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name={cfg.name!r} is unknown: expected one of {sorted(MODELS)}")
    return MODELS[cfg.name](cfg, in_channels, num_classes, image_size)
