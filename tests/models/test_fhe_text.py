"""The FHE-friendly BERT-family encoder (fedfm.models.fhe_text) on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel, GPT2Config

from fedfm.approx import ApproxConfig, ApproxSoftmax, calibrate, clamped_count, taylor_exp
from fedfm.approx.modules import calibrating
from fedfm.approx.specs import GoldschmidtInverseSpec
from fedfm.distillation.distill import DistillConfig, distill, layer_losses
from fedfm.errors import ConfigError, DataError, ModelError
from fedfm.models.fhe_text import (
    check_encoder_config,
    check_tokenizer,
    load_text_encoder,
    to_fhe_text,
)

PAD = 0


def tiny_bert(seed: int = 0, *, scale: float = 0.3) -> BertModel:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    model = BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():  # weights that matter: BERT's init (std 0.02) leaves attention uniform
        for name, parameter in model.named_parameters():
            if "LayerNorm" not in name:
                parameter.normal_(0.0, scale)
    return model


def padded_ids(seed: int = 1) -> torch.Tensor:
    """Three texts of 10, 6 and 3 tokens, right-padded to 12."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (3, 12), generator=generator)
    for row, length in enumerate((10, 6, 3)):
        ids[row, length:] = PAD
    return ids


def hf_hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != PAD).long()).last_hidden_state


def blocks_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        key_mask = model.key_mask(ids)
        hidden = model.embed(ids)
        for index in range(model.num_blocks):
            hidden = model.block(index, hidden, key_mask)
    return hidden


@pytest.mark.parametrize("architecture", ["bert", "distilbert"])
def test_exact_conversion_reproduces_the_hugging_face_model(architecture: str) -> None:
    if architecture == "bert":
        source = tiny_bert()
    else:
        torch.manual_seed(0)
        source = DistilBertModel(
            DistilBertConfig(
                vocab_size=50, dim=16, n_layers=2, n_heads=4, hidden_dim=32,
                max_position_embeddings=64, pad_token_id=PAD,
            )
        ).eval()  # fmt: skip
    ids = padded_ids()
    reference = hf_hidden(source, ids)
    model = to_fhe_text(source, ApproxConfig.exact(), num_classes=3, pad_token_id=PAD).eval()
    real = ids != PAD
    # the block-by-block path (what the server will run) and HF's own forward, now dispatching
    # attention to fedfm's registered implementation
    torch.testing.assert_close(blocks_hidden(model, ids)[real], reference[real])
    torch.testing.assert_close(hf_hidden(model.encoder, ids)[real], reference[real])
    assert source.config._attn_implementation != "fedfm_fhe"  # the source is untouched
    pooled = reference.masked_fill(~real[..., None], 0).sum(1) / real.sum(1, keepdim=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model.classifier(pooled))


@pytest.mark.parametrize("approx", [ApproxConfig.exact(), ApproxConfig()], ids=["exact", "poly"])
def test_padding_does_not_change_the_real_tokens(approx: ApproxConfig) -> None:
    model = to_fhe_text(tiny_bert(), approx, num_classes=3, pad_token_id=PAD).eval()
    ids = padded_ids()
    calibrate(model, [ids])
    for row, length in enumerate((10, 6, 3)):
        alone = blocks_hidden(model, ids[row : row + 1, :length])[0]
        in_batch = blocks_hidden(model, ids)[row, :length]
        torch.testing.assert_close(in_batch, alone, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(
                model(ids)[row], model(ids[row : row + 1, :length])[0], rtol=1e-4, atol=1e-5
            )


def test_polynomial_softmax_gives_masked_keys_zero_weight() -> None:
    softmax = ApproxSoftmax(taylor_exp(6), GoldschmidtInverseSpec(7))
    logits = torch.tensor([[0.5, -1.0, 2.0, -1e9]])  # an additive mask's value at the end
    keep = torch.tensor([[True, True, False, False]])
    with torch.no_grad(), calibrating(softmax):
        softmax(logits, keep)
    weights = softmax(logits, keep)
    assert weights[0, 2] == 0 and weights[0, 3] == 0
    expected = torch.softmax(logits[:, :2], dim=-1)
    torch.testing.assert_close(weights[:, :2], expected, rtol=2e-3, atol=2e-3)


def test_polynomial_conversion_stays_close_after_calibration() -> None:
    source = tiny_bert(scale=0.1)  # attention logits inside the Taylor exp's [-4, 4]
    ids = padded_ids()
    exact = to_fhe_text(source, ApproxConfig.exact(), num_classes=3, pad_token_id=PAD).eval()
    # GELU's quadratic is a replacement that distillation adapts to, not an approximation: keep
    # it exact here and check the exp, inverse and inverse-sqrt approximations
    poly = exact.with_approx(ApproxConfig.build(gelu=False)).eval()
    calibrate(poly, [ids])
    real = ids != PAD
    reference = blocks_hidden(exact, ids)[real]
    approximated = blocks_hidden(poly, ids)[real]
    assert clamped_count(poly) == 0
    error = (approximated - reference).abs().max() / reference.abs().max()
    assert error < 0.02, f"relative error {error:.3g}"


def test_distillation_runs_on_the_text_model() -> None:
    source = tiny_bert()
    teacher = to_fhe_text(source, ApproxConfig.exact(), num_classes=3, pad_token_id=PAD)
    student = teacher.with_approx(ApproxConfig())
    ids = torch.cat([padded_ids(seed) for seed in range(2)])
    labels = torch.arange(len(ids)) % 3
    config = DistillConfig(
        epochs=2, batch_size=3, lr_stage1=3e-3, lr_stage2=1e-3, calibration_batches=1
    )
    history = distill(student, teacher, ids, labels, config, progress=False, log=lambda _: None)
    assert [row["stage"] for row in history] == [1, 2]
    undistilled = teacher.with_approx(ApproxConfig())
    calibrate(undistilled, [ids])
    with torch.no_grad():
        target = teacher.forward_intermediates(ids)
        before = layer_losses(undistilled.forward_intermediates(ids), target)["hidden"]
        after = layer_losses(student.forward_intermediates(ids), target)["hidden"]
    assert after < 0.9 * before  # distillation pulled the student's blocks to the teacher's
    assert not torch.isnan(student.layers[0].attention.output.LayerNorm.input_bound)


def test_decoders_and_other_architectures_are_refused() -> None:
    with pytest.raises(ModelError, match="decoder"):
        check_encoder_config(BertConfig(is_decoder=True))
    with pytest.raises(ModelError, match="not a supported BERT-family encoder"):
        check_encoder_config(GPT2Config())
    config = tiny_bert().config
    config.is_decoder = True
    decoder = BertModel(config)
    with pytest.raises(ModelError, match="decoder"):
        to_fhe_text(decoder, ApproxConfig.exact(), num_classes=2, pad_token_id=PAD)


class _Tokenizer:
    def __init__(self, size: int, pad: int | None = PAD) -> None:
        self.size, self.pad_token_id = size, pad

    def __len__(self) -> int:
        return self.size


def test_tokenizer_model_mismatch_is_refused() -> None:
    config = tiny_bert().config
    assert check_tokenizer(_Tokenizer(50), config) == PAD
    with pytest.raises(ModelError, match="tokenizer/model mismatch: the tokenizer has 30522"):
        check_tokenizer(_Tokenizer(30522), config)
    with pytest.raises(ModelError, match="no padding token"):
        check_tokenizer(_Tokenizer(50, pad=None), config)


def test_sequences_longer_than_configured_are_refused() -> None:
    model = to_fhe_text(tiny_bert(), ApproxConfig.exact(), num_classes=2, pad_token_id=PAD,
                        max_tokens=8)  # fmt: skip
    with pytest.raises(DataError, match="10 tokens exceed the configured 8"):
        model(padded_ids())
    with pytest.raises(ConfigError, match="position table"):
        to_fhe_text(tiny_bert(), ApproxConfig.exact(), num_classes=2, pad_token_id=PAD,
                    max_tokens=65)  # fmt: skip


def test_a_missing_model_is_not_downloaded(tmp_path) -> None:
    with pytest.raises(ModelError, match="not available on this machine"):
        load_text_encoder(tmp_path / "no-such-model")


def test_attention_without_conversion_names_the_fix() -> None:
    model = tiny_bert()
    model.set_attn_implementation("fedfm_fhe")  # registered, but no FHE softmax attached
    with pytest.raises(ModelError, match="to_fhe_text"):
        hf_hidden(model, padded_ids())


@pytest.mark.slow
def test_packaged_minilm_exact_conversion_matches() -> None:
    encoder, tokenizer = load_text_encoder("minilm")
    ids = tokenizer(
        ["Return the path of a temporary file.", "Lock a mutex for the running thread."],
        padding=True,
        return_tensors="pt",
    )["input_ids"]
    model = to_fhe_text(encoder, ApproxConfig.exact(), num_classes=7, pad_token_id=0).eval()
    real = ids != 0
    torch.testing.assert_close(
        blocks_hidden(model, ids)[real], hf_hidden(encoder, ids)[real], rtol=1e-4, atol=1e-4
    )


def test_channel_scaled_gelu_is_calibrated_once_and_kept_by_copies() -> None:
    from fedfm.approx import ChannelScaledGELU
    from fedfm.distillation.text import polynomial_student

    teacher = to_fhe_text(tiny_bert(), ApproxConfig.exact(), num_classes=3, pad_token_id=PAD)
    approx = ApproxConfig.build(gelu_degree=2, gelu_radius=1.0, gelu_channel_scale=True)
    ids = padded_ids()
    student = polynomial_student(teacher, approx, [ids])
    gelus = [m for m in student.modules() if isinstance(m, ChannelScaledGELU)]
    assert len(gelus) == 2 and all(g.channel_scale.shape == (32,) for g in gelus)
    assert all((g.channel_scale > 1).any() for g in gelus)  # inputs beyond [-1, 1] were seen
    scales = [g.channel_scale.clone() for g in gelus]
    calibrate(student, [ids * 0 + 7])  # re-fixing the division bounds keeps the GELU scales
    copy = student.with_approx(approx)
    for model in (student, copy):
        kept = [m.channel_scale for m in model.modules() if isinstance(m, ChannelScaledGELU)]
        for old, new in zip(scales, kept, strict=True):
            torch.testing.assert_close(new, old)
    # padding still changes nothing for the real tokens
    calibrate(student, [ids])
    student.eval()
    for row, length in enumerate((10, 6, 3)):
        alone = blocks_hidden(student, ids[row : row + 1, :length])[0]
        torch.testing.assert_close(blocks_hidden(student, ids)[row, :length], alone,
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
