"""The batch loader: (images, labels) on the device, in the sampler's order, by one of two paths.

Each epoch is planned on the host once, when its iteration starts: the sampler's indices for the
epoch's batches (at most `max_batches` of them) and, with `augment`, every sample's crop offset
and flip, drawn from the loader's seeded generator batch by batch. Then the batches come from:

- **the device** (`on_device=True`): the uint8 set — or, for an evaluation shard whose samples
  never change, just this rank's share — is copied to the device once, at construction. The
  epoch's plan is copied once per epoch; each batch is an `index_select` on the device. Per step
  the host only launches kernels: no gather, no copy.
- **the host** (`on_device=False`): each batch is gathered on the host and copied. On CUDA the
  gather writes straight into pinned staging buffers and the copy runs on a side stream,
  `prefetch` batches ahead of the loop (`CudaPrefetcher`), so it overlaps the step's compute.
  With `num_workers > 0` DataLoader worker processes gather instead.

Either way the crop/flip and the normalisation run on the device as whole-batch operations and
the batch leaves in the memory format the model wants (`channels_last` or not). Both paths give
the same batches: same order, same augmentation, same values.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from accelexp.data.images import ImageSet, draw_crop_flip, random_crop_flip

# `data.on_device=auto` on a GPU: the sets must fit in this share of its free memory, leaving the
# rest to the model, its activations and the allocator's cache.
ON_DEVICE_SHARE_OF_FREE_MEMORY = 0.25

Batch = tuple[torch.Tensor, torch.Tensor]


def resolve_on_device(
    request: bool | str, device: torch.device, nbytes: int, num_workers: int = 0
) -> bool:
    """`data.on_device`: true/false as asked; `auto` decides from the device and the set's size.

    On a CPU the set already is in the memory the model reads, so holding it "on the device"
    costs nothing. On a GPU, auto holds it when it takes at most a quarter of the free memory.
    """
    if request != "auto":
        return bool(request)
    if num_workers > 0:  # the user asked for host-side workers
        return False
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= ON_DEVICE_SHARE_OF_FREE_MEMORY * free


@dataclass
class EpochPlan:
    """One epoch, decided on the host: which samples, in which batches, augmented how."""

    indices: torch.Tensor  # (N,) int64: the epoch's samples, batch after batch
    sizes: list[int]  # the batch sizes, summing to N
    shifts: torch.Tensor | None = None  # (2, N) crop offsets, with augmentation
    flips: torch.Tensor | None = None  # (N,) bool horizontal flips, with augmentation

    def to(self, device: torch.device) -> EpochPlan:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device == device:
                return t
            return t.pin_memory().to(device, non_blocking=True)

        return EpochPlan(move(self.indices), self.sizes, move(self.shifts), move(self.flips))

    def spans(self) -> Iterator[slice]:
        start = 0
        for size in self.sizes:
            yield slice(start, start + size)
            start += size


class CudaPrefetcher:
    """Host batches to the GPU `depth` batches ahead of the loop, copied on a side stream.

    Each batch is gathered straight into one of `depth + 1` pinned staging buffers and copied
    with `non_blocking=True` on a side stream; the loop's stream waits for that copy's event only
    when it takes the batch, and `record_stream` tells the allocator that the loop's stream uses
    the batch's memory. A staging buffer is overwritten only once its previous copy has finished.
    """

    def __init__(self, device: torch.device, depth: int = 2) -> None:
        self.device = device
        self.depth = max(1, depth)
        self.stream = torch.cuda.Stream(device)
        self._staging: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []

    def _buffers(self, slot: int, images: torch.Tensor, labels: torch.Tensor, rows: int):
        while len(self._staging) <= slot:
            self._staging.append(
                (
                    torch.empty((rows, *images.shape[1:]), dtype=images.dtype, pin_memory=True),
                    torch.empty((rows,), dtype=labels.dtype, pin_memory=True),
                    torch.cuda.Event(),
                )
            )
        return self._staging[slot]

    def batches(self, images: torch.Tensor, labels: torch.Tensor, plan: EpochPlan) -> Iterator:
        """(images, labels) on the GPU for each batch of `plan`, gathered from host tensors."""
        rows = max(plan.sizes, default=0)
        pending: deque[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = deque()
        for step, span in enumerate(plan.spans()):
            staged_images, staged_labels, copied = self._buffers(
                step % (self.depth + 1), images, labels, rows
            )
            copied.synchronize()  # this buffer's previous copy to the GPU has finished
            n = span.stop - span.start
            index = plan.indices[span]
            torch.index_select(images, 0, index, out=staged_images[:n])
            torch.index_select(labels, 0, index, out=staged_labels[:n])
            with torch.cuda.stream(self.stream):
                on_gpu = (
                    staged_images[:n].to(self.device, non_blocking=True),
                    staged_labels[:n].to(self.device, non_blocking=True),
                )
                copied.record(self.stream)
            pending.append((*on_gpu, copied))
            if len(pending) > self.depth:
                yield self._hand_over(*pending.popleft())
        while pending:
            yield self._hand_over(*pending.popleft())

    def _hand_over(self, images: torch.Tensor, labels: torch.Tensor, copied: torch.cuda.Event):
        loop_stream = torch.cuda.current_stream(self.device)
        loop_stream.wait_event(copied)
        images.record_stream(loop_stream)
        labels.record_stream(loop_stream)
        return images, labels


class BatchLoader:
    """Yields (images float32 normalised, labels) on `device`, in the order `sampler` gives.

    `sampler` is any torch Sampler (random, sequential, or a rank's shard); `set_epoch` is
    forwarded to it so a DistributedSampler reshuffles each epoch. A sampler with a fixed
    `indices` attribute (`ShardSampler`, an evaluation shard) lets the on-device path hold only
    those samples.
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
        on_device: bool = False,
        max_batches: int | None = None,
        memory_format: torch.memory_format = torch.contiguous_format,
        prefetch: int = 2,
    ) -> None:
        if on_device and num_workers > 0:
            raise ValueError("on_device=True gathers on the device: num_workers must be 0")
        self.dataset = dataset
        self.sampler = sampler
        self.batches = BatchSampler(sampler, batch_size, drop_last)
        self.device = device
        self.num_workers = num_workers
        self.max_batches = max_batches
        self.memory_format = memory_format
        self.on_device = on_device
        self.pad = max(2, dataset.images.shape[-1] // 8) if augment else 0
        self.generator = torch.Generator().manual_seed(seed)
        shape = (1, -1, 1, 1)
        self.mean = torch.tensor(mean, device=device).view(shape) * 255
        self.inv_std = 1 / (torch.tensor(std, device=device).view(shape) * 255)
        self._position: torch.Tensor | None = None  # dataset index -> row of the held images
        if on_device:
            self._hold_on_device()
        self._prefetcher = (
            CudaPrefetcher(device, prefetch)
            if device.type == "cuda" and not on_device and num_workers == 0
            else None
        )

    @property
    def placement(self) -> str:
        """Where batches come from: device (held there), prefetch (pinned, side stream), host."""
        if self.on_device:
            return "device"
        return "prefetch" if self._prefetcher is not None else "host"

    def _hold_on_device(self) -> None:
        fixed = getattr(self.sampler, "indices", None)
        images, labels = self.dataset.images, self.dataset.labels
        if fixed is not None and len(fixed) < len(self.dataset):
            held = torch.as_tensor(list(fixed), dtype=torch.long)
            self._position = torch.full((len(self.dataset),), -1, dtype=torch.long)
            self._position[held] = torch.arange(len(held))
            images, labels = images[held], labels[held]
        self.images = images.to(self.device)
        self.labels = labels.to(self.device)

    def __len__(self) -> int:
        batches = len(self.batches)
        return min(batches, self.max_batches) if self.max_batches else batches

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def plan_epoch(self) -> EpochPlan:
        """The next epoch's batches and their augmentation, drawn on the host."""
        chosen = [batch for _, batch in zip(range(len(self)), self.batches, strict=False)]
        sizes = [len(batch) for batch in chosen]
        indices = torch.tensor([i for batch in chosen for i in batch], dtype=torch.long)
        if not self.pad:
            return EpochPlan(indices, sizes)
        drawn = [draw_crop_flip(n, self.pad, self.generator) for n in sizes]
        shifts = torch.cat([s for s, _ in drawn], dim=1) if drawn else torch.zeros(2, 0)
        flips = torch.cat([f for _, f in drawn]) if drawn else torch.zeros(0, dtype=torch.bool)
        return EpochPlan(indices, sizes, shifts.long(), flips)

    def __iter__(self) -> Iterator[Batch]:
        plan = self.plan_epoch()
        if self.on_device and self._position is not None:  # rows of the held shard
            plan.indices = self._position[plan.indices]
        on_device = plan.to(self.device)  # one copy per epoch: indices and augmentation
        if self.on_device:
            raw = self._device_batches(on_device)
        elif self._prefetcher is not None:
            raw = self._prefetcher.batches(self.dataset.images, self.dataset.labels, plan)
        else:
            raw = self._host_batches(plan)
        for span, (images, labels) in zip(on_device.spans(), raw, strict=True):
            if self.pad:
                images = random_crop_flip(
                    images, self.pad, on_device.shifts[:, span], on_device.flips[span]
                )
            images = images.contiguous(memory_format=self.memory_format)
            yield (images.float() - self.mean) * self.inv_std, labels

    def _device_batches(self, plan: EpochPlan) -> Iterator[Batch]:
        for span in plan.spans():
            index = plan.indices[span]
            yield self.images.index_select(0, index), self.labels.index_select(0, index)

    def _host_batches(self, plan: EpochPlan) -> Iterator[Batch]:
        non_blocking = self.device.type == "cuda"
        if self.num_workers == 0:
            gathered = (self.dataset[plan.indices[span]] for span in plan.spans())
        else:
            gathered = DataLoader(
                self.dataset,
                batch_size=None,
                sampler=[plan.indices[span].tolist() for span in plan.spans()],
                num_workers=self.num_workers,
                pin_memory=non_blocking,
                persistent_workers=False,
            )
        for images, labels in gathered:
            yield (
                images.to(self.device, non_blocking=non_blocking),
                labels.to(self.device, non_blocking=non_blocking),
            )
