"""A multilayer perceptron: the image flattened, then fully connected layers (no convolution)."""

from __future__ import annotations

import torch.nn as nn


class MLP(nn.Sequential):
    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        widths: list[int],
        dropout: float = 0.0,
    ) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_channels * image_size * image_size
        for hidden in widths:
            layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            width = hidden
        super().__init__(*layers, nn.Linear(width, num_classes))
