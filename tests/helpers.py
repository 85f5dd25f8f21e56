"""Helpers shared by test modules (imported as ``tests.helpers``, never through conftest)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from timm.models.vision_transformer import VisionTransformer

from fedfm.approx import calibrate
from fedfm.approx.modules import clamped_count, reset_clamped
from fedfm.approx.specs import ApproxConfig
from fedfm.data import DataSplits
from fedfm.errors import InvariantError
from fedfm.models import ModelSpec
from fedfm.models.fhe_vit import FheViT, to_fhe_friendly
from fedfm.models.student import ApproxSettings, save_student


def tiny_fhe_vit(seed: int = 0) -> tuple[FheViT, torch.Tensor]:
    """A calibrated FHE-friendly ViT on 8x8 images in 4x4 patches (5 tokens, width 8, 2 heads,
    2 blocks, 3 classes) and 24 random images: every CKKS code path runs on it in seconds.

    Every parameter is drawn to matter (timm starts with tiny weights, zero biases and unit
    norms, which would leave attention uniform and biases idle); the class and position
    embeddings are widened so that LayerNorm stays inside its approximation's domain.
    """
    torch.manual_seed(seed)
    vit = VisionTransformer(
        img_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=3
    )
    with torch.no_grad():
        vit.pos_embed.normal_(0.0, 0.5)
        vit.cls_token.normal_(0.0, 1.0)
        for name, parameter in vit.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.3)
            elif "norm" in name:
                parameter.normal_(1.0, 0.3)
            elif "blocks" in name:
                parameter.normal_(0.0, 0.5)
    model = to_fhe_friendly(vit, ApproxConfig()).eval()
    images = torch.rand(24, 3, 8, 8)
    calibrate(model, [images])
    return model, images


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
    if clamped_count(student):
        raise InvariantError("the micro student left its approximations' domains on the pool")
    save_student(folder / "student.pt", student, spec, ApproxSettings())
    return folder


def processes_with(marker: str) -> list[str]:
    """Live processes whose environment contains ``marker`` (zombies have no environment): what
    a test that started Flower's processes checks is gone afterwards."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
    return found


def micro_decoder_source(cache: Path, *, seed: int = 0):
    """The ``llama_fedfm_micro`` decoder (2 layers, width 32, context 32) trained for a few steps
    on ``importlib``'s docstrings into ``cache`` (seconds): FedRAG's tests. Train it with
    :func:`fedfm.models.decoder.train_decoder`."""
    from dataclasses import replace

    from fedfm.data.stdlib_text import stdlib_root
    from fedfm.models.decoder import DecoderSource, DecoderTraining

    training = DecoderTraining(
        steps=12, batch_size=8, lr=1e-2, warmup_steps=2, eval_every=6, checkpoint_every=6
    )
    return DecoderSource(
        name="llama_fedfm_micro",
        cache_dir=cache,
        training=replace(training, seed=seed),
        text_root=stdlib_root() / "importlib",
    )


def save_tiny_text_encoder(folder: Path, *, seed: int = 0) -> Path:
    """A two-block BERT of width 16 and its WordPiece tokenizer (letters and ``##``-letters,
    so every lower-case word has ids) saved as a local folder, as a user's own model would be:
    ``load_text_encoder(folder)`` reads it offline."""
    import string

    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    letters = list(string.ascii_lowercase + string.digits)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters)]
    vocab_file = folder / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(vocab_file), do_lower_case=True)
    tokenizer.save_pretrained(str(folder))
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    BertModel(config, add_pooling_layer=False).save_pretrained(str(folder))
    return folder
