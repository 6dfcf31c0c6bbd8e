"""Dataset readers on files in their real formats, the splits, and the batch loader."""

from __future__ import annotations

import gzip
import pickle
import pickletools
import struct
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import only_run
from torch.utils.data import RandomSampler, SequentialSampler

import accelexp.data.sources as sources
from accelexp.config import typed
from accelexp.data import BatchLoader, DatasetNotFoundError, ImageSet, build_data
from accelexp.data.images import draw_crop_flip, random_crop_flip
from accelexp.data.sources import load_cifar10, read_idx
from accelexp.errors import AccelexpError
from accelexp.train import run

# --- CIFAR-10 ---------------------------------------------------------------------------------


class Py2Pickler(pickle._Pickler):
    """Writes every str as Python 2 wrote its `str`: (SHORT_)BINSTRING bytes, not unicode.

    The real CIFAR-10 pickles come from Python 2; under `pickle.load(f, encoding="latin1")` these
    strings (the dict keys, numpy's dtype codes, the array's raw bytes) decode to str, as there.
    """

    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj: str) -> None:
        raw = obj.encode("latin1")
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[str] = save_py2_str


def write_py2_pickle(path: Path, obj) -> None:
    with open(path, "wb") as f:
        Py2Pickler(f, protocol=2).dump(obj)


CIFAR_SIZES = {**{f"data_batch_{i}": 4 for i in range(1, 6)}, "test_batch": 6}


def cifar_rows(first_id: int, n: int) -> np.ndarray:
    """n rows of 3072 uint8 (R plane, G plane, B plane, each 32x32 row-major), with an id."""
    rng = np.random.default_rng(first_id)
    rows = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    rows[:, 0] = np.arange(first_id, first_id + n)  # R at (0, 0): the image's id
    return rows


@pytest.fixture
def cifar_root(tmp_path) -> tuple[Path, dict[str, dict]]:
    folder = tmp_path / "cifar" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches, first_id = {}, 0
    for name, n in CIFAR_SIZES.items():
        entry = {
            "batch_label": f"{name} of the tiny test set",
            "labels": [(first_id + i) % 10 for i in range(n)],
            "data": cifar_rows(first_id, n),
            "filenames": [f"img_{first_id + i}.png" for i in range(n)],
        }
        write_py2_pickle(folder / name, entry)
        batches[name], first_id = entry, first_id + n
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship"]
    meta = {"num_cases_per_batch": 4, "label_names": [*names, "truck"], "num_vis": 3072}
    write_py2_pickle(folder / "batches.meta", meta)
    return tmp_path / "cifar", batches


def test_the_generated_cifar_files_are_python2_pickles(cifar_root):
    root, _ = cifar_root
    raw = (root / "cifar-10-batches-py" / "data_batch_1").read_bytes()
    ops = list(pickletools.genops(raw))
    assert ops[0][0].name == "PROTO" and ops[0][1] == 2
    assert not {"BINUNICODE", "SHORT_BINUNICODE"} & {op.name for op, _, _ in ops}
    assert {"data", "labels"} <= {arg for op, arg, _ in ops if op.name == "SHORT_BINSTRING"}
    entry = pickle.loads(raw, encoding="latin1")
    assert set(entry) == {"batch_label", "labels", "data", "filenames"}
    assert entry["data"].shape == (4, 3072) and entry["data"].dtype == np.uint8


def test_cifar10_reader_keeps_images_labels_and_channel_planes(compose_cfg, cifar_root):
    root, batches = cifar_root
    cfg = compose_cfg("data=cifar10", f"data.root={root}", "data.download=false")
    train, test = load_cifar10(typed(cfg).data)
    assert train.images.shape == (20, 3, 32, 32) and train.images.dtype == torch.uint8
    assert test.images.shape == (6, 3, 32, 32)
    train_rows = np.concatenate([batches[f"data_batch_{i}"]["data"] for i in range(1, 6)])
    train_labels = [label for i in range(1, 6) for label in batches[f"data_batch_{i}"]["labels"]]
    assert train.labels.tolist() == train_labels
    assert test.labels.tolist() == batches["test_batch"]["labels"]
    for images, rows in ((train, train_rows), (test, batches["test_batch"]["data"])):
        for n, channel, y, x in [(0, 0, 0, 0), (1, 1, 5, 7), (2, 2, 31, 0), (3, 0, 0, 31)]:
            assert images.images[n, channel, y, x] == rows[n, channel * 1024 + y * 32 + x]
    # a whole image: the G plane is the second 1024 bytes, row-major
    green = batches["test_batch"]["data"][4, 1024:2048].reshape(32, 32)
    assert np.array_equal(test.images[4, 1].numpy(), green)


def test_build_data_splits_cifar10(compose_cfg, cifar_root):
    root, _ = cifar_root
    cfg = compose_cfg("data=cifar10", f"data.root={root}", "data.val_fraction=0.25")
    data = build_data(typed(cfg).data, cfg.seed)
    assert (len(data.train), len(data.val), len(data.test)) == (15, 5, 6)
    assert data.train.images.shape[1:] == (3, 32, 32)
    assert (data.in_channels, data.image_size, data.num_classes) == (3, 32, 10)
    ids = torch.cat([data.train.images[:, 0, 0, 0], data.val.images[:, 0, 0, 0]]).long()
    assert sorted(ids.tolist()) == list(range(20))  # every training image in one split
    labels = torch.cat([data.train.labels, data.val.labels])
    assert torch.equal(labels, ids % 10)  # each image keeps its label
    assert torch.equal(data.test.images[:, 0, 0, 0].long(), torch.arange(20, 26))
    assert len(data.mean) == len(data.std) == 3


def test_a_tiny_run_on_cifar10_files(compose_cfg, cifar_root, tracking_uri, tmp_path):
    root, _ = cifar_root
    cfg = compose_cfg("data=cifar10", f"data.root={root}", "data.batch_size=4", "data.augment=true")
    metrics = run(cfg, tmp_path / "out")
    assert 0 <= metrics["test_acc"] <= 1
    assert only_run(tracking_uri).data.params["train_samples"] == "18"


def test_missing_cifar10_names_the_files_and_the_ways_out(compose_cfg, tmp_path):
    cfg = compose_cfg("data=cifar10", f"data.root={tmp_path}", "data.download=false")
    with pytest.raises(DatasetNotFoundError) as caught:
        build_data(typed(cfg).data, cfg.seed)
    message = str(caught.value)
    assert "CIFAR-10" in message
    assert str(tmp_path / "cifar-10-batches-py") in message
    assert "data_batch_1" in message and "test_batch" in message
    assert "data.root" in message and "data.download=true" in message
    assert isinstance(caught.value, AccelexpError)


# --- Fashion-MNIST and IDX files --------------------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="Debian's dataset-fashion-mnist is Linux-only")
def test_fashion_mnist_from_the_debian_package(compose_cfg):
    assert str(sources.DEBIAN_FASHION_MNIST) == "/usr/share/datasets/fashion-mnist"
    cfg = compose_cfg("data=fashion_mnist", "data.download=false")
    data = build_data(typed(cfg).data, cfg.seed)
    assert (len(data.train), len(data.val), len(data.test)) == (54000, 6000, 10000)
    assert data.train.images.shape[1:] == (1, 28, 28)
    assert data.test.images.shape == (10000, 1, 28, 28)
    assert data.num_classes == 10
    assert torch.bincount(data.test.labels).tolist() == [1000] * 10
    assert 0.2 < data.mean[0] < 0.4 and 0.25 < data.std[0] < 0.45  # grey clothes on black


def idx_bytes(array: np.ndarray, code: int) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.tobytes()


def write_idx(directory: Path, stem: str, array: np.ndarray, gz: bool) -> None:
    payload = idx_bytes(array, 0x08)
    if gz:
        (directory / f"{stem}.gz").write_bytes(gzip.compress(payload))
    else:
        (directory / stem).write_bytes(payload)


def tiny_fashion_mnist(directory: Path, gz: bool) -> dict[str, np.ndarray]:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(12) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.array([9, 0, 3, 3, 1], dtype=np.uint8),
    }
    arrays["train-images-idx3-ubyte"][:, 0, 0] = np.arange(12)  # an id per image
    for stem, array in arrays.items():
        write_idx(directory, stem, array, gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
@pytest.mark.parametrize("layout", ["flat", "torchvision"])
def test_fashion_mnist_idx_files_under_data_root(compose_cfg, tmp_path, gz, layout):
    directory = tmp_path if layout == "flat" else tmp_path / "FashionMNIST" / "raw"
    arrays = tiny_fashion_mnist(directory, gz)
    cfg = compose_cfg("data=fashion_mnist", f"data.root={tmp_path}", "data.download=false")
    data = build_data(typed(cfg).data, cfg.seed)
    assert (len(data.train), len(data.val), len(data.test)) == (11, 1, 5)  # not Debian's files
    assert data.test.images.shape == (5, 1, 28, 28) and data.test.images.dtype == torch.uint8
    assert np.array_equal(data.test.images[:, 0].numpy(), arrays["t10k-images-idx3-ubyte"])
    assert data.test.labels.tolist() == [9, 0, 3, 3, 1]
    ids = torch.cat([data.train.images[:, 0, 0, 0], data.val.images[:, 0, 0, 0]]).long()
    assert sorted(ids.tolist()) == list(range(12))
    assert torch.equal(torch.cat([data.train.labels, data.val.labels]), ids % 10)


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_read_idx_handles_every_shape_and_big_endian_types(tmp_path, gz):
    values = (np.arange(-6, 6).reshape(2, 3, 2) * 1000).astype(">i2")
    payload = idx_bytes(values, 0x0B)
    path = tmp_path / ("values.gz" if gz else "values")
    path.write_bytes(gzip.compress(payload) if gz else payload)
    read = read_idx(path)
    assert read.shape == (2, 3, 2)
    assert read.tolist() == values.tolist()


def test_read_idx_rejects_other_files(tmp_path):
    path = tmp_path / "not-idx"
    path.write_bytes(b"\x1f\x8b\x08\x00not an idx file")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(path)


def test_missing_fashion_mnist_says_where_it_looked_and_what_to_do(
    compose_cfg, tmp_path, monkeypatch
):
    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian-package")
    cfg = compose_cfg("data=fashion_mnist", f"data.root={tmp_path}", "data.download=false")
    with pytest.raises(DatasetNotFoundError) as caught:
        build_data(typed(cfg).data, cfg.seed)
    message = str(caught.value)
    assert "Fashion-MNIST" in message
    assert str(tmp_path) in message
    assert "data.root" in message
    assert "apt-get install dataset-fashion-mnist" in message


# --- the batch loader -------------------------------------------------------------------------


def id_set(n: int = 50, channels: int = 3, size: int = 8, seed: int = 0) -> ImageSet:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, channels, size, size), generator=g, dtype=torch.uint8)
    return ImageSet(images, torch.arange(n))  # label = index: which samples a pass visited


CPU = torch.device("cpu")


@pytest.mark.parametrize("sampler_kind", ["random", "sequential"])
def test_a_pass_visits_every_sample_exactly_once(sampler_kind):
    data = id_set(50)
    sampler = (
        RandomSampler(range(50), generator=torch.Generator().manual_seed(1))
        if sampler_kind == "random"
        else SequentialSampler(range(50))
    )
    loader = BatchLoader(data, 8, sampler, CPU, [0.5] * 3, [0.25] * 3, augment=True)
    assert len(loader) == 7
    orders = []
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert [len(labels) for _, labels in batches] == [8] * 6 + [2]
        seen = torch.cat([labels for _, labels in batches])
        assert sorted(seen.tolist()) == list(range(50))
        orders.append(seen.tolist())
    if sampler_kind == "random":
        assert orders[0] != orders[1]  # reshuffled each epoch
    else:
        assert orders[0] == list(range(50))


def test_drop_last_drops_only_the_short_batch():
    loader = BatchLoader(id_set(50), 8, SequentialSampler(range(50)), CPU, [0.5] * 3, [0.25] * 3,
                         drop_last=True)  # fmt: skip
    seen = torch.cat([labels for _, labels in loader])
    assert len(loader) == 6 and seen.tolist() == list(range(48))


def test_augmentation_keeps_shape_dtype_and_labels_and_moves_pixels():
    data = id_set(32, channels=3, size=16)
    identity = {"mean": [0.0] * 3, "std": [1 / 255] * 3}  # normalising leaves raw pixel values
    plain = BatchLoader(data, 32, SequentialSampler(range(32)), CPU, **identity)
    augmented = BatchLoader(data, 32, SequentialSampler(range(32)), CPU, augment=True, seed=3,
                            **identity)  # fmt: skip
    (x, y), (xa, ya) = next(iter(plain)), next(iter(augmented))
    assert xa.shape == x.shape == (32, 3, 16, 16)
    assert xa.dtype == x.dtype == torch.float32
    assert torch.equal(ya, y)
    assert torch.equal(x, data.images.float())
    assert not torch.equal(xa, x)
    pad = augmented.pad
    assert pad == 2
    for original, out in zip(data.images.float(), xa, strict=True):
        assert is_crop_or_flipped_crop(original, out, pad)


def is_crop_or_flipped_crop(original: torch.Tensor, out: torch.Tensor, pad: int) -> bool:
    padded = torch.nn.functional.pad(original, (pad, pad, pad, pad))
    size = original.shape[-1]
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            crop = padded[:, dy : dy + size, dx : dx + size]
            if torch.equal(out, crop) or torch.equal(out, crop.flip(-1)):
                return True
    return False


def test_random_crop_flip_is_seeded_and_only_flips_without_padding():
    x = id_set(20, size=6).images
    a = random_crop_flip(x, 0, *draw_crop_flip(20, 0, torch.Generator().manual_seed(5)))
    b = random_crop_flip(x, 0, *draw_crop_flip(20, 0, torch.Generator().manual_seed(5)))
    assert torch.equal(a, b)
    flipped = [not torch.equal(o, i) for o, i in zip(a, x, strict=True)]
    for out, image, was_flipped in zip(a, x, flipped, strict=True):
        assert torch.equal(out, image.flip(-1) if was_flipped else image)
    assert 0 < sum(flipped) < 20


def test_normalisation_gives_zero_mean_unit_std_per_channel():
    data = id_set(64, channels=3, size=8, seed=4)
    data.images[:, 1] //= 4  # channels with different statistics
    data.images[:, 2] = data.images[:, 2] // 2 + 100
    mean, std = data.channel_stats()
    raw = data.images.double() / 255
    assert mean == pytest.approx(raw.mean(dim=(0, 2, 3)).tolist())
    assert std == pytest.approx(raw.std(dim=(0, 2, 3), correction=0).tolist())
    loader = BatchLoader(data, 10, SequentialSampler(range(64)), CPU, mean, std)
    x = torch.cat([images for images, _ in loader])
    assert x.mean(dim=(0, 2, 3)).abs().max() < 1e-4
    assert x.std(dim=(0, 2, 3), correction=0) == pytest.approx([1.0] * 3, abs=1e-4)


def test_worker_processes_yield_the_same_batches():
    data = id_set(30)
    common = {"device": CPU, "mean": [0.5] * 3, "std": [0.25] * 3}
    inline = BatchLoader(data, 8, SequentialSampler(range(30)), **common)
    workers = BatchLoader(data, 8, SequentialSampler(range(30)), num_workers=1, **common)
    for (x0, y0), (x1, y1) in zip(inline, workers, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
