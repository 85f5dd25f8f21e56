"""``load_splits``: one entry point for every dataset fedfm can use."""

from __future__ import annotations

import os
from pathlib import Path

from fedfm.data.dataset import DataSplits
from fedfm.data.digits import digits_source
from fedfm.data.splitting import Source, build_splits
from fedfm.errors import ConfigError

DATASETS: tuple[str, ...] = ("digits", "cifar10", "cifar100", "svhn")
HF_PREFIX = "hf:"
DATA_DIR_ENV = "FEDFM_DATA_DIR"


def default_data_root() -> Path:
    """Return ``$FEDFM_DATA_DIR`` if set, else ``~/.cache/fedfm/data``."""
    configured = os.environ.get(DATA_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache/fedfm/data"


def load_splits(
    name: str = "digits",
    *,
    image_size: int = 32,
    root: str | Path | None = None,
    aux_fraction: float = 0.4,
    test_fraction: float = 0.2,
    seed: int = 0,
    max_samples: int | None = None,
) -> DataSplits:
    """Load a dataset and split it into the server's aux set, the clients' pool and a test set.

    Parameters
    ----------
    name
        ``"digits"`` (scikit-learn's 1,797 8x8 handwritten digits, bundled, needs nothing),
        ``"cifar10"``, ``"cifar100"``, ``"svhn"`` (read from ``root`` in torchvision's layout,
        never downloaded) or ``"hf:<name>[?option=value&...]"`` (Hugging Face, see
        :func:`fedfm.data.hub.hub_source`; ``partition_by=<column>`` fills ``groups``).
    image_size
        Side length of the square output images (bilinear resizing).
    root
        Folder of the torchvision datasets; defaults to ``$FEDFM_DATA_DIR`` or else
        ``~/.cache/fedfm/data``. Ignored by ``digits`` and ``hf:``.
    aux_fraction, test_fraction
        Shares of all samples for aux and test; the pool gets the rest. Datasets with their own
        test split keep it whole as the test set and give ``aux_fraction / (1 - test_fraction)``
        of the train split to aux. Splits are stratified by label.
    seed
        Same seed, same splits.
    max_samples
        If given, each of aux, pool and test is randomly subsampled to at most this many samples
        (after splitting, before decoding, so it also saves time and memory).

    Returns
    -------
    DataSplits
        Disjoint aux, pool and test sets of float32 ``(N, 3, image_size, image_size)`` images
        normalised with ImageNet's mean and std. Memory is ``12 * N * image_size**2`` bytes.

    Raises
    ------
    ConfigError
        If ``name`` is unknown or an argument is out of range.
    DataError
        If the dataset is missing, corrupt, unreachable or too small to split.
    """
    if not 0 < aux_fraction < 1:
        raise ConfigError(f"aux_fraction must be in (0, 1), got {aux_fraction}")
    if not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if aux_fraction + test_fraction >= 1:
        raise ConfigError(
            f"aux_fraction + test_fraction must be below 1 to leave a client pool, "
            f"got {aux_fraction} + {test_fraction}"
        )
    if image_size < 1:
        raise ConfigError(f"image_size must be at least 1, got {image_size}")
    if max_samples is not None and max_samples < 1:
        raise ConfigError(f"max_samples must be at least 1 or None, got {max_samples}")
    return build_splits(
        _source(name, image_size=image_size, root=root),
        image_size=image_size,
        aux_fraction=aux_fraction,
        test_fraction=test_fraction,
        seed=seed,
        max_samples=max_samples,
    )


def _source(name: str, *, image_size: int, root: str | Path | None) -> Source:
    # torchvision and datasets are imported only when needed: together they take seconds.
    if name == "digits":
        return digits_source()
    if name in DATASETS:
        from fedfm.data.torchvision_sets import torchvision_source

        return torchvision_source(name, Path(root).expanduser() if root else default_data_root())
    if name.startswith(HF_PREFIX):
        from fedfm.data.hub import hub_source

        return hub_source(name.removeprefix(HF_PREFIX), image_size=image_size)
    raise ConfigError(
        f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}, {HF_PREFIX}<hub name>"
    )
