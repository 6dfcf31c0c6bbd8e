"""torchvision ResNets adapted to the data: input channels, class count, small-image stem.

For images no larger than `small_input_max_size` (CIFAR, Fashion-MNIST) the ImageNet stem
(7x7 stride-2 conv + max-pool, which would shrink a 32x32 image to 8x8 at once) is replaced by a
3x3 stride-1 conv, the usual CIFAR ResNet. `pretrained: true` loads torchvision's ImageNet weights
only when they are already in torch's hub cache (no download at run time); the replaced stem and
head start from scratch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from accelexp.errors import AccelexpError
from accelexp.schema import ResNetConfig

if TYPE_CHECKING:
    import torchvision  # loaded where a model of its is built


def cached_weights(arch: str):
    """torchvision's default weights of `arch`, when already in torch's hub cache (no download
    at run time); an `AccelexpError` saying where to put the file otherwise."""
    import torchvision  # here, not at import: it loads torch._dynamo (1.3 s a process)

    weights = torchvision.models.get_model_weights(arch).DEFAULT
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    if not cached.is_file():
        raise AccelexpError(
            f"model.pretrained=true needs torchvision's {weights} weights at {cached}, which is "
            f"not there and is not downloaded at run time. Copy the file there "
            f"(from {weights.url}) "
            f"or use model.pretrained=false."
        )
    return weights


def build_resnet(
    arch: str, cfg: ResNetConfig, in_channels: int, num_classes: int, image_size: int
) -> nn.Module:
    weights = cached_weights(arch) if cfg.pretrained else None
    import torchvision

    model = torchvision.models.get_model(arch, weights=weights)
    small = image_size <= cfg.small_input_max_size
    if small:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    return model


def resnet_layers(model: torchvision.models.ResNet) -> list[tuple[str, nn.Module]]:
    """The ResNet's forward as a sequence: stem, each residual block, pooling, flatten, head."""
    layers = [(name, getattr(model, name)) for name in ("conv1", "bn1", "relu", "maxpool")]
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        layers += [(f"{stage}.{i}", block) for i, block in enumerate(getattr(model, stage))]
    return [*layers, ("avgpool", model.avgpool), ("flatten", nn.Flatten(1)), ("fc", model.fc)]
