"""Tests of fedfm.data: loading, splitting and partitioning (all offline)."""

from __future__ import annotations

import pickle
import re
import socket
import time
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from fedfm.data import (
    DATASETS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    DataSplits,
    ImageDataset,
    describe_partitions,
    load_splits,
    partition,
)
from fedfm.errors import ConfigError, DataError

NUM_DIGITS = 1797


def unnormalise(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return images * std + mean


def all_splits(splits: DataSplits) -> list[ImageDataset]:
    return [splits.aux, splits.pool, splits.test]


@pytest.fixture(scope="module")
def digits() -> DataSplits:
    return load_splits("digits")


@pytest.fixture(scope="module")
def pool(digits: DataSplits) -> ImageDataset:
    return digits.pool


# --- digits ---------------------------------------------------------------------------------


def test_dataset_names() -> None:
    assert DATASETS == ("digits", "cifar10", "cifar100", "svhn")


def test_digits_shapes_dtypes_and_sizes(digits: DataSplits) -> None:
    assert (len(digits.aux), len(digits.pool), len(digits.test)) == (719, 719, 359)
    for split in all_splits(digits):
        assert split.name == "digits"
        assert split.num_classes == 10
        assert split.images.dtype == torch.float32
        assert split.images.shape == (len(split), 3, 32, 32)
        assert split.labels.dtype == torch.int64
        assert split.groups is None
        assert int(split.labels.min()) >= 0 and int(split.labels.max()) <= 9


def test_digits_are_normalised_grey_images_in_unit_range(digits: DataSplits) -> None:
    pixels = unnormalise(digits.pool.images)
    assert float(pixels.min()) >= -1e-5
    assert float(pixels.max()) <= 1 + 1e-5
    # Grey images replicated to RGB: the channels agree once the normalisation is undone.
    torch.testing.assert_close(pixels[:, 0], pixels[:, 1])
    torch.testing.assert_close(pixels[:, 0], pixels[:, 2])
    # Normalised per channel: the black background (0) maps to -mean / std of each channel.
    background = -torch.tensor(IMAGENET_MEAN) / torch.tensor(IMAGENET_STD)
    torch.testing.assert_close(digits.pool.images.amin(dim=(0, 2, 3)), background)


def test_digits_splits_are_a_disjoint_cover_of_the_real_dataset() -> None:
    # At the native 8x8 size nothing is interpolated, so every (image, label) must reappear
    # exactly once across the three splits.
    splits = load_splits("digits", image_size=8)
    images = torch.cat([unnormalise(split.images)[:, 0] for split in all_splits(splits)])
    labels = torch.cat([split.labels for split in all_splits(splits)])
    rows = np.hstack([np.rint(images.numpy() * 16).reshape(len(images), -1), labels[:, None]])
    reference = load_digits()
    expected = np.hstack([reference.data, reference.target[:, None]])
    assert len(rows) == NUM_DIGITS
    np.testing.assert_array_equal(np.unique(rows, axis=0), np.unique(expected, axis=0))
    _, counts = np.unique(rows, axis=0, return_counts=True)
    _, expected_counts = np.unique(expected, axis=0, return_counts=True)
    np.testing.assert_array_equal(counts, expected_counts)


def test_digits_splits_are_stratified(digits: DataSplits) -> None:
    overall = np.bincount(load_digits().target, minlength=10) / NUM_DIGITS
    for split in all_splits(digits):
        share = np.bincount(split.labels.numpy(), minlength=10) / len(split)
        assert np.abs(share - overall).max() < 0.01


def test_same_seed_same_splits_other_seed_other_splits(digits: DataSplits) -> None:
    again = load_splits("digits", seed=0)
    other = load_splits("digits", seed=1)
    for first, second in zip(all_splits(digits), all_splits(again), strict=True):
        assert torch.equal(first.images, second.images)
        assert torch.equal(first.labels, second.labels)
    assert not torch.equal(digits.aux.labels, other.aux.labels)
    assert not torch.equal(digits.test.images, other.test.images)


@pytest.mark.parametrize("size", [16, 48])
def test_other_image_sizes(size: int) -> None:
    splits = load_splits("digits", image_size=size)
    for split in all_splits(splits):
        assert split.images.shape[1:] == (3, size, size)
        pixels = unnormalise(split.images)
        assert float(pixels.min()) >= -1e-5 and float(pixels.max()) <= 1 + 1e-5


def test_fractions_set_the_split_sizes() -> None:
    splits = load_splits("digits", aux_fraction=0.1, test_fraction=0.3)
    assert len(splits.test) == round(0.3 * NUM_DIGITS)
    assert len(splits.aux) == round(0.1 * NUM_DIGITS)
    assert len(splits.aux) + len(splits.pool) + len(splits.test) == NUM_DIGITS


def test_max_samples_caps_each_split_deterministically() -> None:
    capped = load_splits("digits", max_samples=100)
    assert [len(split) for split in all_splits(capped)] == [100, 100, 100]
    again = load_splits("digits", max_samples=100)
    assert torch.equal(capped.pool.images, again.pool.images)
    assert len(load_splits("digits", max_samples=500).test) == 359


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"aux_fraction": 0.0}, "aux_fraction"),
        ({"aux_fraction": 1.5}, "aux_fraction"),
        ({"test_fraction": 0.0}, "test_fraction"),
        ({"test_fraction": 1.0}, "test_fraction"),
        ({"aux_fraction": 0.6, "test_fraction": 0.4}, "aux_fraction + test_fraction"),
        ({"image_size": 0}, "image_size"),
        ({"max_samples": 0}, "max_samples"),
    ],
)
def test_bad_load_arguments_raise_config_error(kwargs: dict, parameter: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(parameter)):
        load_splits("digits", **kwargs)


def test_unknown_dataset_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match="unknown dataset 'mnist'") as error:
        load_splits("mnist")
    for name in (*DATASETS, "hf:"):
        assert name in str(error.value)


# --- torchvision datasets (local folders only) -----------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cifar10", "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}"),
        ("cifar100", "cifar-100-python/{train,test,meta}"),
        ("svhn", "{train_32x32.mat,test_32x32.mat}"),
    ],
)
def test_missing_torchvision_dataset_names_expected_path(
    tmp_path: Path, name: str, expected: str
) -> None:
    with pytest.raises(DataError, match="not found") as error:
        load_splits(name, root=tmp_path)
    assert f"{tmp_path}/{expected}" in str(error.value)
    assert "never downloads" in str(error.value)


def test_data_root_defaults_to_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDFM_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match=re.escape(f"not found under {tmp_path}")):
        load_splits("cifar10")


def write_fake_cifar10(root: Path, per_batch: int = 20) -> None:
    """Write a tiny CIFAR-10 in torchvision's layout: image i has R=i, G=3i mod 256, B=255-i.

    The real files are Python 2 pickles whose str keys unpickle (encoding="latin1") as str, so
    the fakes use str keys too; bytes keys such as b"data" would not be found by torchvision.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)

    def dump(file: str, first: int) -> None:
        ids = np.arange(first, first + per_batch)
        channels = np.stack([ids, (3 * ids) % 256, 255 - ids], axis=1).astype(np.uint8)
        data = np.repeat(channels, 32 * 32, axis=1)  # rows: 1024 R, 1024 G, 1024 B values
        entry = {"data": data, "labels": (ids % 10).tolist()}
        (folder / file).write_bytes(pickle.dumps(entry))

    for batch in range(5):
        dump(f"data_batch_{batch + 1}", batch * per_batch)
    dump("test_batch", 5 * per_batch)
    meta = {"label_names": [f"class{i}" for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))


def test_fake_cifar10_fails_torchvisions_md5_check(tmp_path: Path) -> None:
    # torchvision checks the md5 of every file even with download=False, so a hand-made folder
    # is reported as corrupt; the success path is tested below with the check patched out.
    write_fake_cifar10(tmp_path)
    with pytest.raises(DataError, match="corrupt") as error:
        load_splits("cifar10", root=tmp_path)
    assert str(tmp_path / "cifar-10-batches-py") in str(error.value)


def test_incomplete_cifar10_names_missing_file(tmp_path: Path) -> None:
    write_fake_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(DataError, match=r"incomplete .*missing cifar-10-batches-py/test_batch"):
        load_splits("cifar10", root=tmp_path)


def test_fake_cifar10_loads_when_integrity_check_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchvision.datasets.cifar

    write_fake_cifar10(tmp_path)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *_: True)
    splits = load_splits("cifar10", root=tmp_path)
    # Train (100) is split half/half into aux and pool; the test batch (20) is kept whole.
    assert (len(splits.aux), len(splits.pool), len(splits.test)) == (50, 50, 20)
    assert splits.test.num_classes == 10
    assert splits.aux.images.shape == (50, 3, 32, 32)
    test_pixels = np.rint(unnormalise(splits.test.images).numpy() * 255)
    ids = np.arange(100, 120)
    np.testing.assert_array_equal(test_pixels[:, 0, 5, 7], ids)  # R channel stays channel 0
    np.testing.assert_array_equal(test_pixels[:, 1, 5, 7], (3 * ids) % 256)
    np.testing.assert_array_equal(test_pixels[:, 2, 5, 7], 255 - ids)
    np.testing.assert_array_equal(splits.test.labels.numpy(), ids % 10)
    train_images = unnormalise(torch.cat([splits.aux.images, splits.pool.images])).numpy()
    np.testing.assert_array_equal(np.sort(np.rint(train_images[:, 0, 0, 0] * 255)), np.arange(100))

    small = load_splits("cifar10", root=tmp_path, image_size=16, max_samples=8)
    assert [len(split) for split in all_splits(small)] == [8, 8, 8]
    assert small.pool.images.shape[1:] == (3, 16, 16)


# --- Hugging Face ----------------------------------------------------------------------------


def test_hub_offline_fails_fast_with_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The variables are read at import time, so the parsed values are patched.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(DataError, match="fedfm-tests/no-such-dataset"):
        load_splits("hf:fedfm-tests/no-such-dataset")
    assert time.monotonic() - start < 10


def test_unreachable_hub_fails_fast_with_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:  # a local port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(DataError, match="unreachable"):
        load_splits("hf:fedfm-tests/no-such-dataset")
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    ("name", "message"),
    [("hf:some/dataset?group=writer", "partition_by=<column>"), ("hf:", "needs a dataset name")],
)
def test_bad_hub_spec_raises_config_error(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_splits(name)


@pytest.fixture
def local_hub_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local folder ``datasets.load_dataset`` reads like a Hub dataset.

    train.parquet and test.parquet hold one-colour images of varying sizes, sample i coloured
    (i, 2i, 255 - i); string labels cat/dog/emu, where the train split has a single emu; and
    4 writers.
    """
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "hub-like"
    folder.mkdir()
    animals = {
        "train": ["emu"] + [("cat", "dog")[i % 2] for i in range(1, 60)],
        "test": [("cat", "dog", "emu")[i % 3] for i in range(12)],
    }
    for split, labels in animals.items():
        images = [
            Image.new("RGB", (12, 10 + i % 3), (i, 2 * i, 255 - i)) for i in range(len(labels))
        ]
        table = datasets.Dataset.from_dict(
            {
                "image": images,
                "animal": labels,
                "writer": [f"w{i % 4}" for i in range(len(labels))],
            },
            features=datasets.Features(
                {
                    "image": datasets.Image(),
                    "animal": datasets.Value("string"),
                    "writer": datasets.Value("string"),
                }
            ),
        )
        table.to_parquet(str(folder / f"{split}.parquet"))
    return folder


def test_local_hub_folder_loads_with_groups(local_hub_folder: Path) -> None:
    splits = load_splits(f"hf:{local_hub_folder}?label=animal&partition_by=writer", image_size=8)
    assert (len(splits.aux), len(splits.pool), len(splits.test)) == (30, 30, 12)
    assert splits.pool.name == f"hf:{local_hub_folder}"
    assert splits.pool.num_classes == 3
    assert splits.pool.images.shape == (30, 3, 8, 8)
    np.testing.assert_array_equal(splits.test.labels.numpy(), np.arange(12) % 3)
    colours = np.rint(unnormalise(splits.test.images).numpy()[:, :, 4, 4] * 255)
    ids = np.arange(12)
    np.testing.assert_array_equal(colours, np.stack([ids, 2 * ids, 255 - ids], axis=1))
    # The lone emu makes stratification impossible; the split falls back to a plain shuffle.
    train_labels = torch.cat([splits.aux.labels, splits.pool.labels]).numpy()
    np.testing.assert_array_equal(np.bincount(train_labels), [29, 30, 1])
    assert splits.test.groups is not None
    np.testing.assert_array_equal(splits.test.groups, [f"w{i % 4}" for i in range(12)])
    parts = partition(splits.pool, num_partitions=4, scheme="natural")
    assert sorted(len(set(splits.pool.groups[part])) for part in parts) == [1, 1, 1, 1]


def test_local_hub_folder_without_label_column_names_the_option(local_hub_folder: Path) -> None:
    with pytest.raises(DataError, match=r"label column .*\?label=<column>"):
        load_splits(f"hf:{local_hub_folder}")


# --- partitioning ----------------------------------------------------------------------------


def assert_disjoint_cover(parts: list[np.ndarray], size: int) -> None:
    joined = np.concatenate(parts)
    assert joined.dtype == np.int64
    np.testing.assert_array_equal(np.sort(joined), np.arange(size))


def test_iid_partition_is_a_balanced_disjoint_cover(pool: ImageDataset) -> None:
    parts = partition(pool, num_partitions=5, scheme="iid", seed=3)
    assert len(parts) == 5
    assert_disjoint_cover(parts, len(pool))
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    # Shuffled before sharding: a contiguous shard would be the indices 0..143.
    assert not np.array_equal(parts[0], np.arange(len(parts[0])))
    again = partition(pool, num_partitions=5, scheme="iid", seed=3)
    other = partition(pool, num_partitions=5, scheme="iid", seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def mean_max_class_share(dataset: ImageDataset, parts: list[np.ndarray]) -> float:
    shares = [
        np.bincount(dataset.labels.numpy()[part]).max() / len(part) for part in parts if len(part)
    ]
    return float(np.mean(shares))


def test_dirichlet_alpha_controls_label_skew(pool: ImageDataset) -> None:
    start = time.monotonic()
    balanced = partition(pool, num_partitions=5, scheme="dirichlet", alpha=100.0)
    skewed = partition(pool, num_partitions=5, scheme="dirichlet", alpha=0.01)
    assert time.monotonic() - start < 10
    assert_disjoint_cover(balanced, len(pool))
    assert_disjoint_cover(skewed, len(pool))
    assert mean_max_class_share(pool, balanced) < 0.2  # iid would be about 0.1
    assert mean_max_class_share(pool, skewed) > 0.6  # nearly one class per partition
    sizes = [len(part) for part in balanced]
    assert min(sizes) > 0.7 * len(pool) / 5


def test_dirichlet_honours_min_partition_size(pool: ImageDataset) -> None:
    parts = partition(pool, num_partitions=5, scheme="dirichlet", alpha=1.0, min_partition_size=50)
    assert min(len(part) for part in parts) >= 50
    assert_disjoint_cover(parts, len(pool))


@pytest.mark.filterwarnings("ignore:The specified min_partition_size")
def test_unsatisfiable_dirichlet_raises_data_error(pool: ImageDataset) -> None:
    # With alpha=0.01 each class goes to about one of 20 partitions, so at least ten stay
    # empty; flwr-datasets redraws 10 times and gives up.
    with pytest.raises(DataError, match="min_partition_size"):
        partition(pool, num_partitions=20, scheme="dirichlet", alpha=0.01, min_partition_size=5)


def grouped(pool: ImageDataset, num_groups: int) -> ImageDataset:
    groups = np.array([f"writer{i % num_groups}" for i in range(len(pool))])
    return ImageDataset(pool.name, pool.images, pool.labels, pool.num_classes, groups)


def test_natural_partition_follows_groups(pool: ImageDataset) -> None:
    dataset = grouped(pool, 3)
    parts = partition(dataset, num_partitions=3, scheme="natural")
    assert_disjoint_cover(parts, len(dataset))
    assert [set(dataset.groups[part]) for part in parts] == [
        {"writer0"},
        {"writer1"},
        {"writer2"},
    ]


def test_natural_partition_needs_groups(pool: ImageDataset) -> None:
    with pytest.raises(DataError, match="no natural ids; use iid or dirichlet"):
        partition(pool, num_partitions=3, scheme="natural")


def test_natural_partition_needs_one_partition_per_group(pool: ImageDataset) -> None:
    with pytest.raises(ConfigError, match=r"num_partitions .* which has 3"):
        partition(grouped(pool, 3), num_partitions=4, scheme="natural")


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"num_partitions": 0}, "num_partitions"),
        ({"num_partitions": 10_000}, "num_partitions"),
        ({"num_partitions": 5, "scheme": "dirichlet", "alpha": 0.0}, "alpha"),
        ({"num_partitions": 5, "alpha": -1.0}, "alpha"),
        ({"num_partitions": 5, "scheme": "shards"}, "scheme"),
        ({"num_partitions": 5, "min_partition_size": 200}, "min_partition_size"),
        ({"num_partitions": 5, "min_partition_size": -1}, "min_partition_size"),
    ],
)
def test_bad_partition_arguments_raise_config_error(
    pool: ImageDataset, kwargs: dict, parameter: str
) -> None:
    with pytest.raises(ConfigError, match=parameter):
        partition(pool, **kwargs)


def test_describe_partitions_counts_labels(pool: ImageDataset) -> None:
    parts = partition(pool, num_partitions=4, scheme="dirichlet", alpha=0.5)
    summary = describe_partitions(pool, parts)
    assert [row["partition"] for row in summary] == [0, 1, 2, 3]
    for row, part in zip(summary, parts, strict=True):
        assert row["size"] == len(part)
        assert len(row["label_counts"]) == 10
        assert sum(row["label_counts"]) == len(part)
        assert row["label_counts"][int(pool.labels[part[0]])] > 0
    totals = np.sum([row["label_counts"] for row in summary], axis=0)
    np.testing.assert_array_equal(totals, np.bincount(pool.labels.numpy(), minlength=10))


# --- ImageDataset ----------------------------------------------------------------------------


def test_subset_slices_images_labels_and_groups(pool: ImageDataset) -> None:
    dataset = grouped(pool, 4)
    subset = dataset.subset([5, 2, 9])
    assert len(subset) == 3
    assert (subset.name, subset.num_classes) == (dataset.name, dataset.num_classes)
    assert torch.equal(subset.images, dataset.images[[5, 2, 9]])
    assert torch.equal(subset.labels, dataset.labels[[5, 2, 9]])
    assert list(subset.groups) == ["writer1", "writer2", "writer1"]
    assert len(dataset.subset(np.array([], dtype=np.int64))) == 0


def test_inconsistent_dataset_is_rejected(pool: ImageDataset) -> None:
    with pytest.raises(DataError, match="labels"):
        ImageDataset("bad", pool.images, pool.labels[:-1], 10)
    with pytest.raises(DataError, match="images"):
        ImageDataset("bad", pool.images[:, :1], pool.labels, 10)
    with pytest.raises(DataError, match="groups"):
        ImageDataset("bad", pool.images, pool.labels, 10, np.zeros(3))
