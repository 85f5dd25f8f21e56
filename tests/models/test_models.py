"""The foundation model and its FHE-friendly conversion and decomposition."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer

from fedfm.approx import ApproxConfig, calibrate
from fedfm.errors import CheckpointError, ModelError
from fedfm.models import FheAttention, ModelSpec, check_model_name, to_fhe_friendly
from fedfm.models.foundation import load_teacher, native_image_size, save_teacher


@pytest.fixture(scope="module")
def teacher() -> VisionTransformer:
    torch.manual_seed(0)
    return ModelSpec("vit_fedfm_tiny", 10, 32).build().eval()


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_exact_conversion_computes_the_timm_model(teacher, images) -> None:
    exact = to_fhe_friendly(teacher, ApproxConfig.exact()).eval()
    with torch.no_grad():
        torch.testing.assert_close(exact(images), teacher(images), atol=1e-5, rtol=1e-5)
        hidden = teacher.patch_embed(images)
        hidden = teacher._pos_embed(hidden)
        for index, block in enumerate(teacher.blocks):
            expected = block(hidden)
            torch.testing.assert_close(exact.block(index, hidden), expected, atol=1e-5, rtol=1e-5)
            hidden = expected


def test_conversion_keeps_the_source_untouched_and_swaps_every_nonlinearity(teacher) -> None:
    student = to_fhe_friendly(teacher, ApproxConfig())
    assert all(isinstance(block.attn, FheAttention) for block in student.vit.blocks)
    names = {type(module).__name__ for module in student.modules()}
    assert "GELU" not in names and "LayerNorm" not in names
    assert not any(isinstance(block.attn, FheAttention) for block in teacher.blocks)
    for name, parameter in teacher.state_dict().items():
        torch.testing.assert_close(student.vit.state_dict()[name], parameter)


def test_decomposition_equals_forward_and_exposes_attention_logits(teacher, images) -> None:
    student = to_fhe_friendly(teacher, ApproxConfig())
    calibrate(student, [images])
    student.eval()
    with torch.no_grad():
        hidden = student.embed(images)
        for index in range(student.num_blocks):
            hidden = student.block(index, hidden)
        torch.testing.assert_close(student.head(hidden), student(images))
        inter = student.forward_intermediates(images)
        torch.testing.assert_close(inter.logits, student(images))
        # A = Q K^T / sqrt(d_k) of block 0, recomputed from its weights (Eq. 10)
        block = student.vit.blocks[0]
        qkv = block.attn.qkv(block.norm1(inter.embedding))
        q, k, _ = qkv.reshape(4, -1, 3, 3, 32).permute(2, 0, 3, 1, 4)
        torch.testing.assert_close(inter.attention_logits[0], q @ k.transpose(-2, -1) / 32**0.5)
    assert inter.attention_logits[0].shape == (4, 3, 65, 65)
    assert len(inter.hidden_states) == student.num_blocks == 4


def test_approximate_student_differs_then_exact_swap_restores(teacher, images) -> None:
    student = to_fhe_friendly(teacher, ApproxConfig())
    calibrate(student, [images])
    with torch.no_grad():
        assert (student.eval()(images) - teacher(images)).abs().max() > 1e-2
        restored = student.with_approx(ApproxConfig.exact()).eval()
        torch.testing.assert_close(restored(images), teacher(images), atol=1e-5, rtol=1e-5)


def test_named_timm_vit_converts(images) -> None:
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8
    ).eval()
    exact = to_fhe_friendly(model, ApproxConfig.exact()).eval()
    with torch.no_grad():
        torch.testing.assert_close(exact(images), model(images), atol=1e-5, rtol=1e-5)
    assert native_image_size("vit_tiny_patch16_224") == 224


def test_unknown_model_name_suggests_close_names() -> None:
    with pytest.raises(ModelError, match=r"unknown model .vit_fedfm_tiney.*vit_fedfm_tiny"):
        check_model_name("vit_fedfm_tiney")


def test_non_vit_and_unsupported_blocks_are_refused() -> None:
    with pytest.raises(ModelError, match="needs a timm VisionTransformer"):
        ModelSpec("resnet18", 10, 32).build()
    parallel = timm.create_model(
        "vit_small_patch16_18x2_224", pretrained=False, num_classes=10, img_size=32
    )
    with pytest.raises(ModelError, match=r"ParallelScalingBlock|ParallelThingsBlock"):
        to_fhe_friendly(parallel, ApproxConfig())


def test_pretrained_weights_from_bad_file_fail_clearly(tmp_path) -> None:
    from fedfm.models import load_pretrained

    garbage = tmp_path / "weights.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match="could not load pretrained weights"):
        load_pretrained(ModelSpec("vit_tiny_patch16_224", 10, 32), checkpoint=garbage)
    with pytest.raises(ModelError, match="does not exist"):
        load_pretrained(ModelSpec("vit_tiny_patch16_224", 10, 32), checkpoint=tmp_path / "none")


def test_teacher_checkpoint_round_trip_and_errors(teacher, images, tmp_path) -> None:
    spec = ModelSpec("vit_fedfm_tiny", 10, 32)
    path = tmp_path / "teacher.pt"
    save_teacher(path, teacher, spec, {"pretrain_loss": [1.0]})
    loaded, meta = load_teacher(path)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(images), teacher(images))
    assert meta["pretrain_loss"] == [1.0]

    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_teacher(corrupt)

    other = ModelSpec("vit_fedfm_small", 10, 32)
    mismatched = tmp_path / "mismatched.pt"
    save_teacher(mismatched, teacher, other, {})
    with pytest.raises(CheckpointError, match="does not match"):
        load_teacher(mismatched)
