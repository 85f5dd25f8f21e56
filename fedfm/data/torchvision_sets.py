"""CIFAR-10, CIFAR-100 and SVHN from local folders in torchvision's layout (never downloaded)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision import datasets

from fedfm.data.splitting import RawImages, Source
from fedfm.errors import DataError

_CIFAR_ORIGIN = "the python version from https://www.cs.toronto.edu/~kriz/cifar.html"


@dataclass(frozen=True)
class _Layout:
    title: str
    files: tuple[str, ...]  # relative to the data root, as torchvision expects them
    summary: str  # the same files in brace notation, for error messages
    origin: str
    num_classes: int


LAYOUTS: dict[str, _Layout] = {
    "cifar10": _Layout(
        title="CIFAR-10",
        files=tuple(
            f"cifar-10-batches-py/{name}"
            for name in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
        ),
        summary="cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}",
        origin=_CIFAR_ORIGIN,
        num_classes=10,
    ),
    "cifar100": _Layout(
        title="CIFAR-100",
        files=("cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"),
        summary="cifar-100-python/{train,test,meta}",
        origin=_CIFAR_ORIGIN,
        num_classes=100,
    ),
    "svhn": _Layout(
        title="SVHN",
        files=("train_32x32.mat", "test_32x32.mat"),
        summary="{train_32x32.mat,test_32x32.mat}",
        origin="the cropped digits, format 2, from http://ufldl.stanford.edu/housenumbers/",
        num_classes=10,
    ),
}


def torchvision_source(name: str, root: Path) -> Source:
    """Read a torchvision dataset from ``root`` without downloading anything.

    Parameters
    ----------
    name
        One of the keys of :data:`LAYOUTS`: ``"cifar10"``, ``"cifar100"`` or ``"svhn"``.
    root
        Folder holding the files listed in the layout.

    Returns
    -------
    Source
        The train and test splits with uint8 pixels decoded to [0, 1] on demand.

    Raises
    ------
    DataError
        If files are missing or fail torchvision's md5 check; the message names the expected
        path and format.
    """
    return Source(
        name=name,
        num_classes=LAYOUTS[name].num_classes,
        train=_read(name, root, train=True),
        test=_read(name, root, train=False),
    )


def _read(name: str, root: Path, *, train: bool) -> RawImages:
    layout = LAYOUTS[name]
    try:
        if name == "svhn":
            svhn = datasets.SVHN(str(root), split="train" if train else "test", download=False)
            pixels, labels = svhn.data, np.asarray(svhn.labels)  # data is (N, 3, 32, 32)
        else:
            cifar_class = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
            cifar = cifar_class(str(root), train=train, download=False)
            pixels, labels = cifar.data.transpose(0, 3, 1, 2), np.asarray(cifar.targets)
    except RuntimeError as exc:  # torchvision's "Dataset not found or corrupted"
        raise DataError(_describe_problem(layout, root)) from exc
    return RawImages(
        labels=labels.astype(np.int64),
        decode=lambda indices: torch.from_numpy(pixels[indices]).float() / 255.0,
    )


def _describe_problem(layout: _Layout, root: Path) -> str:
    expected = (
        f"expected the torchvision layout {root}/{layout.summary} ({layout.origin}); "
        "fedfm never downloads data. Set --data-root or FEDFM_DATA_DIR."
    )
    missing = [file for file in layout.files if not (root / file).is_file()]
    if len(missing) == len(layout.files):
        return f"{layout.title} not found under {root}: {expected}"
    if missing:
        missing_list = ", ".join(missing)
        return f"{layout.title} under {root} is incomplete (missing {missing_list}): {expected}"
    # torchvision verifies the md5 of every file even with download=False.
    return f"{layout.title} under {root} is corrupt (md5 check failed): {expected}"
