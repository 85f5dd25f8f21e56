"""Seeded, label-stratified splitting of a source into the aux, pool and test sets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedfm.data.dataset import DataSplits, ImageDataset
from fedfm.data.pixels import to_model_input
from fedfm.errors import DataError


@dataclass(frozen=True, eq=False)
class RawImages:
    """Images whose labels are known up front and whose pixels are decoded on demand.

    Decoding only the selected samples keeps ``max_samples`` cheap on large datasets.
    """

    labels: np.ndarray
    decode: Callable[[np.ndarray], torch.Tensor]
    groups: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class Source:
    """A dataset as read from disk or the hub, before splitting.

    ``test`` is None when the dataset has no separate test split; the test set is then carved
    out of ``train``.
    """

    name: str
    num_classes: int
    train: RawImages
    test: RawImages | None


def build_splits(
    source: Source,
    *,
    image_size: int,
    aux_fraction: float,
    test_fraction: float,
    seed: int,
    max_samples: int | None,
) -> DataSplits:
    """Split ``source`` into aux, pool and test and convert them to normalised tensors.

    Parameters
    ----------
    source
        The dataset to split.
    image_size
        Side length of the output images.
    aux_fraction, test_fraction
        Shares of the whole dataset (train and test together) for aux and test; the pool gets
        the rest. With a separate test split only ``aux_fraction / (1 - test_fraction)`` of the
        train split is used, so the test split is kept whole.
    seed
        Seed of the stratified splits and of the ``max_samples`` subsampling.
    max_samples
        If given, each of the three sets is randomly subsampled to at most this many samples.

    Returns
    -------
    DataSplits
        The three disjoint sets.
    """
    train_all = np.arange(len(source.train.labels))
    if source.test is None:
        test_raw = source.train
        test_idx, train_idx = _take_stratified(
            source.name, train_all, source.train.labels, test_fraction, seed
        )
    else:
        test_raw = source.test
        test_idx, train_idx = np.arange(len(source.test.labels)), train_all
    aux_idx, pool_idx = _take_stratified(
        source.name, train_idx, source.train.labels, aux_fraction / (1 - test_fraction), seed
    )

    def convert(raw: RawImages, indices: np.ndarray) -> ImageDataset:
        if max_samples is not None and len(indices) > max_samples:
            rng = np.random.default_rng(seed)
            indices = rng.choice(indices, size=max_samples, replace=False)
        return ImageDataset(
            name=source.name,
            images=to_model_input(raw.decode, indices, image_size=image_size),
            labels=torch.from_numpy(raw.labels[indices].astype(np.int64)),
            num_classes=source.num_classes,
            groups=None if raw.groups is None else raw.groups[indices],
        )

    return DataSplits(
        aux=convert(source.train, aux_idx),
        pool=convert(source.train, pool_idx),
        test=convert(test_raw, test_idx),
    )


def _take_stratified(
    name: str, indices: np.ndarray, labels: np.ndarray, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``indices`` into a ``fraction`` share and the rest, stratified by label."""
    count = round(fraction * len(indices))
    if not 0 < count < len(indices):
        raise DataError(
            f"{name}: cannot take {fraction:.0%} of {len(indices)} samples and leave both sides "
            "non-empty; the dataset is too small for these fractions"
        )
    from sklearn.model_selection import train_test_split  # when splitting, not at import

    try:
        taken, rest = train_test_split(
            indices, train_size=count, random_state=seed, stratify=labels[indices]
        )
    except ValueError:
        # sklearn cannot stratify when a class has a single sample or one side is smaller than
        # the number of classes; a plain shuffled split is the best that can be done then.
        taken, rest = train_test_split(indices, train_size=count, random_state=seed)
    return taken, rest
