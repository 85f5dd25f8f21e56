"""The contract every crypto backend keeps, run over ``simulate`` and ``ckks-8192``.

The protocol only ever talks to a backend through :class:`~fedfm.crypto.backend.KeyOwner`
(the data owner: keys, encrypt, decrypt, refresh) and :class:`~fedfm.crypto.backend.Evaluator`
(the model owner: public bytes only). The plaintext ``simulate`` backend keeps the same message
flow as CKKS, so the same assertions hold for both: what travels is a payload, the evaluator
cannot decrypt, a payload under another owner's key is refused, and every shared computation
(selection and permutation, embedding, blocks, the loss) agrees with the plaintext model.
Tolerance: CKKS matches the plaintext polynomial model to 1e-4 of the output range; simulate
matches it to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfm.approx.modules import clamped_count, reset_clamped
from fedfm.crypto import ModelGeometry, get_backend, run_locally
from fedfm.crypto.backend import CryptoBackend, Evaluator, KeyOwner
from fedfm.errors import CryptoParameterError, ProtocolError
from fedfm.models.fhe_vit import FheViT
from tests.helpers import tiny_fhe_vit

GEOMETRY = ModelGeometry(tokens=5, patch_size=4)  # tiny_fhe_vit: 8x8 images, 4x4 patches
RELATIVE_TOLERANCE = {"simulate": 1e-5, "ckks-8192": 1e-4}
BACKENDS_UNDER_CONTRACT = [
    pytest.param("simulate", id="simulate"),
    pytest.param("ckks-8192", id="ckks-8192", marks=pytest.mark.ckks),
]


@pytest.fixture(scope="module", params=BACKENDS_UNDER_CONTRACT)
def backend(request: pytest.FixtureRequest) -> CryptoBackend:
    return get_backend(request.param)


@pytest.fixture(scope="module")
def owner(backend: CryptoBackend) -> KeyOwner:
    return backend.create_key_owner(geometry=GEOMETRY)


@pytest.fixture(scope="module")
def evaluator(backend: CryptoBackend, owner: KeyOwner) -> Evaluator:
    return backend.create_evaluator(owner.public_context(), GEOMETRY)


@pytest.fixture(scope="module")
def tiny() -> tuple[FheViT, torch.Tensor]:
    return tiny_fhe_vit()


def _values(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-5.0, 5.0, size=shape)


def _close(backend: CryptoBackend, got: np.ndarray, expected: np.ndarray) -> None:
    span = float(np.abs(expected).max())
    assert np.abs(got - expected).max() <= RELATIVE_TOLERANCE[backend.name] * span


def test_values_travel_as_payloads_the_evaluator_cannot_open(
    backend: CryptoBackend, owner: KeyOwner, evaluator: Evaluator
) -> None:
    values = _values(7, 5, 3)
    batch = evaluator.load(owner.encrypt(values).to_payload())
    assert batch.shape == values.shape
    np.testing.assert_allclose(owner.decrypt(owner.load(batch.to_payload())), values, atol=1e-6)
    assert not hasattr(evaluator, "decrypt")
    assert all(isinstance(array, np.ndarray) for array in batch.to_payload().values())


def test_a_payload_under_another_owners_key_is_refused(
    backend: CryptoBackend, evaluator: Evaluator
) -> None:
    stranger = backend.create_key_owner(geometry=GEOMETRY)
    with pytest.raises((CryptoParameterError, ProtocolError)):
        evaluator.load(stranger.encrypt(_values(2, 5, 3)).to_payload())


def test_take_selects_and_permutes(owner: KeyOwner, evaluator: Evaluator) -> None:
    values = _values(12, 5, 2)
    order = np.random.default_rng(1).permutation(12)[:7]
    taken = run_locally(evaluator.take(owner.encrypt(values), order), evaluator, owner)
    np.testing.assert_allclose(owner.decrypt(taken), values[order], atol=1e-5)
    with pytest.raises(ProtocolError, match="distinct"):
        run_locally(evaluator.take(owner.encrypt(values), np.array([1, 1])), evaluator, owner)


def test_embedding_and_a_block_agree_with_the_plaintext_model(
    backend: CryptoBackend,
    owner: KeyOwner,
    evaluator: Evaluator,
    tiny: tuple[FheViT, torch.Tensor],
) -> None:
    model, images = tiny
    with torch.no_grad():
        reset_clamped(model)
        hidden = model.embed(images[:6])
        first = model.block(0, hidden)
    assert clamped_count(model) == 0  # the reference stays inside the polynomials' domains
    embedded = run_locally(
        evaluator.embed(model, owner.encrypt(images[:6].numpy())), evaluator, owner
    )
    _close(backend, owner.decrypt(embedded), hidden.numpy())
    out = run_locally(evaluator.evaluate_block(model, 0, embedded), evaluator, owner)
    _close(backend, owner.decrypt(out), first.numpy())


def test_the_loss_and_its_gradient_agree_with_plaintext(
    backend: CryptoBackend, owner: KeyOwner, evaluator: Evaluator
) -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 3))
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    y = np.eye(3)[rng.integers(0, 3, size=6)]
    loss, grad = run_locally(
        evaluator.cross_entropy(owner.encrypt(p), owner.encrypt(np.log(p)), owner.encrypt(y)),
        evaluator,
        owner,
    )
    expected_loss = -(y * np.log(p)).sum(axis=1).mean()
    np.testing.assert_allclose(owner.decrypt(loss).ravel()[0], expected_loss, atol=1e-4)
    np.testing.assert_allclose(owner.decrypt(grad), (p - y) / len(p), atol=1e-5)


def test_a_restored_owner_decrypts_what_the_original_encrypted(
    backend: CryptoBackend, owner: KeyOwner
) -> None:
    restored = backend.restore_key_owner(owner.secret_state())
    values = _values(3, 5, 2)
    np.testing.assert_allclose(restored.decrypt(owner.encrypt(values)), values, atol=1e-6)
