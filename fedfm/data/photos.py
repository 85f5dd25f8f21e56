"""Out-of-distribution auxiliary images: crops of scikit-learn's bundled sample photographs.

scikit-learn ships two real colour photographs (``china.jpg``, a temple, and ``flower.jpg``;
427 x 640 each) with :func:`sklearn.datasets.load_sample_images`, so they need no download. A
server whose auxiliary data shares nothing with the clients' task (the paper's Table 1 uses
Tiny-ImageNet against Fed-ISIC2019) can distill on random crops of them: natural-image texture,
no digits, no labels.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_sample_images

from fedfm.data.pixels import to_model_input
from fedfm.errors import ConfigError

MIN_CROP, MAX_CROP = 24, 160  # crop sides in pixels, drawn uniformly (several scales of texture)


def sample_photo_crops(count: int, *, image_size: int, seed: int) -> torch.Tensor:
    """``count`` random square crops of the two sample photographs, resized and normalised like
    every fedfm dataset: float32 ``(count, 3, image_size, image_size)``; the same for the same
    seed."""
    if count < 1:
        raise ConfigError(f"the number of photo crops must be >= 1, got {count}")
    photos = [np.asarray(photo) for photo in load_sample_images().images]
    rng = np.random.default_rng(seed)
    crops = []
    for _ in range(count):
        photo = photos[rng.integers(len(photos))]
        side = int(rng.integers(MIN_CROP, MAX_CROP + 1))
        top = int(rng.integers(photo.shape[0] - side + 1))
        left = int(rng.integers(photo.shape[1] - side + 1))
        crop = torch.from_numpy(photo[top : top + side, left : left + side].copy())
        crops.append(crop.permute(2, 0, 1).float().div(255.0))

    def decode(indices: np.ndarray) -> torch.Tensor:
        # crops differ in size: resize each to the output size before stacking
        return torch.stack(
            [
                torch.nn.functional.interpolate(
                    crops[i][None],
                    size=(image_size, image_size),
                    mode="bilinear",
                    align_corners=False,
                    antialias=True,
                )[0]
                for i in indices
            ]
        )

    return to_model_input(decode, np.arange(count), image_size=image_size)
