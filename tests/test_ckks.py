"""The TenSEAL CKKS backend: keys, transport checks and the encrypted loss.

Tolerances: CKKS at scale 2^40 ([60, 40, 40, 60], N = 8192) decrypts fresh values to about 1e-6
and the two-level loss to about 1e-5; the tests allow 1e-4 absolute for both.
"""

from __future__ import annotations

import numpy as np
import pytest
import tenseal as ts

from fedfm.crypto import BACKENDS, CKKS_8192, CkksParameters
from fedfm.crypto.ckks import CkksBackend, CkksEvaluator, CkksKeyOwner, _digest, summing_steps
from fedfm.crypto.simulate import SimulateBackend
from fedfm.errors import CryptoParameterError, ProtocolError

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def backend() -> CkksBackend:
    return CkksBackend(CKKS_8192)


@pytest.fixture(scope="module")
def owner(backend: CkksBackend) -> CkksKeyOwner:
    return backend.create_key_owner()


@pytest.fixture(scope="module")
def evaluator(backend: CkksBackend, owner: CkksKeyOwner) -> CkksEvaluator:
    return backend.create_evaluator(owner.public_context())


def _values(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-5.0, 5.0, size=shape)


def _with_digest(payload: dict[str, np.ndarray], blob: bytes) -> dict[str, np.ndarray]:
    """``payload`` with another blob and a matching digest: what a careful forger would send."""
    fingerprint = payload["context"].tobytes()
    digest = _digest(fingerprint, payload["shape"], blob)
    return {
        **payload,
        "blob": np.frombuffer(blob, dtype=np.uint8),
        "digest": np.frombuffer(digest, dtype=np.uint8),
    }


def test_backend_is_not_selectable_yet(evaluator: CkksEvaluator, owner: CkksKeyOwner) -> None:
    assert "ckks" not in BACKENDS
    batch = owner.encrypt(_values(1, 4))
    with pytest.raises(NotImplementedError, match="issue 4"):
        evaluator.embed(None, batch)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="issue 4"):
        evaluator.evaluate_block(None, 0, batch)  # type: ignore[arg-type]


def test_round_trip_through_a_payload(owner: CkksKeyOwner, evaluator: CkksEvaluator) -> None:
    values = _values(3, 2, 5)
    batch = owner.encrypt(values)
    assert batch.shape == (3, 2, 5)
    received = evaluator.load(batch.to_payload())
    returned = owner.load(received.to_payload())
    np.testing.assert_allclose(owner.decrypt(returned), values, atol=TOLERANCE, rtol=0)


def test_samples_wider_than_the_slots_are_chunked(owner: CkksKeyOwner) -> None:
    values = _values(1, CKKS_8192.slots + 10)
    batch = owner.load(owner.encrypt(values).to_payload())
    np.testing.assert_allclose(owner.decrypt(batch), values, atol=TOLERANCE, rtol=0)


def test_nbytes_is_the_payload_size(owner: CkksKeyOwner) -> None:
    batch = owner.encrypt(_values(2, 10))
    payload = batch.to_payload()
    assert batch.nbytes == sum(array.nbytes for array in payload.values())
    # Fresh ciphertexts are compressed below the uncompressed size the simulate backend counts.
    assert CKKS_8192.ciphertext_bytes / 2 < batch.nbytes / 2 < CKKS_8192.ciphertext_bytes


def test_public_context_holds_no_secret_key(owner: CkksKeyOwner, evaluator: CkksEvaluator) -> None:
    assert not evaluator._context.is_private()
    public = ts.context_from(owner.public_context())
    assert not public.is_private() and not public.has_secret_key()
    assert public.has_relin_keys() and public.has_galois_keys()
    vector = ts.ckks_vector_from(public, owner.encrypt(_values(1, 3)).vectors[0].serialize())
    with pytest.raises(ValueError, match="secret"):
        vector.decrypt()
    assert not hasattr(CkksEvaluator, "decrypt")
    # Only the summing rotation keys: TenSEAL's default Galois set alone is about 35 MB.
    assert len(owner.public_context()) < 5_000_000


def test_evaluator_refuses_a_context_with_the_secret_key(
    backend: CkksBackend, owner: CkksKeyOwner
) -> None:
    private = owner.secret_state()["context"].tobytes()
    with pytest.raises(CryptoParameterError, match="secret key"):
        backend.create_evaluator(private)
    with pytest.raises(CryptoParameterError, match="not a valid"):
        backend.create_evaluator(b"not a context")


def test_secret_state_restores_the_owner(backend: CkksBackend, owner: CkksKeyOwner) -> None:
    values = _values(2, 3)
    payload = owner.encrypt(values).to_payload()
    restored = backend.restore_key_owner(owner.secret_state())
    assert restored.public_context() == owner.public_context()
    np.testing.assert_allclose(
        restored.decrypt(restored.load(payload)), values, atol=TOLERANCE, rtol=0
    )


def test_insecure_parameters_need_the_unsafe_switch() -> None:
    insecure = CkksParameters(4096, (60, 40, 40, 60), 40)
    with pytest.raises(CryptoParameterError, match="128-bit"):
        CkksBackend(insecure)
    with pytest.warns(UserWarning, match="INSECURE"):
        unsafe = CkksBackend(insecure, allow_insecure=True)
    # SEAL inside TenSEAL enforces the same bound: key generation still fails, clearly.
    with pytest.raises(CryptoParameterError, match="SEAL refused"):
        unsafe.create_key_owner()


def test_foreign_key_is_rejected(
    backend: CkksBackend, owner: CkksKeyOwner, evaluator: CkksEvaluator
) -> None:
    other = backend.create_key_owner()
    foreign = other.encrypt(_values(2, 3))
    with pytest.raises(CryptoParameterError, match="another data owner"):
        evaluator.load(foreign.to_payload())
    with pytest.raises(CryptoParameterError, match="another data owner"):
        owner.load(foreign.to_payload())
    with pytest.raises(CryptoParameterError):
        owner.decrypt(foreign)
    with pytest.raises(CryptoParameterError):
        evaluator.take(foreign, np.array([0]))


def test_truncated_and_tampered_payloads_are_rejected(
    owner: CkksKeyOwner, evaluator: CkksEvaluator
) -> None:
    payload = owner.encrypt(_values(2, 3)).to_payload()
    blob = payload["blob"].tobytes()
    with pytest.raises(ProtocolError, match="digest"):
        evaluator.load({**payload, "blob": payload["blob"][:-100]})
    tampered = payload["blob"].copy()
    tampered[len(blob) // 2] ^= 0xFF
    with pytest.raises(ProtocolError, match="digest"):
        evaluator.load({**payload, "blob": tampered})
    # With a recomputed digest the framing and TenSEAL's own checks still catch the damage.
    with pytest.raises(ProtocolError, match="truncated"):
        evaluator.load(_with_digest(payload, blob[:-100]))
    header_broken = blob[:8] + bytes(16) + blob[24:]
    with pytest.raises(ProtocolError, match="malformed"):
        evaluator.load(_with_digest(payload, header_broken))
    with pytest.raises(ProtocolError, match="lacks"):
        evaluator.load({"blob": payload["blob"]})


def test_take_selects_and_reorders(owner: CkksKeyOwner, evaluator: CkksEvaluator) -> None:
    values = _values(4, 3)
    taken = evaluator.take(owner.encrypt(values), np.array([2, 0, 2]))
    assert taken.shape == (3, 3)
    np.testing.assert_allclose(owner.decrypt(taken), values[[2, 0, 2]], atol=TOLERANCE, rtol=0)
    with pytest.raises(ProtocolError, match="out of range"):
        evaluator.take(taken, np.array([3]))


def test_cross_entropy_matches_simulate(owner: CkksKeyOwner, evaluator: CkksEvaluator) -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(0.0, 2.0, size=(5, 10))
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    p = np.exp(log_p)
    y = np.eye(10)[rng.integers(0, 10, size=5)]

    simulate = SimulateBackend()
    key = simulate.create_key_owner(seed=0)
    expected_loss, expected_grad = simulate.create_evaluator(key.public_context()).cross_entropy(
        key.encrypt(p), key.encrypt(log_p), key.encrypt(y)
    )

    loss, grad = evaluator.cross_entropy(owner.encrypt(p), owner.encrypt(log_p), owner.encrypt(y))
    assert loss.shape == (1,) and grad.shape == (5, 10)
    loss_values = owner.decrypt(owner.load(loss.to_payload()))
    grad_values = owner.decrypt(owner.load(grad.to_payload()))
    np.testing.assert_allclose(loss_values, key.decrypt(expected_loss), atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(grad_values, key.decrypt(expected_grad), atol=TOLERANCE, rtol=0)


def test_cross_entropy_refuses_rows_wider_than_its_rotation_keys(
    owner: CkksKeyOwner, evaluator: CkksEvaluator
) -> None:
    assert summing_steps(16) == [1, 2, 4, 8] and summing_steps(17) == [1, 2, 4, 8, 16]
    wide = owner.encrypt(np.full((1, 17), 0.5))
    with pytest.raises(CryptoParameterError, match="rotation keys"):
        evaluator.cross_entropy(wide, wide, wide)
    with pytest.raises(ProtocolError, match="one shape"):
        evaluator.cross_entropy(wide, wide, owner.encrypt(np.ones((1, 3))))
