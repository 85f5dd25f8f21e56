"""Linear layers as exact integer matrix products on RNS residues (``fedfm.crypto.rns_linear``)."""

from __future__ import annotations

import numpy as np
import pytest
import tenseal as ts

from fedfm.crypto import CKKS_8192
from fedfm.crypto.circuit import Circuit
from fedfm.crypto.rns_linear import (
    LIMB_BITS,
    integer_weights,
    linear_residues,
    times_power_of_two,
)
from fedfm.crypto.seal_raw import primes_of
from fedfm.errors import ProtocolError

pytestmark = pytest.mark.ckks  # real TenSEAL/SEAL encryption throughout

# CKKS primes just below a power of two (the shortcut of times_power_of_two) and moduli far from
# one (its general path)
MODULI = [(1 << 40) - 87, (1 << 58) - 93, (1 << 60) - 87, (1 << 39) + 12345, (1 << 59) + 4321]


@pytest.mark.parametrize("prime", MODULI)
def test_residue_products_are_exact(prime: int) -> None:
    rng = np.random.default_rng(prime % 1000)
    fan_in, fan_out, width = 256, 5, 64
    residues = rng.integers(0, prime, size=(fan_in, width), dtype=np.uint64)
    weight = rng.normal(0.0, 4.0, size=(fan_out, fan_in))
    small, shift = integer_weights(weight, 1 << 40)
    # the bound that keeps every float64 partial sum exact
    assert np.abs(small).max() * (1 << LIMB_BITS) * fan_in < 2.0**53
    got = linear_residues(residues, small, shift, prime)
    big = [[int(w) << shift for w in row] for row in small.astype(np.int64)]
    for o in range(fan_out):
        for m in range(0, width, 7):
            expected = sum(big[o][i] * int(residues[i, m]) for i in range(fan_in)) % prime
            assert int(got[o, m]) == expected


@pytest.mark.parametrize("prime", MODULI)
def test_multiplying_by_a_power_of_two_matches_python_integers(prime: int) -> None:
    rng = np.random.default_rng(prime % 997)
    values = np.concatenate(
        [rng.integers(0, prime, size=500, dtype=np.uint64), np.array([0, 1, prime - 1], np.uint64)]
    )
    for bits in (1, LIMB_BITS, 33):
        got = times_power_of_two(values, bits, prime)
        assert [int(v) for v in got] == [(int(v) << bits) % prime for v in values]


def test_integer_weights_round_to_the_stated_step() -> None:
    weight = np.array([[0.5, -3.25, 1e-3], [7.0, 0.0, -1.0]])
    small, shift = integer_weights(weight, (1 << 40) - 87)
    effective = small * 2.0**shift / ((1 << 40) - 87)
    assert np.abs(effective - weight).max() <= 2.0**shift / (1 << 40)
    assert shift < 40 - 16  # weights keep more than 16 fractional bits


def test_circuit_linear_matches_seal_products_and_plaintext() -> None:
    params = CKKS_8192
    context = ts.context(
        ts.SCHEME_TYPE.CKKS,
        params.poly_modulus_degree,
        coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
    )
    context.global_scale = 2.0**params.scale_bits
    public = ts.context_from(context.serialize(save_secret_key=False))
    rng = np.random.default_rng(0)
    inputs = rng.uniform(-3.0, 3.0, size=(6, 32))
    weight = rng.normal(0.0, 2.0, size=(4, 6))
    bias = np.array([0.5, 0.0, -1.25, 2.0])
    vectors = [ts.ckks_vector(context, row.tolist()) for row in inputs]
    cts = [ts.ckks_vector_from(public, v.serialize()).ciphertext()[0] for v in vectors]
    circuit = Circuit(public, refresher=None)
    seal_context = public.seal_context().data
    assert len(primes_of(seal_context, cts[0].parms_id())) == len(params.coeff_mod_bit_sizes) - 1

    fast = circuit.linear(cts, weight, bias)
    slow = [circuit.weighted_sum(list(zip(cts, weight[o], strict=True)), bias[o]) for o in range(4)]
    expected = weight @ inputs + bias[:, None]
    for o in range(4):
        got_fast = _decrypt(context, fast[o])[:32]
        got_slow = _decrypt(context, slow[o])[:32]
        np.testing.assert_allclose(got_fast, expected[o], atol=1e-5)
        np.testing.assert_allclose(got_fast, got_slow, atol=1e-5)
        assert fast[o].parms_id() == slow[o].parms_id() and fast[o].scale == slow[o].scale
    with pytest.raises(ProtocolError, match="all weights zero"):
        circuit.linear(cts, np.zeros((1, 6)), np.zeros(1))


def _decrypt(context: ts.Context, ct: object) -> np.ndarray:
    seal_context = context.seal_context().data
    decryptor = ts.sealapi.Decryptor(seal_context, context.secret_key().data)
    encoder = ts.sealapi.CKKSEncoder(seal_context)
    plain = ts.sealapi.Plaintext()
    decryptor.decrypt(ct, plain)
    return np.array(encoder.decode_double(plain))
