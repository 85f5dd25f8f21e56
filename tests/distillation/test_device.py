"""Teacher pretraining and two-stage distillation on a device: the CPU numbers are the ones the
code gave before it took a device, and a GPU (when there is one) gives them within tolerance."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from fedfm.approx.specs import ApproxConfig
from fedfm.distillation.distill import DistillConfig, distill
from fedfm.distillation.training import PretrainConfig, pretrain
from fedfm.models.device import ieee_float32, resolve_device
from tests.helpers import tiny_fhe_vit

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Measured with the code before devices existed (main at 2f46ea4, torch 2.14.1, one thread) on
# exactly the runs below; `auto` is the CPU on this machine and must give them again.
BEFORE = {
    "distill_history": [
        {"embedding": 8.779784517779868e-06, "attention": 3.6541380087534585,
         "hidden": 3.095942497253418, "total": 6.750089327494304},
        {"prediction": 1.1229855219523113, "total": 1.1229855219523113},
    ],
    "distill_abs_parameter_sum": 533.2689127600752,
    "pretrain_loss": [1.1065949201583862, 1.1005131006240845],
    "pretrain_abs_parameter_sum": 85.2240869693355,
}  # fmt: skip
# Two epochs of eight steps on one machine: float32 sums in another order (threads, BLAS) move
# the last digits only.
CPU_RTOL = 1e-5
# A GPU in IEEE float32 (no TF32) sums in other orders than the CPU; over one epoch's steps that
# stays well under 1e-3 relative for these magnitudes (not measured here: no GPU on this machine).
GPU_RTOL, GPU_ATOL = 1e-3, 1e-5


def _abs_sum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def tiny_distillation(device: torch.device | None) -> dict[str, Any]:
    """Two epochs (one per stage) of distilling the tiny student from its exact self."""
    student, images = tiny_fhe_vit(0)
    teacher = student.with_approx(ApproxConfig.exact())
    labels = torch.arange(len(images)) % 3
    history = distill(
        student,
        teacher,
        images,
        labels,
        DistillConfig(epochs=2, batch_size=8, calibration_batches=2),
        progress=False,
        log=lambda _: None,
        **({} if device is None else {"device": device}),
    )
    assert next(student.parameters()).device.type == "cpu"  # back where artefacts are written
    return {"history": history, "abs_sum": _abs_sum(student)}


def tiny_pretraining(device: torch.device | None) -> dict[str, Any]:
    _, images = tiny_fhe_vit(0)
    labels = torch.arange(len(images)) % 3
    torch.manual_seed(1)
    vit = VisionTransformer(
        img_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=3
    )
    meta = pretrain(
        vit,
        images,
        labels,
        PretrainConfig(epochs=2, batch_size=8),
        progress=False,
        **({} if device is None else {"device": device}),
    )
    assert next(vit.parameters()).device.type == "cpu"
    return {"loss": meta["pretrain_loss"], "abs_sum": _abs_sum(vit)}


def _check_history(history: list[dict[str, Any]], expected: list[dict[str, float]], **tol) -> None:
    assert len(history) == len(expected)
    for row, want in zip(history, expected, strict=True):
        assert {key: row[key] for key in want} == pytest.approx(want, **tol)


@pytest.mark.parametrize("device", [None, "auto", "cpu"])
def test_cpu_distillation_gives_the_numbers_it_gave_before_devices(device) -> None:
    if device == "auto" and torch.cuda.is_available():
        pytest.skip("auto is a GPU here: the GPU test compares it")
    run = tiny_distillation(None if device is None else resolve_device(device))
    _check_history(run["history"], BEFORE["distill_history"], rel=CPU_RTOL)
    assert run["abs_sum"] == pytest.approx(BEFORE["distill_abs_parameter_sum"], rel=CPU_RTOL)


def test_cpu_teacher_pretraining_gives_the_numbers_it_gave_before_devices() -> None:
    run = tiny_pretraining(resolve_device("cpu"))
    assert run["loss"] == pytest.approx(BEFORE["pretrain_loss"], rel=CPU_RTOL)
    assert run["abs_sum"] == pytest.approx(BEFORE["pretrain_abs_parameter_sum"], rel=CPU_RTOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU torch can see")
def test_a_distillation_epoch_on_the_gpu_matches_the_cpu_within_tolerance() -> None:
    cpu = tiny_distillation(torch.device("cpu"))
    with ieee_float32():  # the comparison is about fp32 on two devices, not about TF32
        gpu = tiny_distillation(resolve_device("cuda"))
        gpu_teacher = tiny_pretraining(resolve_device("cuda"))
    expected = [
        {key: value for key, value in row.items() if key not in {"epoch", "stage", "clamped"}}
        for row in cpu["history"]
    ]
    _check_history(gpu["history"], expected, rel=GPU_RTOL, abs=GPU_ATOL)
    assert gpu["abs_sum"] == pytest.approx(cpu["abs_sum"], rel=GPU_RTOL)
    cpu_teacher = tiny_pretraining(torch.device("cpu"))
    assert gpu_teacher["loss"] == pytest.approx(cpu_teacher["loss"], rel=GPU_RTOL, abs=GPU_ATOL)
