"""In-memory image sets, and the whole-batch augmentation the loader applies on the device.

Small image datasets live in memory as one uint8 tensor (N, C, H, W): a batch is one indexing
operation, never one PIL image at a time. `accelexp.data.loaders` turns a set into batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


class ImageSet(Dataset):
    """Images (N, C, H, W) uint8 and labels (N,) int64; indexing with a list gathers a batch."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(
                f"images must be uint8 (N, C, H, W), got {images.dtype} {images.shape}"
            )
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels.long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    @property
    def nbytes(self) -> int:
        return self.images.nbytes + self.labels.nbytes

    def subset(self, indices: torch.Tensor) -> ImageSet:
        return ImageSet(self.images[indices], self.labels[indices])

    def channel_stats(self, chunk_elements: int = 1 << 24) -> tuple[list[float], list[float]]:
        """Per-channel mean and std in [0, 1] units, from exact integer sums over the pixels.

        Chunks of about `chunk_elements` pixels bound the memory (int32 squares, int64 sums),
        whatever the image size.
        """
        n, c, h, w = self.images.shape
        chunk = max(1, chunk_elements // (c * h * w))
        total = torch.zeros(c, dtype=torch.int64)
        total_sq = torch.zeros(c, dtype=torch.int64)
        for start in range(0, n, chunk):
            x = self.images[start : start + chunk].to(torch.int32)
            total += x.sum(dim=(0, 2, 3), dtype=torch.int64)
            total_sq += (x * x).sum(dim=(0, 2, 3), dtype=torch.int64)
        count = n * h * w
        mean = total.double() / (count * 255)
        std = (total_sq.double() / (count * 255**2) - mean**2).clamp_min(1e-12).sqrt()
        return mean.tolist(), std.tolist()


@dataclass
class DataBundle:
    """The three splits of a dataset and what the model and the loader need to know about it."""

    name: str
    train: ImageSet
    val: ImageSet
    test: ImageSet
    num_classes: int
    mean: Sequence[float]
    std: Sequence[float]

    @property
    def in_channels(self) -> int:
        return self.train.images.shape[1]

    @property
    def image_size(self) -> int:
        return self.train.images.shape[2]

    @property
    def nbytes(self) -> int:
        """What holding every split on a device takes (val is test when it is not held out)."""
        splits = {id(s): s for s in (self.train, self.val, self.test)}
        return sum(split.nbytes for split in splits.values())


def draw_crop_flip(
    n: int, pad: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random crop offsets (2, n) in [0, 2 * pad] and horizontal flips (n,) for a batch of n."""
    shifts = torch.randint(0, 2 * pad + 1, (2, n), generator=generator)
    flips = torch.rand(n, generator=generator) < 0.5
    return shifts, flips


def random_crop_flip(
    x: torch.Tensor, pad: int, shifts: torch.Tensor, flips: torch.Tensor
) -> torch.Tensor:
    """Per-sample crop (zero padding `pad`, offsets `shifts`) and flip of a batch, in one gather.

    `shifts` and `flips` (from `draw_crop_flip`) live on the batch's device.
    """
    n, c, h, w = x.shape
    rows = shifts[0, :, None] + torch.arange(h, device=x.device)
    cols = shifts[1, :, None] + torch.arange(w, device=x.device)
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    padded = F.pad(x, (pad, pad, pad, pad))
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chan = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, chan, rows[:, None, :, None], cols[:, None, None, :]]
