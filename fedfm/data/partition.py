"""Partitioning of the client pool with flwr-datasets' partitioners."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from fedfm.data.dataset import ImageDataset
from fedfm.errors import ConfigError, DataError, InvariantError

SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "natural")


class LabelledSamples(Protocol):
    """What partitioning reads of a dataset (images, texts): labels, natural ids, a name."""

    @property
    def labels(self) -> torch.Tensor: ...

    @property
    def groups(self) -> np.ndarray | None: ...

    @property
    def name(self) -> str: ...

    def __len__(self) -> int: ...


def partition(
    dataset: LabelledSamples,
    *,
    num_partitions: int,
    scheme: str = "iid",
    alpha: float = 1.0,
    seed: int = 0,
    min_partition_size: int = 0,
) -> list[np.ndarray]:
    """Split ``dataset`` among clients with a flwr-datasets partitioner.

    Parameters
    ----------
    dataset
        The samples to distribute (usually ``DataSplits.pool``).
    num_partitions
        Number of partitions (clients), between 1 and ``len(dataset)``. For ``"natural"`` it
        must equal the number of distinct ``dataset.groups``.
    scheme
        ``"iid"`` (equal-size random shards, ``IidPartitioner``), ``"dirichlet"`` (label skew
        drawn from Dir(alpha) per class, ``DirichletPartitioner``) or ``"natural"`` (one
        partition per natural id in ``dataset.groups``, in sorted id order,
        ``NaturalIdPartitioner``).
    alpha
        Dirichlet concentration (> 0): small values give few classes per partition, large values
        close to iid. Used by ``"dirichlet"`` only.
    seed
        Seed of the sample order and of the Dirichlet draws.
    min_partition_size
        Smallest acceptable partition. ``"dirichlet"`` redraws up to 10 times to meet it; with
        the default 0, a small alpha may leave some partitions empty.

    Returns
    -------
    list of numpy.ndarray
        One sorted int64 index array into ``dataset`` per partition; disjoint, covering every
        sample.

    Raises
    ------
    ConfigError
        If an argument is out of range or the scheme unknown.
    DataError
        If ``"natural"`` is asked of a dataset without groups, or no partition meeting
        ``min_partition_size`` can be drawn.
    """
    _check_arguments(dataset, num_partitions, scheme, alpha, min_partition_size)
    # Imported here: flwr-datasets and datasets take seconds to import and only this needs them.
    from datasets import Dataset
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        NaturalIdPartitioner,
        Partitioner,
    )

    # IidPartitioner cuts contiguous shards and the others keep dataset order within a class,
    # so the rows are shuffled first (as FederatedDataset does by default).
    order = np.random.default_rng(seed).permutation(len(dataset))
    columns = {"label": dataset.labels.numpy()[order], "index": order}
    partitioner: Partitioner
    if scheme == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
    elif scheme == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=float(alpha),
            min_partition_size=min_partition_size,
            self_balancing=False,
            seed=seed,
        )
    else:
        if dataset.groups is None:
            raise InvariantError("natural partition without groups (checked by _check_arguments)")
        columns["group"] = dataset.groups[order]
        partitioner = NaturalIdPartitioner(partition_by="group")
    partitioner.dataset = Dataset.from_dict(columns)
    try:
        parts = [
            np.sort(np.asarray(partitioner.load_partition(i)["index"], dtype=np.int64))
            for i in range(num_partitions)
        ]
    except ValueError as exc:  # DirichletPartitioner gives up after 10 redraws
        raise DataError(
            f"cannot split {dataset.name} ({len(dataset)} samples) into {num_partitions} "
            f"{scheme} partitions of at least {min_partition_size} samples: {exc} "
            "Increase alpha or lower min_partition_size."
        ) from exc
    smallest = min(len(part) for part in parts)
    if smallest < min_partition_size:
        raise DataError(
            f"the smallest {scheme} partition of {dataset.name} has {smallest} samples, "
            f"below min_partition_size={min_partition_size}"
        )
    return parts


def describe_partitions(
    dataset: ImageDataset, parts: Sequence[np.ndarray]
) -> list[dict[str, int | list[int]]]:
    """Summarise partitions for progress output and reports.

    Parameters
    ----------
    dataset
        The partitioned dataset.
    parts
        Index arrays as returned by :func:`partition`.

    Returns
    -------
    list of dict
        Per partition: ``partition`` (its number), ``size`` and ``label_counts`` (samples per
        class, a list of length ``dataset.num_classes``).
    """
    labels = dataset.labels.numpy()
    return [
        {
            "partition": number,
            "size": len(part),
            "label_counts": np.bincount(labels[part], minlength=dataset.num_classes).tolist(),
        }
        for number, part in enumerate(parts)
    ]


def _check_arguments(
    dataset: LabelledSamples,
    num_partitions: int,
    scheme: str,
    alpha: float,
    min_partition_size: int,
) -> None:
    if scheme not in SCHEMES:
        raise ConfigError(
            f"unknown partition scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}"
        )
    if not 1 <= num_partitions <= len(dataset):
        raise ConfigError(
            f"num_partitions must be between 1 and the dataset size {len(dataset)}, "
            f"got {num_partitions}"
        )
    if not alpha > 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}")
    if not 0 <= min_partition_size <= len(dataset) // num_partitions:
        raise ConfigError(
            f"min_partition_size must be between 0 and {len(dataset) // num_partitions} "
            f"({len(dataset)} samples / {num_partitions} partitions), got {min_partition_size}"
        )
    if scheme == "natural":
        if dataset.groups is None:
            raise DataError(f"dataset {dataset.name} has no natural ids; use iid or dirichlet")
        num_groups = len(np.unique(dataset.groups))
        if num_partitions != num_groups:
            raise ConfigError(
                f"num_partitions must equal the number of natural ids of {dataset.name}, "
                f"which has {num_groups}; got {num_partitions}"
            )
