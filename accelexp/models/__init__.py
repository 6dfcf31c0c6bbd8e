"""Model registry: `build_model(cfg.model, in_channels, num_classes, image_size)`, `cfg.model`
the typed `model` option (`accelexp.schema.ModelConfig`).

Input channels, class count and image size come from the data, never from the user.
`layer_sequence(model)` lists a model as the layers whose composition is its forward pass: what
model parallelism cuts into stages.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch
import torch.nn as nn

from accelexp.errors import ConfigError
from accelexp.models.mlp import MLP
from accelexp.models.resnet import build_resnet, resnet_layers
from accelexp.models.simple_cnn import SimpleCNN
from accelexp.models.vit import build_vit, build_vit_b_16, vit_b16_layers
from accelexp.schema import ModelConfig

Builder = Callable[[ModelConfig, int, int, int], nn.Module]

MODELS: dict[str, Builder] = {
    "simple_cnn": lambda cfg, c, k, s: SimpleCNN(
        c, k, s, list(cfg.channels), cfg.hidden, cfg.dropout
    ),
    "mlp": lambda cfg, c, k, s: MLP(c, k, s, list(cfg.widths), cfg.dropout),
    "resnet18": lambda cfg, c, k, s: build_resnet("resnet18", cfg, c, k, s),
    "resnet50": lambda cfg, c, k, s: build_resnet("resnet50", cfg, c, k, s),
    "vit_tiny": build_vit,
    "vit_small": build_vit,
    "vit_b_16": build_vit_b_16,
}


def build_model(cfg: ModelConfig, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name={cfg.name!r} is unknown: expected one of {sorted(MODELS)}")
    return MODELS[cfg.name](cfg, in_channels, num_classes, image_size)


def build_shapes(
    cfg: ModelConfig, in_channels: int, num_classes: int, image_size: int
) -> nn.Module:
    """The model `cfg` builds, on the meta device and without pretrained weights: its layers and
    shapes only (no memory, no download), for counting its parameters or forecasting a step."""
    if hasattr(cfg, "pretrained"):  # the weights' values play no part
        cfg = dataclasses.replace(cfg, pretrained=False)
    with torch.device("meta"):
        return build_model(cfg, in_channels, num_classes, image_size)


def layer_sequence(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) pairs such that applying the layers in order is `model(x)`.

    An `nn.Sequential` is its children, nested Sequentials (e.g. a stage of blocks) opened up;
    a torchvision ResNet is its stem, its residual blocks one by one, and its head; a ViT (ours,
    an nn.Sequential, or torchvision's) is its patch embedding, each encoder block, and its head.
    """
    torchvision = sys.modules.get("torchvision")  # not loaded: the model is not one of its
    if torchvision is not None and isinstance(model, torchvision.models.ResNet):
        return resnet_layers(model)
    if torchvision is not None and isinstance(model, torchvision.models.VisionTransformer):
        return vit_b16_layers(model)
    if isinstance(model, nn.Sequential):
        layers = []
        for name, child in model.named_children():
            if isinstance(child, nn.Sequential):
                layers += [(f"{name}.{inner}", layer) for inner, layer in layer_sequence(child)]
            else:
                layers.append((name, child))
        return layers
    raise ConfigError(
        f"a {type(model).__name__} cannot be split into stages: model parallelism splits an "
        f"nn.Sequential (e.g. model=simple_cnn, model=mlp, model=vit_tiny), a ResNet "
        f"(model=resnet18, model=resnet50) or torchvision's ViT (model=vit_b_16)."
    )
