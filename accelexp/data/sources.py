"""Readers of the real dataset formats, and the synthetic set. Each returns (train, test) ImageSets.

- Fashion-MNIST: the IDX files (`train-images-idx3-ubyte[.gz]`, ...), looked for in `data.root`
  (directly or in torchvision's `FashionMNIST/raw/` layout), then in Debian's
  `/usr/share/datasets/fashion-mnist/`, then downloaded by torchvision when the network allows.
- CIFAR-10: the python pickles of `cifar-10-batches-py/` (`data_batch_1..5`, `test_batch`) under
  `data.root`, downloaded and md5-checked by torchvision's helper when missing and allowed.
- synthetic: class prototypes (smooth random patterns) plus noise, generated from a fixed seed,
  so the set is the same in every run and a model can learn it.

A `data.root` the user gives must exist (outside `outputs/data/`, accelexp's own download folder):
a typo there is an error naming it, not a quiet fall-back to another copy. `set_shape(cfg)` says
how big a set is before it is loaded (what `accelexp.config.resources` checks).
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from accelexp.data.images import ImageSet
from accelexp.errors import AccelexpError
from accelexp.schema import DataConfig, StoredDataConfig, SyntheticDataConfig

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
DEFAULT_DOWNLOAD_ROOT = Path("outputs/data")


class DatasetNotFoundError(AccelexpError, FileNotFoundError):
    """The dataset is not on disk and could not be downloaded; the message lists the options."""


class SetShape(NamedTuple):
    num_train: int
    num_test: int
    channels: int
    image_size: int
    num_classes: int

    def peak_bytes(self, synthetic: bool) -> int:
        """Memory the loaded set takes at its peak: the uint8 images, and while a synthetic set
        is generated, about three float32 copies of its larger split."""
        pixels = self.channels * self.image_size**2
        held = (self.num_train + self.num_test) * pixels
        return held + (12 * max(self.num_train, self.num_test) * pixels if synthetic else 0)


KNOWN_SHAPES = {
    "fashion_mnist": SetShape(60000, 10000, 1, 28, 10),
    "cifar10": SetShape(50000, 10000, 3, 32, 10),
}


def set_shape(cfg: DataConfig | DictConfig) -> SetShape | None:
    """The size of the set `cfg` (`data`) names, without loading it; None for an unknown name.
    The config's checks ask it too, of the DictConfig (before the config is typed)."""
    if cfg.name == "synthetic":
        return SetShape(cfg.num_train, cfg.num_test, cfg.channels, cfg.image_size, cfg.num_classes)
    return KNOWN_SHAPES.get(cfg.name)


def _given_root(cfg: StoredDataConfig, holds: str) -> Path | None:
    """`data.root`, which must exist unless it is inside accelexp's own download folder."""
    if not cfg.root:
        return None
    root = Path(cfg.root).expanduser()
    fix = f"point data.root at the folder that holds {holds}, or leave data.root=null for the "
    fix += "default places."
    try:
        ours = root.resolve().is_relative_to(DEFAULT_DOWNLOAD_ROOT.resolve())
        exists, is_dir = root.exists(), root.is_dir()
    except OSError as error:  # a name too long for the file system, a folder it cannot read
        raise DatasetNotFoundError(
            f"data.root={_shown(cfg.root)} cannot be used ({error.strerror}): {fix}"
        ) from None
    if exists and not is_dir:
        raise DatasetNotFoundError(f"data.root={cfg.root} is a file, not a folder: {holds}.")
    if not exists and not ours:
        raise DatasetNotFoundError(f"data.root={cfg.root} does not exist: {fix}")
    return root


def _shown(text: str, most: int = 120) -> str:
    """`text`, or its start and end around an ellipsis when it is longer than `most`."""
    if len(text) <= most:
        return text
    return f"{text[: most // 2]}…{text[-most // 4 :]} ({len(text)} characters)"


# --- Fashion-MNIST ---------------------------------------------------------------------------

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_FMNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = int.from_bytes(data[:2], "big"), data[2], data[3]
    if zero != 0 or dtype_code not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    array = np.frombuffer(data, dtype=_IDX_DTYPES[dtype_code], offset=4 + 4 * ndim)
    return array.reshape(shape)


def _find_idx(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def _fashion_mnist_dir(candidates: list[Path]) -> Path | None:
    for directory in candidates:
        if all(_find_idx(directory, stem) for stem in _FMNIST_FILES.values()):
            return directory
    return None


def load_fashion_mnist(cfg: StoredDataConfig) -> tuple[ImageSet, ImageSet]:
    root = _given_root(cfg, "train-images-idx3-ubyte.gz and the other three IDX files")
    roots = [root] if root else []
    candidates = [d for r in roots for d in (r, r / "FashionMNIST" / "raw")] + [
        DEBIAN_FASHION_MNIST
    ]
    directory = _fashion_mnist_dir(candidates)
    if directory is None and cfg.download:
        download_root = roots[0] if roots else DEFAULT_DOWNLOAD_ROOT
        directory = _download("Fashion-MNIST", lambda: _torchvision_fashion_mnist(download_root))
    if directory is None:
        raise DatasetNotFoundError(
            "Fashion-MNIST was not found. Looked in: "
            + ", ".join(str(c) for c in candidates)
            + ". Either (1) point data.root at a folder holding train-images-idx3-ubyte.gz and the "
            "other three IDX files, (2) install Debian's package: `apt-get install "
            "dataset-fashion-mnist` (the setup does this), or (3) allow data.download=true on a "
            "machine with internet access."
        )
    arrays = {key: read_idx(_find_idx(directory, stem)) for key, stem in _FMNIST_FILES.items()}

    def image_set(split: str) -> ImageSet:
        images = torch.from_numpy(arrays[f"{split}_images"].copy()).unsqueeze(1)
        return ImageSet(images, torch.from_numpy(arrays[f"{split}_labels"].astype(np.int64)))

    return image_set("train"), image_set("test")


def _torchvision_fashion_mnist(root: Path) -> Path:
    import torchvision

    torchvision.datasets.FashionMNIST(str(root), train=True, download=True)
    torchvision.datasets.FashionMNIST(str(root), train=False, download=True)
    return root / "FashionMNIST" / "raw"


# --- CIFAR-10 --------------------------------------------------------------------------------

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR10_TEST = ["test_batch"]


def _read_cifar_batches(directory: Path, names: list[str]) -> ImageSet:
    images, labels = [], []
    for name in names:
        with open(directory / name, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        images.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.extend(entry["labels"] if "labels" in entry else entry["fine_labels"])
    return ImageSet(torch.from_numpy(np.concatenate(images)), torch.tensor(labels))


def load_cifar10(cfg: StoredDataConfig) -> tuple[ImageSet, ImageSet]:
    root = _given_root(cfg, f"{CIFAR10_FOLDER}/") or DEFAULT_DOWNLOAD_ROOT / "cifar10"
    directory = root / CIFAR10_FOLDER
    missing = [n for n in CIFAR10_TRAIN + CIFAR10_TEST if not (directory / n).is_file()]
    if missing and cfg.download:
        _download("CIFAR-10", lambda: _torchvision_cifar10(root))
        missing = [n for n in CIFAR10_TRAIN + CIFAR10_TEST if not (directory / n).is_file()]
    if missing:
        raise DatasetNotFoundError(
            f"CIFAR-10 was not found: {directory} lacks {', '.join(missing)}. Either put the "
            f"extracted python version of CIFAR-10 (cifar-10-python.tar.gz) under data.root="
            f"{root}, or allow data.download=true on a machine with internet access."
        )
    return _read_cifar_batches(directory, CIFAR10_TRAIN), _read_cifar_batches(
        directory, CIFAR10_TEST
    )


def _torchvision_cifar10(root: Path) -> Path:
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(
        CIFAR10.url, str(root), filename=CIFAR10.filename, md5=CIFAR10.tgz_md5
    )
    return root / CIFAR10_FOLDER


def _download(what: str, fetch) -> Path | None:
    """Run a torchvision download; a network failure means 'not available', not a crash."""
    try:
        return fetch()
    except (OSError, RuntimeError) as error:  # URLError is an OSError
        import logging

        logging.getLogger(__name__).warning("Downloading %s failed: %s", what, error)
        return None


# --- synthetic -------------------------------------------------------------------------------

SYNTHETIC_SEED = 1234


def make_synthetic(cfg: SyntheticDataConfig) -> tuple[ImageSet, ImageSet]:
    """A learnable image classification set: each class is a smooth pattern, samples add noise."""
    g = torch.Generator().manual_seed(SYNTHETIC_SEED)
    k, c, s = cfg.num_classes, cfg.channels, cfg.image_size
    coarse = torch.randn(k, c, max(2, s // 4), max(2, s // 4), generator=g)
    prototypes = F.interpolate(coarse, size=(s, s), mode="bilinear", align_corners=False)

    def draw(n: int) -> ImageSet:
        labels = torch.randint(0, k, (n,), generator=g)
        noise = torch.randn(n, c, s, s, generator=g)
        values = 0.15 * prototypes[labels] + noise
        images = ((values * 0.25 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return ImageSet(images, labels)

    return draw(cfg.num_train), draw(cfg.num_test)
