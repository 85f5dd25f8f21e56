"""Out-of-distribution distillation data: crops of scikit-learn's sample photographs."""

from __future__ import annotations

import pytest
import torch

from fedfm.data import IMAGENET_MEAN, IMAGENET_STD, load_splits
from fedfm.data.photos import sample_photo_crops
from fedfm.distillation.pipeline import DistillRun, distillation_data
from fedfm.errors import ConfigError
from fedfm.models.foundation import ModelSpec


def test_photo_crops_are_normalised_seeded_and_varied() -> None:
    crops = sample_photo_crops(12, image_size=16, seed=3)
    assert crops.shape == (12, 3, 16, 16) and crops.dtype == torch.float32
    assert torch.equal(crops, sample_photo_crops(12, image_size=16, seed=3))
    assert not torch.equal(crops, sample_photo_crops(12, image_size=16, seed=4))
    # pixels in [0, 1] before ImageNet normalisation
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    pixels = crops * std + mean
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    assert len({round(float(c.mean()), 4) for c in crops}) == 12  # twelve different crops
    with pytest.raises(ConfigError, match="must be >= 1"):
        sample_photo_crops(0, image_size=16, seed=0)


def test_distillation_data_is_aux_or_photos_labelled_by_the_teacher() -> None:
    splits = load_splits("digits", image_size=16, max_samples=60, seed=0)
    torch.manual_seed(0)
    teacher = ModelSpec("vit_fedfm_micro", 10, 16).build().eval()
    images, labels = distillation_data(DistillRun(), splits, teacher, 16)
    assert images is splits.aux.images and labels is splits.aux.labels

    run = DistillRun(distill_data="sample-photos")
    images, labels = distillation_data(run, splits, teacher, 16)
    assert images.shape == splits.aux.images.shape
    assert torch.equal(images, sample_photo_crops(len(splits.aux), image_size=16, seed=0))
    with torch.no_grad():
        assert torch.equal(labels, teacher(images).argmax(1))
    with pytest.raises(ConfigError, match="unknown distillation data 'imagenet'"):
        distillation_data(DistillRun(distill_data="imagenet"), splits, teacher, 16)
