"""SLIP's arithmetic: fixed point over the ring of integers modulo 2**64 (spec 003 §4.2).

The seed's Lemma 2 works modulo a prime ``L``; any modulus works for the lemma's argument, and
``L = 2**64`` lets numpy's ``uint64`` arithmetic wrap for free. Every number that crosses to
David is an element of this ring:

* an activation ``a`` is encoded as ``round(a * 2**ACTIVATION_BITS)`` (two's complement in
  ``uint64``);
* David's weights ``W_D`` are encoded once, offline, as ``round(W_D * 2**WEIGHT_BITS)``;
* David's product ``W_D a`` therefore carries the scale ``2**(ACTIVATION_BITS + WEIGHT_BITS)``
  (:data:`PRODUCT_BITS`); Charlie decodes it after removing the pad's cancellation mask.

Lemma 2's condition (the true integer product fits the ring's signed range) is checked by
Charlie before every request (:func:`check_headroom`): ``sum_j |W_D[i, j]| |a_j| < 2**63 /
2**PRODUCT_BITS``. With 20 + 20 fractional bits that is ``2**23``, far above what the models
here produce (the largest is printed by ``fedfm bench-slip``); a request that would overflow is
refused instead of returning a wrong answer.

Pads are uniform over the whole ring, from the operating system's CSPRNG (:func:`uniform_pads`),
so ``encode(a) + r`` is uniform and independent of ``a`` (the seed's Theorem 3).
"""

from __future__ import annotations

import os

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.sharing import decode as ring_decode
from fedfm.protocols.sharing import encode

ACTIVATION_BITS = 20  # fractional bits of an encoded activation
WEIGHT_BITS = 20  # fractional bits of David's encoded weights
PRODUCT_BITS = ACTIVATION_BITS + WEIGHT_BITS
RING_BITS = 64
HEADROOM = 2.0 ** (RING_BITS - 1 - PRODUCT_BITS)  # Lemma 2: |W_D a| must stay below this


def encode_activations(values: np.ndarray) -> np.ndarray:
    """``values`` (floats) as ring elements at scale ``2**ACTIVATION_BITS``."""
    return encode(values, ACTIVATION_BITS, "an activation")


def encode_weights(values: np.ndarray) -> np.ndarray:
    """David's weights as ring elements at scale ``2**WEIGHT_BITS`` (done once, offline)."""
    return encode(values, WEIGHT_BITS, "a weight")


def decode(values: np.ndarray, bits: int = PRODUCT_BITS) -> np.ndarray:
    """Ring elements read as signed integers, divided by ``2**bits`` (float64)."""
    return ring_decode(values, bits)


def decode_weights(values: np.ndarray) -> np.ndarray:
    """David's encoded weights as floats (what his W_D-only model runs with)."""
    return decode(values, WEIGHT_BITS)


def ring_matmul(rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``rows @ weight.T`` modulo 2**64: ``rows`` is ``(tokens, n)``, ``weight`` ``(m, n)``,
    both ``uint64``. numpy's integer matmul wraps on overflow, which is the ring's reduction."""
    rows, weight = np.asarray(rows), np.asarray(weight)
    if rows.dtype != np.uint64 or weight.dtype != np.uint64:
        raise ProtocolError(f"ring operands must be uint64, got {rows.dtype} and {weight.dtype}")
    if rows.ndim != 2 or weight.ndim != 2 or rows.shape[1] != weight.shape[1]:
        raise ProtocolError(
            f"a ring product needs (tokens, n) and (m, n) operands, got {rows.shape} and "
            f"{weight.shape}"
        )
    with np.errstate(over="ignore"):
        return rows @ weight.T


def uniform_pads(shape: tuple[int, ...]) -> np.ndarray:
    """Words uniform over the whole ring, from the OS CSPRNG (``os.urandom``)."""
    count = int(np.prod(shape, dtype=np.int64))
    if count < 0:
        raise ConfigError(f"a pad shape must be non-negative, got {shape}")
    return np.frombuffer(os.urandom(8 * count), dtype="<u8").astype(np.uint64).reshape(shape)


def row_l1_bound(encoded_weight: np.ndarray) -> float:
    """``max_i sum_j |W_D[i, j]|`` of an encoded weight (float): Charlie's headroom check uses
    it (a public property of David's file, computed offline)."""
    return float(np.abs(decode_weights(encoded_weight)).sum(axis=1).max(initial=0.0))


def check_headroom(values: np.ndarray, weight_bound: float, layer: str) -> None:
    """:class:`ProtocolError` if ``W_D a`` could leave the ring's signed range (Lemma 2)."""
    largest = float(np.abs(values).max(initial=0.0))
    if largest * weight_bound >= HEADROOM:
        raise ProtocolError(
            f"layer {layer}: |a| up to {largest:.4g} with row norm {weight_bound:.4g} could "
            f"overflow the ring (Lemma 2 needs |W_D a| < 2^{RING_BITS - 1 - PRODUCT_BITS}); "
            "fewer fractional bits would be needed"
        )
