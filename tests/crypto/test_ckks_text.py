"""A BERT-family block under real CKKS (fedfm.crypto.ckks_text) and under ``simulate`` against
the plaintext block: both backends keep one contract (tests/crypto/test_backend_contract.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfm.approx import ApproxConfig
from fedfm.crypto import get_backend
from fedfm.crypto.backend import Evaluator, KeyOwner, ModelGeometry, drive
from fedfm.crypto.ckks_vit import KeyMask
from fedfm.distillation.text import polynomial_student
from fedfm.errors import ConfigError, ModelError, ProtocolError
from fedfm.models.fhe_text import FheTextClassifier, to_fhe_text
from tests.models.test_fhe_text import PAD, tiny_bert

TOKENS = 8
LENGTHS = (8, 6, 3, 1, 5)
TOLERANCE = {"simulate": 1e-5, "ckks": 1e-4}  # of the output range, by evaluator backend


def _ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (len(LENGTHS), TOKENS), generator=generator)
    for row, length in enumerate(LENGTHS):
        ids[row, length:] = PAD
    return ids


@pytest.fixture(scope="module")
def student() -> FheTextClassifier:
    """A tiny BERT with every non-linearity polynomial: the text default's quartic GELU with
    channel scales, Taylor exp, Goldschmidt inverse, Newton inverse square root."""
    teacher = to_fhe_text(tiny_bert(), ApproxConfig.exact(), num_classes=3, pad_token_id=PAD)
    approx = ApproxConfig.build(gelu_degree=4, gelu_radius=4.0, gelu_channel_scale=True)
    return polynomial_student(teacher, approx, [_ids()]).eval()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("simulate", id="simulate"),
        pytest.param("ckks-8192", id="ckks-8192", marks=pytest.mark.ckks),
    ],
)
def parties(request: pytest.FixtureRequest) -> tuple[KeyOwner, Evaluator]:
    backend = get_backend(request.param)
    geometry = ModelGeometry(tokens=TOKENS, patch_size=1)
    owner = backend.create_key_owner(geometry=geometry)
    return owner, backend.create_evaluator(owner.public_context(), geometry)


def test_text_blocks_match_the_plaintext_blocks_with_padding(
    student: FheTextClassifier, parties: tuple[KeyOwner, Evaluator]
) -> None:
    """Two chained blocks on right-padded texts of 8, 6, 3, 1 and 5 tokens match the plaintext
    model at every position, and the key mask is what makes them match."""
    owner, evaluator = parties
    ids = _ids()
    key_mask = student.key_mask(ids)
    with torch.no_grad():
        hidden = student.embed(ids)
        first = student.block(0, hidden, key_mask)
        second = student.block(1, first, key_mask)
        unmasked = student.block(0, hidden, torch.ones_like(key_mask))

    def refresh(items: list) -> list:
        return evaluator.refreshed(owner.refresh(evaluator.refresh_payload(items)))

    batch = owner.encrypt(hidden.numpy())
    out = drive(evaluator.evaluate_text_block(student, 0, batch, key_mask.numpy()), refresh)
    got = owner.decrypt(out)
    tolerance = TOLERANCE[evaluator.backend]
    span = float(first.abs().max())
    assert np.abs(got - first.numpy()).max() <= tolerance * span
    # attending to the padding keys would have given another output at the real tokens
    real = key_mask.numpy()
    assert np.abs(got - unmasked.numpy())[real].max() > 1e-2 * span
    # chained on the server (under CKKS the token copies are rebuilt from the output)
    out = drive(evaluator.evaluate_text_block(student, 1, out, key_mask.numpy()), refresh)
    assert np.abs(owner.decrypt(out) - second.numpy()).max() <= tolerance * float(
        second.abs().max()
    )


def test_key_masks_and_models_are_checked(
    student: FheTextClassifier, parties: tuple[KeyOwner, Evaluator]
) -> None:
    owner, evaluator = parties
    ids = _ids()
    with torch.no_grad():
        batch = owner.encrypt(student.embed(ids).numpy())
    key_mask = student.key_mask(ids).numpy()
    with pytest.raises(ProtocolError, match="key mask has shape"):
        next(evaluator.evaluate_text_block(student, 0, batch, key_mask[:, :-1]))
    empty = key_mask.copy()
    empty[2] = False
    with pytest.raises(ProtocolError, match="at least one real token"):
        next(evaluator.evaluate_text_block(student, 0, batch, empty))
    with pytest.raises(ProtocolError, match="out of range"):
        next(evaluator.evaluate_text_block(student, 2, batch, key_mask))
    if evaluator.backend != "simulate":  # plaintext evaluates any model; CKKS polynomials only
        exact = student.with_approx(ApproxConfig.exact())
        with pytest.raises(ModelError, match="polynomial softmax"):
            next(evaluator.evaluate_text_block(exact, 0, batch, key_mask))


def test_key_mask_shifts_name_the_key_each_shift_brings() -> None:
    """``shifts[d]`` at query ``t`` is the key mask at ``(t + d) mod T``, in the packed layout."""
    from fedfm.crypto.packing import SlotLayout

    layout = SlotLayout.for_tokens(4096, TOKENS)
    keys = np.zeros((3, TOKENS), dtype=bool)
    for row, length in enumerate((8, 2, 5)):
        keys[row, :length] = True
    mask = KeyMask.of(layout, keys)
    assert mask.shifts.shape == (TOKENS, layout.ciphertexts_for(3), 4096)
    for d in range(TOKENS):
        unpacked = layout.unpack(mask.shifts[d][None], 3)[..., 0]
        np.testing.assert_array_equal(unpacked, np.roll(keys, -d, axis=1))
    assert KeyMask.of(layout, keys).digest == mask.digest
    assert KeyMask.of(layout, ~keys | keys[:, :1]).digest != mask.digest


@pytest.mark.slow
@pytest.mark.ckks
def test_bench_ckks_text_writes_the_block_table_and_the_forward_pass(
    student: FheTextClassifier, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fedfm bench-ckks-text`` on the tiny student: the ViT table's columns, the forward
    pass's per-block errors and agreeing predictions, the JSON's headline keys."""
    import json

    from fedfm.data.text_task import TextSplits, TokenizedTexts
    from fedfm.experiments import bench_ckks_text

    texts = TokenizedTexts(
        [f"text {i}" for i in range(len(LENGTHS))], _ids(), torch.arange(len(LENGTHS)) % 3, 3
    )
    splits = TextSplits(("a", "b", "c"), TOKENS, texts, texts, texts, texts)
    monkeypatch.setattr(student, "max_tokens", TOKENS)  # the encrypted layout's length
    report = {"teacher_accuracy": 0.5, "student_accuracy": 0.4}
    monkeypatch.setattr(
        bench_ckks_text, "kept_text_student", lambda run, folder, log: (student, report)
    )
    monkeypatch.setattr(bench_ckks_text, "load_text_encoder", lambda model: (None, None))
    monkeypatch.setattr(bench_ckks_text, "task_splits", lambda run, tokenizer: splits)
    rows = bench_ckks_text.run_text_ckks_benchmark(
        batch_sizes=(4,), forward_batch=3, results_dir=tmp_path, log=lambda _line: None
    )
    saved = json.loads((tmp_path / "ckks_block_minilm.json").read_text())
    assert saved["backend"] == "ckks-8192" and saved["tokens"] == TOKENS
    (row,) = rows
    assert row["batch_size"] == 4 and row["refreshes"] > 0 and row["error_over_range"] < 1e-3
    assert row["real_tokens_per_text"] == pytest.approx(np.mean(LENGTHS[:4]))
    forward = saved["forward_pass"]
    assert len(forward["block_error_over_range"]) == student.num_blocks
    assert max(forward["block_error_over_range"]) < 1e-3 and forward["predictions_agree"] == 3
    table = (tmp_path / "ckks_block_minilm.md").read_text()
    assert "| batch | samples/ct | s/block |" in table and "Regenerate:" in table
    with pytest.raises(ConfigError, match="measures a CKKS backend"):
        bench_ckks_text.run_text_ckks_benchmark(backend_name="simulate", results_dir=tmp_path)


@pytest.mark.slow
@pytest.mark.ckks
def test_a_batch_over_two_ciphertext_columns_matches_the_plaintext_block(
    student: FheTextClassifier,
) -> None:
    """Texts beyond one ciphertext's capacity are evaluated one column at a time; the joined
    output matches the plaintext block for the texts of both columns."""
    backend = get_backend("ckks-8192")
    geometry = ModelGeometry(tokens=TOKENS, patch_size=1)
    owner = backend.create_key_owner(geometry=geometry)
    evaluator = backend.create_evaluator(owner.public_context(), geometry)
    count = evaluator.samples_per_set + 3
    # the calibration texts over and over (new texts could leave the calibrated bounds): the
    # second column starts at another of them than the first
    assert evaluator.samples_per_set % len(LENGTHS)
    ids = _ids()[torch.arange(count) % len(LENGTHS)]
    key_mask = student.key_mask(ids)
    with torch.no_grad():
        hidden = student.embed(ids)
        expected = student.block(0, hidden, key_mask).numpy()

    def refresh(items: list) -> list:
        return evaluator.refreshed(owner.refresh(evaluator.refresh_payload(items)))

    batch = owner.encrypt(hidden.numpy())
    out = drive(evaluator.evaluate_text_block(student, 0, batch, key_mask.numpy()), refresh)
    got = owner.decrypt(out)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE["ckks"] * float(np.abs(expected).max())


def test_a_layer_norm_weight_of_zero_is_refused_under_ckks(student: FheTextClassifier) -> None:
    """The residual's LayerNorm affine is a scalar product per feature: a zero weight would be a
    product SEAL refuses, so it is named before any ciphertext is touched."""
    from fedfm.crypto.ckks_text import affine

    norm = student.block_modules(0).attention_norm
    saved = norm.weight.detach().clone()
    try:
        with torch.no_grad():
            norm.weight[3] = 0.0
        with pytest.raises(ModelError, match="LayerNorm weight of zero"):
            next(affine(None, norm, 1.0, [], np.ones((1, 8)), "block1/residual"))  # type: ignore[arg-type]
    finally:
        with torch.no_grad():
            norm.weight.copy_(saved)
