"""Conversion of raw pixels into the normalised tensors fedfm's models take."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

# timm's ViTs are pretrained on ImageNet statistics; every dataset is normalised with them so the
# same backbone can be used on any of them.
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

_CHUNK_SIZE = 1024


def to_model_input(
    decode: Callable[[np.ndarray], torch.Tensor], indices: np.ndarray, *, image_size: int
) -> torch.Tensor:
    """Decode, resize and normalise the images at ``indices``.

    Parameters
    ----------
    decode
        Returns the images at the given indices as a float tensor ``(n, C, H, W)`` with values in
        [0, 1], where ``C`` is 1 (grey, replicated to RGB) or 3 (RGB).
    indices
        Indices to pass to ``decode``, in the order of the result.
    image_size
        Side length of the square output images; resized bilinearly when it differs.

    Returns
    -------
    torch.Tensor
        float32 tensor ``(len(indices), 3, image_size, image_size)`` normalised with
        :data:`IMAGENET_MEAN` and :data:`IMAGENET_STD`.
    """
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    # Filled chunk by chunk so peak memory stays one chunk above the result (large datasets at
    # ViT resolution take gigabytes).
    out = torch.empty((len(indices), 3, image_size, image_size), dtype=torch.float32)
    for start in range(0, len(indices), _CHUNK_SIZE):
        batch = decode(indices[start : start + _CHUNK_SIZE]).float()
        if batch.shape[-2:] != (image_size, image_size):
            # antialias matters when shrinking (e.g. 32 -> 16) and is a no-op when enlarging.
            batch = F.interpolate(
                batch,
                size=(image_size, image_size),
                mode="bilinear",
                align_corners=False,
                antialias=True,
            )
        out[start : start + len(batch)] = (batch.expand(-1, 3, -1, -1) - mean) / std
    return out
