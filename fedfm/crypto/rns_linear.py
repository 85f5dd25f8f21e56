"""Linear layers on CKKS ciphertexts as exact integer matrix products (BLAS, all cores).

A linear layer multiplies every input ciphertext by a plaintext scalar and sums: on the RNS
residues of the ciphertexts that is the same integer matrix product for every prime ``p`` of the
level, ``Y = W X mod p``, where ``W`` holds the weights encoded as integers (``round(w * p_last)``,
what SEAL's encoder makes of a scalar at the scale of the last prime) and ``X`` stacks the input
ciphertexts' residues, one row per input feature. SEAL does these products one ciphertext pair at
a time on one core; here they are ``float64`` matrix products in BLAS, exact because every partial
sum stays below ``2**53``:

* each residue is split into limbs of :data:`LIMB_BITS` bits;
* the weights are encoded as ``W' * 2**shift`` with ``|W'| < 2**(53 - LIMB_BITS - log2(fan_in))``;
  ``shift`` is the smallest that fits, so a weight is rounded to ``2**shift / p_last`` (about
  ``2**-21`` for weights up to 8 at 40-bit primes and fan-in 256) instead of ``1 / p_last``;
* ``Y = sum_t 2**(LIMB_BITS t + shift) (W' X_t) mod p``, reduced with the ``uint64`` arithmetic of
  :mod:`fedfm.crypto.seal_raw` and :func:`times_power_of_two`.

The result is written back as a SEAL ciphertext at scale ``scale * p_last`` and rescaled by SEAL,
exactly as a sum of ``multiply_plain`` products would be. Reading ciphertexts costs a SEAL
``save`` each (TenSEAL's bindings give no other access to the coefficients), so the gain is
largest for layers with many outputs per input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedfm.crypto.seal_raw import (
    RawCiphertext,
    SealIO,
    addmod,
    mulmod,
    primes_of,
    reduce_once,
)
from fedfm.errors import InvariantError, ProtocolError

LIMB_BITS = 20
# float64 represents every integer of magnitude up to 2**53 exactly.
EXACT_BITS = 53


def integer_weights(weight: np.ndarray, last_prime: int) -> tuple[np.ndarray, int]:
    """``(W', shift)`` with ``W' * 2**shift ~= round(weight * last_prime)`` and exact BLAS sums.

    ``W'`` is a ``float64`` array of integers small enough that ``W' @ limbs`` (limbs below
    ``2**LIMB_BITS``, ``weight.shape[1]`` terms) never exceeds ``2**53`` in magnitude.
    """
    fan_in = weight.shape[1]
    allowed = EXACT_BITS - LIMB_BITS - max(1, math.ceil(math.log2(fan_in)))
    largest = float(np.max(np.abs(weight))) * last_prime
    shift = max(0, math.ceil(math.log2(largest + 1.0)) - allowed) if largest > 0 else 0
    return np.rint(weight * (last_prime / 2.0**shift)), shift


def times_power_of_two(values: np.ndarray, bits: int, prime: int) -> np.ndarray:
    """``values * 2**bits mod prime`` for ``values`` reduced modulo ``prime < 2**60``.

    CKKS primes lie just below a power of two, ``2**width = prime + excess`` with a small
    ``excess``: splitting ``values = high * 2**(width - bits) + low`` gives ``values * 2**bits =
    high * 2**width + low * 2**bits = high * excess + low * 2**bits (mod prime)``, both terms
    below ``prime`` when ``excess * 2**bits < prime``, so two conditional subtractions finish.
    Other moduli take :func:`fedfm.crypto.seal_raw.mulmod`.
    """
    width = prime.bit_length()
    excess = (1 << width) - prime
    if not 0 < bits < width or excess << bits >= prime:
        return mulmod(values, pow(2, bits, prime), prime)
    low_bits = np.uint64(width - bits)
    high = values >> low_bits
    low = values & np.uint64((1 << (width - bits)) - 1)
    total = (low << np.uint64(bits)) + high * np.uint64(excess)  # < 3 * prime < 2**62
    return reduce_once(reduce_once(total, prime), prime)


def linear_residues(
    residues: np.ndarray, small_weight: np.ndarray, shift: int, prime: int
) -> np.ndarray:
    """``(W' * 2**shift) @ residues mod prime`` exactly; ``residues`` is ``uint64`` (in, M).

    Horner's rule over the limbs, from the most significant: ``acc = acc * 2**LIMB_BITS +
    W' @ limb_t`` (each partial product reduced first), then ``acc * 2**shift``.
    """
    limb_mask = np.uint64((1 << LIMB_BITS) - 1)
    acc = None
    for t in reversed(range(math.ceil(prime.bit_length() / LIMB_BITS))):
        limb = ((residues >> np.uint64(LIMB_BITS * t)) & limb_mask).astype(np.float64)
        products = (small_weight @ limb).astype(np.int64)
        if prime > 1 << EXACT_BITS:  # |products| < 2**53 < prime: a sign fix-up reduces them
            partial = np.where(products < 0, products + np.int64(prime), products)
        else:
            partial = products % np.int64(prime)
        partial = partial.view(np.uint64)
        acc = (
            partial
            if acc is None
            else addmod(times_power_of_two(acc, LIMB_BITS, prime), partial, prime)
        )
    if acc is None:
        raise InvariantError("a prime without limbs (every prime has at least one)")
    return times_power_of_two(acc, shift, prime) if shift else acc


def linear_map(
    io: SealIO,
    seal_context: Any,
    cts: Sequence[Any],
    weight: np.ndarray,
) -> list[Any]:
    """``[sum_i weight[o, i] * cts[i] for o]`` before rescaling (scale ``scale * p_last``).

    ``cts`` must share one level, scale and size (the caller aligns them).
    """
    weight = np.asarray(weight, dtype=np.float64)
    if weight.ndim != 2 or weight.shape[1] != len(cts):
        raise ProtocolError(f"weights of shape {weight.shape} do not fit {len(cts)} ciphertexts")
    raws = [io.read_ciphertext(ct) for ct in cts]
    first = raws[0]
    if any(r.parms_id != first.parms_id or r.data.shape != first.data.shape for r in raws):
        raise ProtocolError("internal: a linear map's inputs are not at one level and size")
    primes = primes_of(seal_context, first.parms_id)
    size, _, degree = first.data.shape
    small_weight, shift = integer_weights(weight, primes[-1])
    out = np.empty((weight.shape[0], size, len(primes), degree), dtype=np.uint64)
    for j, prime in enumerate(primes):
        residues = np.stack([raw.data[:, j, :] for raw in raws]).reshape(len(raws), -1)
        out[:, :, j, :] = linear_residues(residues, small_weight, shift, prime).reshape(
            weight.shape[0], size, degree
        )
    scale = first.scale * primes[-1]
    return [
        io.write_ciphertext(RawCiphertext(first.parms_id, first.is_ntt_form, scale, data))
        for data in out
    ]
