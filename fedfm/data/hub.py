"""Image datasets from the Hugging Face Hub, or from a local folder ``datasets`` can read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import torch
from PIL import Image

from fedfm.data.splitting import RawImages, Source
from fedfm.errors import ConfigError, DataError
from fedfm.hub import hub_unreachable_reason

_OPTIONS = ("partition_by", "image", "label")
_IMAGE_COLUMNS = ("img", "image")
_LABEL_COLUMNS = ("label", "labels", "fine_label")


def hub_source(spec: str, *, image_size: int) -> Source:
    """Load an image classification dataset with ``datasets.load_dataset``.

    Parameters
    ----------
    spec
        ``<name>[?option=value&...]`` where ``<name>`` is a Hub id (``uoft-cs/cifar10``) or a
        local folder ``datasets.load_dataset`` accepts (e.g. with ``train.parquet`` and
        ``test.parquet``). Options: ``partition_by=<column>`` stores that column as the natural
        ids (``groups``) for natural partitioning; ``image=<column>`` and ``label=<column>``
        override the detected image and label columns.
    image_size
        Side length the images are resized to (bilinearly) while decoding.

    Returns
    -------
    Source
        The ``train`` split, and the ``test`` split if the dataset has one. The image column
        defaults to ``img``/``image`` or else the first image feature; the label column to
        ``label``/``labels``/``fine_label`` or else the first class-label feature. Labels that
        are not class labels are mapped to ``0..K-1`` in sorted order.

    Raises
    ------
    ConfigError
        If ``spec`` has no name or an unknown option.
    DataError
        If the Hub is unreachable, the dataset cannot be loaded or lacks the needed columns.
    """
    name, options = _parse_spec(spec)
    if not datasets.config.HF_HUB_OFFLINE and not Path(name).exists():
        _check_hub_reachable(name)
    try:
        loaded = datasets.load_dataset(name)
    # load_dataset raises many unrelated types (ConnectionError, FileNotFoundError,
    # DatasetNotFoundError, ValueError, ...); all of them mean the dataset is unavailable.
    except Exception as exc:
        raise DataError(f"cannot load Hugging Face dataset {name!r}: {exc}") from exc
    if "train" not in loaded:
        raise DataError(f"Hugging Face dataset {name!r} has no 'train' split: {list(loaded)}")
    splits = [loaded["train"]] if "test" not in loaded else [loaded["train"], loaded["test"]]
    features = splits[0].features
    image_column = _find_column(
        name, features, options.get("image"), _IMAGE_COLUMNS, datasets.Image, "image"
    )
    if not isinstance(features[image_column], datasets.Image):
        raise DataError(
            f"column {image_column!r} of {name!r} holds {features[image_column]}, not images"
        )
    label_column = _find_column(
        name, features, options.get("label"), _LABEL_COLUMNS, datasets.ClassLabel, "label"
    )
    group_column = options.get("partition_by")
    if group_column is not None and group_column not in features:
        raise DataError(f"{name!r} has no column {group_column!r}; columns: {list(features)}")

    values = [np.asarray(split[label_column]) for split in splits]
    label_feature = features[label_column]
    if isinstance(label_feature, datasets.ClassLabel):
        num_classes = label_feature.num_classes
        labels = [value.astype(np.int64) for value in values]
    else:
        classes = np.unique(np.concatenate(values))
        num_classes = len(classes)
        labels = [np.searchsorted(classes, value).astype(np.int64) for value in values]
    raws = [
        RawImages(
            labels=split_labels,
            decode=_decoder(split, image_column, image_size),
            groups=None if group_column is None else np.asarray(split[group_column]),
        )
        for split, split_labels in zip(splits, labels, strict=True)
    ]
    return Source(
        name=f"hf:{name}",
        num_classes=num_classes,
        train=raws[0],
        test=raws[1] if len(raws) == 2 else None,
    )


def _parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    name, _, query = spec.partition("?")
    if not name:
        raise ConfigError("hf: needs a dataset name, e.g. hf:uoft-cs/cifar10")
    options: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key not in _OPTIONS or not value:
            raise ConfigError(
                f"invalid option {item!r} in hf:{spec}; "
                f"valid options: {', '.join(f'{option}=<column>' for option in _OPTIONS)}"
            )
        options[key] = value
    return name, options


def _check_hub_reachable(name: str) -> None:
    reason = hub_unreachable_reason()
    if reason is not None:
        raise DataError(
            f"cannot load Hugging Face dataset {name!r}: {reason}. Without network only "
            "datasets already in the local cache work, and only with HF_HUB_OFFLINE=1 set."
        )


def _find_column(
    name: str,
    features: datasets.Features,
    requested: str | None,
    preferred: tuple[str, ...],
    feature_type: type,
    role: str,
) -> str:
    if requested is not None:
        if requested not in features:
            raise DataError(f"{name!r} has no column {requested!r}; columns: {list(features)}")
        return requested
    by_type = [key for key, feature in features.items() if isinstance(feature, feature_type)]
    found = [key for key in preferred if key in features] + by_type
    if not found:
        raise DataError(
            f"cannot find the {role} column of {name!r} among {list(features)}; "
            f"name it with hf:{name}?{role}=<column>"
        )
    return found[0]


def _decoder(
    split: datasets.Dataset, column: str, image_size: int
) -> Callable[[np.ndarray], torch.Tensor]:
    def decode(indices: np.ndarray) -> torch.Tensor:
        # Resized one by one because Hub images may differ in size.
        pixels = np.stack(
            [
                np.asarray(
                    image.convert("RGB").resize((image_size, image_size), Image.Resampling.BILINEAR)
                )
                for image in split.select(indices)[column]
            ]
        )
        return torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255.0

    return decode
