"""Shamir secret sharing of 32-byte secrets, on Flower's GF(2^128) implementation.

Flower's :func:`create_shares` pads the secret to whole 16-byte blocks and shares each block;
a share is ``index (4 bytes, little-endian) || one 16-byte share per block``. Indices run
``1..n``; a client gives the share with index ``i`` to its ``i``-th neighbour in increasing
node-id order, so the arbitrary 64-bit Flower node ids never reach the field arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

from fedfm.errors import ProtocolError

SECRET_BYTES = 32
# 4-byte index + the 32-byte secret padded to 48 bytes (PKCS#7 always adds a block here)
SHARE_BYTES = 4 + 48


def split_secret(secret: bytes, threshold: int, num_shares: int) -> list[bytes]:
    """``num_shares`` shares of ``secret``, any ``threshold`` of which rebuild it."""
    if len(secret) != SECRET_BYTES:
        raise ProtocolError(f"secrets must be {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= num_shares:
        raise ProtocolError(f"cannot split into {num_shares} shares with threshold {threshold}")
    return create_shares(secret, threshold, num_shares)


def share_index(share: bytes) -> int:
    """The 1-based evaluation point a share carries."""
    return int.from_bytes(share[:4], "little")


def combine_secret(shares: Sequence[bytes], threshold: int, what: str) -> bytes:
    """Rebuild a secret from at least ``threshold`` shares with distinct indices.

    Fewer shares would silently interpolate a wrong secret, so the count is checked first and
    the error says how many were needed and received.
    """
    if len(shares) < threshold:
        raise ProtocolError(
            f"cannot reconstruct {what}: needs {threshold} shares, received {len(shares)}"
        )
    if any(len(share) != SHARE_BYTES for share in shares):
        raise ProtocolError(f"cannot reconstruct {what}: a share is not {SHARE_BYTES} bytes")
    chosen = list(shares[:threshold])
    if len({share_index(share) for share in chosen}) != threshold:
        raise ProtocolError(f"cannot reconstruct {what}: shares repeat an index")
    try:
        secret = combine_shares(chosen)
    except ValueError as error:
        raise ProtocolError(f"cannot reconstruct {what}: the shares are inconsistent") from error
    if len(secret) != SECRET_BYTES:
        raise ProtocolError(f"cannot reconstruct {what}: the shares are inconsistent")
    return secret
