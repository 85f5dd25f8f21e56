"""Circuit privacy (issue 19, defect 5): what the key holder can tell about the server's
computation from the ciphertexts it receives.

The adversary is the data owner (the key holder), curious about the server's secrets: here the
swap masks of the Benes network that permutes its samples. Two permutations that give the same
plaintext (samples 0 and 1 equal, samples 2 and 3 equal) are the two hypotheses. The key holder
knows everything the server's computation depends on except the secret: its own uploads (their
``c0`` and ``c1``), the public keys, the public circuit. It replays the server's computation under
each hypothesis with an evaluator of its own and compares.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from fedfm.crypto import CKKS_8192_REFRESH, ModelGeometry, run_locally
from fedfm.crypto.backend import drive
from fedfm.crypto.ckks import CkksBackend, CkksBatch, CkksEvaluator, CkksKeyOwner
from fedfm.crypto.simulate import SimulateBackend
from fedfm.errors import CryptoParameterError, ProtocolError
from fedfm.experiments import circuit_privacy as privacy
from tests.helpers import tiny_fhe_vit

pytestmark = pytest.mark.ckks  # real TenSEAL/SEAL encryption throughout

GEOMETRY = privacy.GEOMETRY
HYPOTHESES = privacy.HYPOTHESES


@pytest.fixture(scope="module")
def arena() -> privacy.Arena:
    return privacy.build_arena()


@pytest.fixture(scope="module")
def owner(arena) -> CkksKeyOwner:
    return arena.owner


@pytest.fixture(scope="module")
def server(arena) -> CkksEvaluator:
    return arena.server


@pytest.fixture(scope="module")
def upload(arena) -> CkksBatch:
    return arena.upload


_evaluator = privacy.evaluator
_replays = privacy.replays
_c1 = privacy.c1_polynomials
_coefficients = privacy.coefficients


def _received(owner, server, upload, secret: int, *, released: bool = True) -> CkksBatch:
    return privacy.received(
        privacy.Arena(owner, server, upload), secret, server=server, released=released
    )


def test_without_release_the_key_holder_reads_the_swap_masks_off_c1(owner, server, upload):
    """The attack on the old behaviour: ``c1`` of the output is a deterministic function of the
    key holder's own ``c1`` and the secret, so the replay of the right hypothesis matches it
    exactly (here the whole ciphertext does: no refresh happened in between)."""
    replays = [_c1(replay) for replay in _replays(owner, upload)]
    assert not all(np.array_equal(a, b) for a, b in zip(*replays, strict=True))
    for secret in (0, 1, 1, 0):
        got = _c1(_received(owner, server, upload, secret, released=False))
        matches = [all(np.array_equal(a, b) for a, b in zip(got, r, strict=True)) for r in replays]
        assert matches == [secret == 0, secret == 1]  # the key holder learns the secret
    # released, c1 is a fresh encryption of zero's: it matches no replay
    got = _c1(_received(owner, server, upload, 0))
    for replay in replays:
        assert not any(np.array_equal(a, b) for a, b in zip(got, replay, strict=True))


def _noise_distinguisher(owner, server, upload, trials: int, seed: int) -> float:
    return privacy.noise_distinguisher_rate(
        privacy.Arena(owner, server, upload), trials=trials, seed=seed, server=server
    )


def test_rerandomising_alone_leaves_the_noise_to_read_flooding_hides_it(owner, server, upload):
    """Re-randomisation hides ``c1`` but the decryption still carries the computation's noise,
    which differs between the two hypotheses (one Benes layer's rotations and masked products):
    without flooding the key holder still tells them apart every time; with the flood
    (standard deviation 2^20 per coefficient) it is at chance, as the bound says."""
    expected = [_coefficients(owner, replay) for replay in _replays(owner, upload)]
    difference = float(np.linalg.norm(expected[0] - expected[1]))  # l2 over the 2 ciphertexts
    assert 2.0**10 < difference < 2.0**16  # noise-sized: same plaintext within precision
    sigma = 2.0**server.circuit.refresher.flood_bits
    bound = difference / (sigma * math.sqrt(2.0 * math.pi))
    assert bound < 2.0**-6  # the statistical distance of the two views released (2^-6.7)

    unflooded = _evaluator(owner, flood_bits=0)
    assert _noise_distinguisher(owner, unflooded, upload, trials=8, seed=1) == 1.0
    rate = _noise_distinguisher(owner, server, upload, trials=40, seed=2)
    assert 0.25 <= rate <= 0.75  # 50% +- 3.2 standard errors of 40 coin flips


def test_every_computed_batch_is_released_when_serialized(owner, server, upload):
    """Whatever protocol code sends a batch the evaluator computed, its payload is the released
    form (lowest level, fresh c1); batches loaded from the data owner are not altered, and the
    released values decrypt within the flood of the computed ones."""
    batch = server.load(upload.to_payload())
    out = run_locally(server.take(batch, HYPOTHESES[0]), server, owner)
    sent = owner.load(out.to_payload())
    for computed, released in zip(_c1(out), _c1(sent), strict=True):
        assert not np.array_equal(computed[0], released[0])
    lowest = owner._seal.last_parms_id()
    assert all(ct.parms_id() == lowest for feature in sent.tensor for ct in feature)
    unreleased = dataclasses.replace(out, releaser=None).nbytes
    assert out.nbytes < 0.6 * unreleased  # one prime instead of the refresh level's two
    flood = 2.0**server.circuit.refresher.flood_bits * math.sqrt(8192 / 2) / 2.0**40
    np.testing.assert_allclose(owner.decrypt(sent), owner.decrypt(out), atol=8 * flood)
    assert batch.releaser is None and owner.load(batch.to_payload()).tensor[0][0].parms_id() == (
        upload.tensor[0][0].parms_id()
    )
    # the loss and gradient too
    p = owner.encrypt(np.full((4, 3), 1 / 3))
    y = owner.encrypt(np.eye(3)[[0, 1, 2, 0]])
    loss, gradient = run_locally(
        server.cross_entropy(*(server.load(b.to_payload()) for b in (p, p, y))), server, owner
    )
    for computed in (loss, gradient):
        assert computed.releaser is not None
        received = owner.load(computed.to_payload())
        assert all(ct.parms_id() == lowest for feature in received.tensor for ct in feature)


def test_flood_parameters_are_checked(owner):
    with pytest.raises(CryptoParameterError, match="flood_bits"):
        _evaluator(owner, flood_bits=60)


@pytest.mark.slow
def test_released_blocks_match_simulate_within_the_flood(owner) -> None:
    """The precision the flood costs, against the simulate backend: two blocks of the tiny ViT
    with the client decrypting the released outputs and re-encrypting between them (as in the
    protocol) stay within six flood standard deviations plus CKKS's own 1e-4 of the range, and
    the head predicts the same classes."""
    model, images = tiny_fhe_vit()
    count = 8
    geometry = ModelGeometry(tokens=5, patch_size=4)
    key = CkksBackend(CKKS_8192_REFRESH).create_key_owner(geometry=geometry)
    server = CkksBackend(CKKS_8192_REFRESH).create_evaluator(key.public_context(), geometry)
    simulate = SimulateBackend()
    plain_key = simulate.create_key_owner(seed=0)
    plain = simulate.create_evaluator(plain_key.public_context())
    flood = 2.0**CKKS_8192_REFRESH.flood_bits * math.sqrt(8192 / 2) / 2.0**40
    with torch.no_grad():
        hidden = model.embed(images[:count]).numpy()
    expected = hidden
    for index in range(model.num_blocks):
        expected = plain_key.decrypt(
            drive(plain.evaluate_block(model, index, plain_key.encrypt(expected)), lambda _: [])
        )
        out = run_locally(
            server.evaluate_block(model, index, server.load(key.encrypt(hidden).to_payload())),
            server,
            key,
        )
        hidden = key.decrypt(key.load(out.to_payload()))  # released, as the protocol sends it
        span = float(np.abs(expected).max())
        assert np.abs(hidden - expected).max() <= 6 * flood + 1e-4 * span
        assert np.abs(hidden - key.decrypt(out)).max() > 0  # the flood is there
    with torch.no_grad():
        got = model.head(torch.from_numpy(hidden)).argmax(dim=1)
        want = model.head(torch.from_numpy(expected)).argmax(dim=1)
    assert torch.equal(got, want)


def test_the_key_holder_decrypts_only_released_ciphertexts(
    owner: CkksKeyOwner, server: CkksEvaluator, upload: CkksBatch
) -> None:
    """``decrypt_received`` (what the protocol's client uses) refuses a ciphertext the server did
    not release (above the lowest level: its noise was never flooded) or one at another scale,
    and decrypts a released one as ``decrypt`` does."""
    taken = run_locally(server.take(server.load(upload.to_payload()), HYPOTHESES[0]), server, owner)
    released = owner.load(taken.to_payload())  # serialised for the key holder: released
    np.testing.assert_array_equal(owner.decrypt_received(released), owner.decrypt(released))
    with pytest.raises(ProtocolError, match="above the lowest level"):
        owner.decrypt_received(upload)  # a fresh top-level encryption, never released
    rescaled = owner.load(taken.to_payload())
    for feature in rescaled.tensor:
        for ct in feature:
            ct.scale = ct.scale * 8
    with pytest.raises(ProtocolError, match="at scale 2\\^"):
        owner.decrypt_received(rescaled)
