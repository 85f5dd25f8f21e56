"""Containers for image datasets and the three splits of the double-blind setting."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from fedfm.errors import DataError


# eq=False: a generated __eq__ would compare tensors element-wise and fail on their truth value.
@dataclass(frozen=True, eq=False)
class ImageDataset:
    """Images as a float32 tensor (N, 3, H, W), normalised, plus int64 labels (N,).

    Attributes
    ----------
    name : str
        Dataset name, e.g. ``"digits"`` or ``"hf:uoft-cs/cifar10"``.
    images : torch.Tensor
        float32 ``(N, 3, H, W)``, normalised with ImageNet's per-channel mean and std.
    labels : torch.Tensor
        int64 ``(N,)`` class indices in ``[0, num_classes)``.
    num_classes : int
        Number of classes of the whole dataset (a subset may miss some).
    groups : numpy.ndarray or None
        Optional natural id per sample (e.g. writer or user), shape ``(N,)``, used by
        ``partition(..., scheme="natural")``.
    """

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    groups: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.shape[1] != 3:
            raise DataError(
                f"{self.name}: images must have shape (N, 3, H, W), got {tuple(self.images.shape)}"
            )
        if self.labels.shape != (len(self.images),):
            raise DataError(
                f"{self.name}: labels must have shape ({len(self.images)},), "
                f"got {tuple(self.labels.shape)}"
            )
        if self.groups is not None and self.groups.shape != (len(self.images),):
            raise DataError(
                f"{self.name}: groups must have shape ({len(self.images)},), "
                f"got {self.groups.shape}"
            )

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: Sequence[int] | np.ndarray) -> ImageDataset:
        """Return the samples at ``indices`` (in that order) as a new dataset.

        Parameters
        ----------
        indices
            Integer indices into this dataset.

        Returns
        -------
        ImageDataset
            Same ``name`` and ``num_classes``; images, labels and groups sliced.
        """
        index = np.asarray(indices, dtype=np.int64)
        selector = torch.from_numpy(index)
        return replace(
            self,
            images=self.images[selector],
            labels=self.labels[selector],
            groups=None if self.groups is None else self.groups[index],
        )


@dataclass(frozen=True)
class DataSplits:
    """The three disjoint sets of the double-blind setting.

    Attributes
    ----------
    aux : ImageDataset
        The server's auxiliary set D_aux (teacher pretraining and distillation).
    pool : ImageDataset
        The clients' private pool, to be partitioned among clients.
    test : ImageDataset
        Held-out test set.
    """

    aux: ImageDataset
    pool: ImageDataset
    test: ImageDataset
