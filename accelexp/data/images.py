"""In-memory image sets and the batch loader that feeds the training loop.

Small image datasets live in memory as one uint8 tensor (N, C, H, W). A batch is gathered with
one indexing operation, moved to the device as uint8 (4x fewer bytes than float), then augmented
(random crop with zero padding, horizontal flip) and normalised there, as whole-batch tensor ops.
Nothing is decoded one PIL image at a time, so the data path is never the bottleneck of a small
model (the overhead benchmark prints loader-only samples/s beside training samples/s).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler


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

    def subset(self, indices: torch.Tensor) -> ImageSet:
        return ImageSet(self.images[indices], self.labels[indices])

    def channel_stats(self, chunk: int = 8192) -> tuple[list[float], list[float]]:
        """Per-channel mean and std in [0, 1] units, computed in chunks to bound memory."""
        total = torch.zeros(self.images.shape[1], dtype=torch.float64)
        total_sq = torch.zeros_like(total)
        for start in range(0, len(self), chunk):
            x = self.images[start : start + chunk].to(torch.float64) / 255
            total += x.sum(dim=(0, 2, 3))
            total_sq += (x * x).sum(dim=(0, 2, 3))
        count = len(self) * self.images.shape[2] * self.images.shape[3]
        mean = total / count
        std = (total_sq / count - mean**2).clamp_min(1e-12).sqrt()
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


def random_crop_flip(x: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Per-sample random crop (zero padding `pad`) and horizontal flip of a batch, in one gather."""
    n, c, h, w = x.shape
    shifts = torch.randint(0, 2 * pad + 1, (2, n), generator=generator).to(x.device)
    flip = torch.rand(n, generator=generator).to(x.device) < 0.5
    rows = shifts[0, :, None] + torch.arange(h, device=x.device)
    cols = shifts[1, :, None] + torch.arange(w, device=x.device)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    padded = F.pad(x, (pad, pad, pad, pad))
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chan = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, chan, rows[:, None, :, None], cols[:, None, None, :]]


class BatchLoader:
    """Yields (images float32 normalised, labels) on `device`, in the order `sampler` gives.

    `sampler` is any torch Sampler (random, sequential, or a rank's shard); `set_epoch` is
    forwarded to it so a DistributedSampler reshuffles each epoch. With `num_workers > 0` the
    gathering runs in DataLoader worker processes (rarely useful for in-memory data).
    """

    def __init__(
        self,
        dataset: ImageSet,
        batch_size: int,
        sampler: Sampler[int],
        device: torch.device,
        mean: Sequence[float],
        std: Sequence[float],
        augment: bool = False,
        drop_last: bool = False,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.batches = BatchSampler(sampler, batch_size, drop_last)
        self.device = device
        self.num_workers = num_workers
        self.pad = max(2, dataset.images.shape[-1] // 8) if augment else 0
        self.generator = torch.Generator().manual_seed(seed)
        shape = (1, -1, 1, 1)
        self.mean = torch.tensor(mean, device=device).view(shape) * 255
        self.inv_std = 1 / (torch.tensor(std, device=device).view(shape) * 255)

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _raw_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.num_workers == 0:
            for indices in self.batches:
                yield self.dataset[torch.as_tensor(indices)]
        else:
            yield from DataLoader(
                self.dataset,
                batch_size=None,
                sampler=self.batches,
                num_workers=self.num_workers,
                pin_memory=self.device.type == "cuda",
                persistent_workers=False,
            )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        non_blocking = self.device.type == "cuda"
        for images, labels in self._raw_batches():
            images = images.to(self.device, non_blocking=non_blocking)
            labels = labels.to(self.device, non_blocking=non_blocking)
            if self.pad:
                images = random_crop_flip(images, self.pad, self.generator)
            yield (images.float() - self.mean) * self.inv_std, labels
