"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedfm.approx import calibrate
from fedfm.approx.modules import clamped_count, reset_clamped
from fedfm.data import DataSplits
from fedfm.distillation.pipeline import ApproxSettings, save_student
from fedfm.models import ModelSpec, to_fhe_friendly


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Small tensors on a shared 2-core machine: a second thread only adds contention.

    One thread also keeps float reductions, hence runs, reproducible within a module.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def save_micro_student(folder: Path, splits: DataSplits) -> Path:
    """An untrained, calibrated two-block micro student on 8x8 images, saved in ``folder``.

    timm starts the class token near zero, which leaves LayerNorm's domain (plaintext would
    clamp, CKKS cannot); larger position and class embeddings keep every input inside it, so
    CKKS and simulate evaluate the same polynomials (checked here on the pool).
    """
    torch.manual_seed(0)
    spec = ModelSpec("vit_fedfm_micro", splits.aux.num_classes, 8)
    vit = spec.build()
    with torch.no_grad():
        vit.pos_embed.normal_(0.0, 0.5)
        vit.cls_token.normal_(0.0, 1.0)
    student = to_fhe_friendly(vit, ApproxSettings().build())
    calibrate(student, [splits.aux.images])
    reset_clamped(student)
    with torch.no_grad():
        student(splits.pool.images)
    assert clamped_count(student) == 0
    save_student(folder / "student.pt", student, spec, ApproxSettings())
    return folder
