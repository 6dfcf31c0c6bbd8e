"""The two data paths — the set held on the device, batches gathered on the host — give the same
batches as the loader always gave: same order, same augmentation, same values.

`reference_batches` is the loader as it was before the on-device path existed (gather on the
host, draw each batch's crop and flip from the seeded generator, normalise): the specification
both paths are held to. On this CPU-only machine the "device" is the CPU, so the on-device path
runs for real here (gathers with index_select from the held set); the CUDA prefetcher's streams
are checked on a GPU by `scripts/gpu_check.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from accelexp.data import BatchLoader, ImageSet, resolve_on_device
from accelexp.parallel.base import ShardSampler

CPU = torch.device("cpu")
MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]


def image_set(n: int = 96, size: int = 12, seed: int = 0) -> ImageSet:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)
    return ImageSet(images, torch.arange(n) % 10)


def reference_batches(
    dataset, batch_size, sampler, *, augment, drop_last, seed, epochs, steps=None
):
    """The pre-existing loader, inlined: host gather, per-batch crop/flip draws, normalise."""
    generator = torch.Generator().manual_seed(seed)
    pad = max(2, dataset.images.shape[-1] // 8) if augment else 0
    mean = torch.tensor(MEAN).view(1, -1, 1, 1) * 255
    inv_std = 1 / (torch.tensor(STD).view(1, -1, 1, 1) * 255)
    out = []
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch) if hasattr(sampler, "set_epoch") else None
        for k, indices in enumerate(BatchSampler(sampler, batch_size, drop_last)):
            if steps is not None and k == steps:
                break
            images, labels = dataset[torch.as_tensor(indices)]
            if pad:
                n, c, h, w = images.shape
                shifts = torch.randint(0, 2 * pad + 1, (2, n), generator=generator)
                flip = torch.rand(n, generator=generator) < 0.5
                rows = shifts[0, :, None] + torch.arange(h)
                cols = shifts[1, :, None] + torch.arange(w)
                cols = torch.where(flip[:, None], cols.flip(1), cols)
                padded = F.pad(images, (pad, pad, pad, pad))
                images = padded[
                    torch.arange(n)[:, None, None, None],
                    torch.arange(c)[None, :, None, None],
                    rows[:, None, :, None],
                    cols[:, None, None, :],
                ]
            out.append(((images.float() - mean) * inv_std, labels))
    return out


def loader_batches(loader: BatchLoader, epochs: int) -> list:
    out = []
    for epoch in range(1, epochs + 1):
        loader.set_epoch(epoch)
        out += list(loader)
    return out


def assert_same(batches_a: list, batches_b: list) -> None:
    assert len(batches_a) == len(batches_b)
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b, strict=True):
        assert torch.equal(ya, yb)
        assert torch.equal(xa, xb)


def distributed(n: int, replicas: int, rank: int) -> DistributedSampler:
    return DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=True, seed=7)


@pytest.mark.parametrize("on_device", [True, False])
@pytest.mark.parametrize("augment", [True, False])
def test_both_paths_give_the_batches_the_loader_always_gave(on_device, augment):
    data = image_set()
    expected = reference_batches(
        data, 16, distributed(96, 1, 0), augment=augment, drop_last=True, seed=3, epochs=3
    )
    loader = BatchLoader(
        data, 16, distributed(96, 1, 0), CPU, MEAN, STD,
        augment=augment, drop_last=True, seed=3, on_device=on_device,
    )  # fmt: skip
    assert loader.placement == ("device" if on_device else "host")
    assert_same(loader_batches(loader, 3), expected)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_of_two_gets_its_own_shard_the_same_way_on_both_paths(rank):
    data = image_set(100)
    kwargs = {"augment": True, "drop_last": True, "seed": 11 + rank}
    expected = reference_batches(data, 8, distributed(100, 2, rank), epochs=2, **kwargs)
    held = BatchLoader(data, 8, distributed(100, 2, rank), CPU, MEAN, STD, on_device=True, **kwargs)
    host = BatchLoader(
        data, 8, distributed(100, 2, rank), CPU, MEAN, STD, on_device=False, **kwargs
    )
    assert_same(loader_batches(held, 2), expected)
    assert_same(loader_batches(host, 2), expected)


def test_an_evaluation_shard_is_all_the_device_holds():
    data = image_set(50)
    shard = ShardSampler(50, world_size=3, rank=1)
    loader = BatchLoader(data, 7, shard, CPU, MEAN, STD, on_device=True)
    assert len(loader.images) == len(shard) == 17  # 1, 4, 7, ..., 49
    expected = reference_batches(data, 7, ShardSampler(50, 3, 1), augment=False,
                                 drop_last=False, seed=0, epochs=1)  # fmt: skip
    batches = list(loader)
    assert [len(y) for _, y in batches] == [7, 7, 3]
    assert_same(batches, expected)


def test_max_batches_caps_an_epoch_and_draws_augmentation_only_for_the_batches_used():
    data = image_set()
    sampler = RandomSampler(range(96), generator=torch.Generator().manual_seed(2))
    loader = BatchLoader(
        data, 16, sampler, CPU, MEAN, STD, augment=True, drop_last=True, seed=5, max_batches=2
    )
    assert len(loader) == 2
    sampler_again = RandomSampler(range(96), generator=torch.Generator().manual_seed(2))
    expected = reference_batches(data, 16, sampler_again, augment=True, drop_last=True, seed=5,
                                 epochs=3, steps=2)  # fmt: skip
    assert_same(loader_batches(loader, 3), expected)


def test_the_batches_leave_in_the_memory_format_the_model_wants():
    data = image_set(32)
    for on_device in (True, False):
        loader = BatchLoader(data, 8, SequentialSampler(range(32)), CPU, MEAN, STD, augment=True,
                             on_device=on_device, memory_format=torch.channels_last)  # fmt: skip
        plain = BatchLoader(data, 8, SequentialSampler(range(32)), CPU, MEAN, STD, augment=True,
                            on_device=on_device)  # fmt: skip
        for (x, _), (x_plain, _) in zip(loader, plain, strict=True):
            assert x.is_contiguous(memory_format=torch.channels_last)
            assert not x.is_contiguous()
            assert x_plain.is_contiguous()
            assert torch.equal(x, x_plain)  # the same values, laid out NHWC


def test_on_device_with_loader_workers_is_refused():
    with pytest.raises(ValueError, match="num_workers"):
        BatchLoader(image_set(), 8, SequentialSampler(range(96)), CPU, MEAN, STD,
                    on_device=True, num_workers=2)  # fmt: skip


def test_auto_holds_the_set_where_the_cpu_computes_unless_workers_were_asked_for():
    assert resolve_on_device("auto", CPU, nbytes=10**12) is True
    assert resolve_on_device("auto", CPU, nbytes=10, num_workers=2) is False
    assert resolve_on_device(False, CPU, nbytes=10) is False
    assert resolve_on_device(True, CPU, nbytes=10**12) is True


def test_auto_on_a_gpu_holds_the_set_when_it_takes_at_most_a_quarter_of_the_free_memory(
    monkeypatch,
):
    """The rule alone (this machine has no GPU): free memory as CUDA would report it."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4_000, 10_000))
    assert resolve_on_device("auto", gpu, nbytes=1_000) is True
    assert resolve_on_device("auto", gpu, nbytes=1_001) is False
    assert resolve_on_device("auto", gpu, nbytes=10, num_workers=1) is False
