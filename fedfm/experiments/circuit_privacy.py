"""Circuit privacy measured: what a key holder tells about the server's computation from what it
receives (issue 19, defect 5).

The adversary is the data owner (the key holder), curious about the server's secrets: here the
swap masks of the Benes network that permutes its samples. Two permutations that give the same
plaintext (samples 0 and 1 equal, samples 2 and 3 equal) are the two hypotheses. The key holder
knows everything the server's computation depends on except the secret: its own uploads (their
``c0`` and ``c1``), the public keys, the public circuit. It replays the server's computation under
each hypothesis with an evaluator of its own and compares: ``c1`` (:func:`c1_replay_rate`) and
the decrypted noise (:func:`noise_distinguisher_rate`). The harness holds both parties' objects,
so it reaches into the key owner's SEAL decryptor; the library never does this.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import tenseal as ts

from fedfm.crypto import CKKS_8192_REFRESH, ModelGeometry, run_locally
from fedfm.crypto.ckks import CkksBackend, CkksBatch, CkksEvaluator, CkksKeyOwner
from fedfm.crypto.seal_raw import read_ciphertext

GEOMETRY = ModelGeometry(tokens=5, patch_size=4)
# Samples 0 = 1 and 2 = 3: both orders give [A, A, B, B], through one Benes layer each.
HYPOTHESES = (np.array([0, 1, 3, 2]), np.array([1, 0, 2, 3]))


@dataclass
class Arena:
    """A key owner, the server's evaluator and the key owner's upload of [A, A, B, B]."""

    owner: CkksKeyOwner
    server: CkksEvaluator
    upload: CkksBatch


def evaluator(owner: CkksKeyOwner, **changes: Any) -> CkksEvaluator:
    """A server for ``owner`` on ``ckks-8192`` with parameter ``changes`` (e.g. flood_bits=0)."""
    params = dataclasses.replace(CKKS_8192_REFRESH, **changes)
    return CkksBackend(params).create_evaluator(owner.public_context(), GEOMETRY)


def build_arena() -> Arena:
    owner = CkksBackend(CKKS_8192_REFRESH).create_key_owner(geometry=GEOMETRY)
    values = np.random.default_rng(0).uniform(-3.0, 3.0, size=(4, 5, 2))
    values[1], values[3] = values[0], values[2]
    return Arena(owner, evaluator(owner), owner.encrypt(values))


def replays(owner: CkksKeyOwner, upload: CkksBatch) -> list[CkksBatch]:
    """The key holder's replay of each hypothesis, on its own evaluator and upload."""
    mine = CkksBackend(CKKS_8192_REFRESH).create_evaluator(owner.public_context(), GEOMETRY)
    batch = mine.load(upload.to_payload())
    return [run_locally(mine.take(batch, order), mine, owner) for order in HYPOTHESES]


def c1_polynomials(batch: CkksBatch) -> list[np.ndarray]:
    return [read_ciphertext(ct).data[1] for feature in batch.tensor for ct in feature]


def coefficients(owner: CkksKeyOwner, batch: CkksBatch) -> np.ndarray:
    """What the key holder decrypts, as centered integer coefficients modulo q0 (one row per
    ciphertext): every level shares q0."""
    rows = []
    for feature in batch.tensor:
        for ct in feature:
            plain = ts.sealapi.Plaintext()
            owner._decryptor.decrypt(ct, plain)
            raw = owner._io.read_plaintext(plain)
            primes = raw.data.size // 8192
            values = owner._io.from_ntt(raw.parms_id, raw.data.reshape(1, primes, 8192))
            q0 = int(owner._seal.first_context_data().parms().coeff_modulus()[0].value())
            row = values[0, 0].astype(object)
            rows.append(np.where(row > q0 // 2, row - q0, row).astype(np.float64))
    return np.stack(rows)


def received(
    arena: Arena, secret: int, *, server: CkksEvaluator | None = None, released: bool = True
) -> CkksBatch:
    """What the key holder receives when the server permutes with hypothesis ``secret``;
    ``released=False`` is the behaviour before circuit privacy (the computed ciphertexts as
    they are)."""
    server = server or arena.server
    out = run_locally(
        server.take(server.load(arena.upload.to_payload()), HYPOTHESES[secret]),
        server,
        arena.owner,
    )
    if not released:
        out = dataclasses.replace(out, releaser=None)
    return arena.owner.load(out.to_payload())


def c1_replay_rate(arena: Arena, *, released: bool, trials: int = 4, seed: int = 0) -> float:
    """Share of trials in which the key holder names the secret by matching ``c1`` exactly
    against its replays (it guesses at random when nothing matches)."""
    expected = [c1_polynomials(replay) for replay in replays(arena.owner, arena.upload)]
    rng = np.random.default_rng(seed)
    right = 0
    for secret in rng.integers(0, 2, size=trials):
        got = c1_polynomials(received(arena, int(secret), released=released))
        matches = [all(np.array_equal(a, b) for a, b in zip(got, e, strict=True)) for e in expected]
        guess = matches.index(True) if any(matches) else int(rng.integers(0, 2))
        right += int(guess == secret)
    return right / trials


def noise_distinguisher_rate(
    arena: Arena, *, trials: int, seed: int, server: CkksEvaluator | None = None
) -> float:
    """The key holder's best guess from the decrypted noise: the hypothesis whose exactly
    replayed decryption is nearest (l2) to what it decrypts. Returns its success rate."""
    expected = [coefficients(arena.owner, replay) for replay in replays(arena.owner, arena.upload)]
    secrets = np.random.default_rng(seed).integers(0, 2, size=trials)
    right = 0
    for secret in secrets:
        got = coefficients(arena.owner, received(arena, int(secret), server=server))
        distances = [np.linalg.norm(got - e) for e in expected]
        right += int(np.argmin(distances) == secret)
    return right / trials


def distance_bound(arena: Arena) -> float:
    """Statistical distance of the two hypotheses' released views: the l2 difference of their
    noise over the flood's standard deviation, ``|d| / (sigma sqrt(2 pi))`` (Gaussian shift)."""
    expected = [coefficients(arena.owner, replay) for replay in replays(arena.owner, arena.upload)]
    difference = float(np.linalg.norm(expected[0] - expected[1]))
    sigma = 2.0**arena.server.circuit.refresher.flood_bits
    return difference / (sigma * math.sqrt(2.0 * math.pi))
