"""The small CNN of Horovod's CIFAR-10 example: two conv+pool blocks, then two linear layers."""

from __future__ import annotations

import torch.nn as nn


class SimpleCNN(nn.Sequential):
    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        channels: list[int],
        hidden: int = 128,
        dropout: float = 0.25,
    ) -> None:
        c1, c2 = channels
        flat = c2 * (image_size // 4) ** 2
        super().__init__(
            nn.Conv2d(in_channels, c1, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(flat, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
