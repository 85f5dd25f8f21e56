"""Additive secret sharing over the ring ``Z_{2^64}`` with fixed point, for every protocol.

FedRAG's PermLLM-style baseline, CENTAUR (and its full secret-sharing baseline) and SLIP share
these primitives. Values are numpy ``uint64`` arrays; numpy's unsigned arithmetic wraps, so ``+``,
``-`` and ``*`` are ring operations. Reals are encoded in two's complement with ``fraction``
fractional bits (:func:`encode`, :func:`decode`).

Products of two fixed-point values carry ``2 fraction`` bits and are brought back by
:func:`truncate`: SecureML's *local* share truncation (Mohassel & Zhang 2017, §4.1). Each party
shifts its own share (party 1 negates, shifts and negates back); the result is the true value
``± 1`` unit in the last place, except with probability about ``2 |x| / 2^64`` per element (``x``
the product's ring representative), when the shares wrap and the result is off by about
``2^(64 - fraction)``. :func:`truncation_failure_bound` states that bound; tests measure the
one-unit error and check the bound on the wrap.

Beaver triples (Beaver 1991): for ``z = x ∘ y`` (``∘`` a matrix or elementwise product) the
parties hold shares of ``(a, b, c = a ∘ b)``, open ``e = x - a`` and ``f = y - b`` and compute
``z = c + e ∘ b + a ∘ f + e ∘ f`` (the last term by party 0 only): :func:`beaver_open`,
:func:`beaver_close`. Uniform ring elements come from a ChaCha20 keystream under a fresh
OS-CSPRNG key (:func:`uniform`) or from a key two parties share (the runtime's
``context.shared_mask``): never from a seed in a configuration.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.secagg.masking import expand_mask

FRACTION = 16
SCALE = float(1 << FRACTION)
MIN_FRACTION, MAX_FRACTION = 8, 24

Product = Callable[[np.ndarray, np.ndarray], np.ndarray]


def check_fraction(fraction: int) -> int:
    """``fraction`` if it is a usable number of fractional bits, else :class:`ConfigError`."""
    if isinstance(fraction, bool) or not isinstance(fraction, int):
        raise ConfigError(f"fixed-point fractional bits must be an integer, got {fraction!r}")
    if not MIN_FRACTION <= fraction <= MAX_FRACTION:
        raise ConfigError(
            f"fixed-point fractional bits must be in [{MIN_FRACTION}, {MAX_FRACTION}] (a product "
            f"carries twice as many in a 64-bit ring), got {fraction}"
        )
    return fraction


ENCODE_LIMIT = 2.0**62  # encodings stay clear of the int64 edges (casting past them is undefined)


def encode(x: np.ndarray | float, fraction: int = FRACTION, what: str = "a value") -> np.ndarray:
    """Fixed point: ``round(x 2^fraction)`` in the ring ``Z_{2^64}`` (two's complement).

    :class:`ProtocolError` naming ``what`` if a value is not finite or too large for the ring
    (``|x| >= 2^(62 - fraction)``): numpy would cast it to an arbitrary word, silently."""
    scaled = np.round(np.asarray(x, dtype=np.float64) * float(1 << fraction))
    if not np.isfinite(scaled).all() or np.abs(scaled).max(initial=0.0) >= ENCODE_LIMIT:
        raise ProtocolError(
            f"{what} is not finite or too large for the ring (|x| >= 2^{62 - fraction} with "
            f"{fraction} fractional bits)"
        )
    return scaled.astype(np.int64).view(np.uint64)


def decode(x: np.ndarray, fraction: int = FRACTION) -> np.ndarray:
    """The real a ring element encodes with ``fraction`` fractional bits."""
    signed = np.asarray(x, dtype=np.uint64).view(np.int64)
    return signed.astype(np.float64) / float(1 << fraction)


def uniform(shape: tuple[int, ...]) -> np.ndarray:
    """Uniform ring elements from a fresh ChaCha20 key (OS CSPRNG)."""
    count = int(np.prod(shape)) if shape else 1
    return expand_mask(os.urandom(32), count).reshape(shape)


def share(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two additive shares of the ring array ``x``: a uniform mask and ``x - mask``."""
    mask = uniform(np.shape(x))
    return mask, np.asarray(x, dtype=np.uint64) - mask


def reveal(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The ring array two shares add up to."""
    return np.asarray(first, dtype=np.uint64) + np.asarray(second, dtype=np.uint64)


def ring_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(Batched) matrix product modulo ``2^64``.

    numpy's ``uint64`` arithmetic wraps as C does; ``einsum`` is about ten times faster than
    ``matmul`` on integer arrays (no BLAS for integers either way).
    """
    a, b = np.asarray(a, dtype=np.uint64), np.asarray(b, dtype=np.uint64)
    if a.ndim == 2 and b.ndim == 2:
        return np.einsum("ik,kj->ij", a, b)
    if a.ndim == b.ndim == 3:
        return np.einsum("hik,hkj->hij", a, b)
    return np.matmul(a, b)


def ring_multiply(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise product modulo ``2^64``."""
    return np.asarray(a, dtype=np.uint64) * np.asarray(b, dtype=np.uint64)


def truncate(x: np.ndarray, party: int, fraction: int = FRACTION) -> np.ndarray:
    """SecureML's local truncation of a share by ``2^fraction`` (party 0 and 1 differ)."""
    signed = np.asarray(x, dtype=np.uint64).view(np.int64)
    if party == 0:
        return (signed >> fraction).view(np.uint64)
    return (-((-signed) >> fraction)).view(np.uint64)


def truncation_failure_bound(magnitude: float, fraction: int = FRACTION) -> float:
    """Probability that local truncation of one element of real size ``magnitude`` (carrying
    ``2 fraction`` bits before the shift) wraps: about ``2 |x| 2^(2 fraction) / 2^64``."""
    return min(1.0, 2.0 * abs(magnitude) * float(1 << (2 * fraction)) / 2.0**64)


def beaver_open(
    x: np.ndarray, y: np.ndarray, a: np.ndarray, b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A party's shares of ``e = x - a`` and ``f = y - b`` (both parties open them)."""
    return np.asarray(x, np.uint64) - a, np.asarray(y, np.uint64) - b


def beaver_close(
    party: int,
    e: np.ndarray,
    f: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    product: Product = ring_matmul,
) -> np.ndarray:
    """A party's share of ``x ∘ y`` from the opened ``e, f`` and its triple shares ``a, b, c``."""
    z = c + product(e, b) + product(a, f)
    if party == 0:
        z = z + product(e, f)
    return z
