"""Datasets, the aux/pool/test split of the double-blind setting, and client partitioning."""

from fedfm.data.dataset import DataSplits, ImageDataset
from fedfm.data.loading import DATASETS, load_splits
from fedfm.data.partition import describe_partitions, partition
from fedfm.data.pixels import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "DATASETS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DataSplits",
    "ImageDataset",
    "describe_partitions",
    "load_splits",
    "partition",
]
