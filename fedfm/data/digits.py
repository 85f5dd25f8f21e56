"""scikit-learn's bundled handwritten digits: the dataset that needs no network and no files."""

from __future__ import annotations

import numpy as np
import torch

from fedfm.data.splitting import RawImages, Source

_MAX_PIXEL = 16.0  # the digits are 8x8 images with integer values 0..16


def digits_source() -> Source:
    """Return the 1,797 8x8 grey digits (10 classes) as a source without a test split.

    Returns
    -------
    Source
        Pixels scaled to [0, 1]; the test set is carved out when splitting.
    """
    # scikit-learn loads here, not at import: a ClientApp process answering a refresh never
    # reads its data and should not pay for the import (seconds per message)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels = (bunch.images / _MAX_PIXEL).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    return Source(
        name="digits",
        num_classes=10,
        train=RawImages(
            labels=bunch.target.astype(np.int64),
            decode=lambda indices: torch.from_numpy(pixels[indices]),
        ),
        test=None,
    )
