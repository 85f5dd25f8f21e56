"""Masks: ChaCha20 keystreams viewed as ``uint64``, and their sign convention.

A mask is the ChaCha20 keystream under a 32-byte key derived (HKDF, see
:mod:`fedfm.secagg.channel`) from the full secret, read as little-endian ``uint64``. Every bit of
the secret changes the stream, and the stream is computationally indistinguishable from uniform,
so ``value + mask mod 2**64`` hides ``value``. (Flower's ``pseudo_rand_gen`` instead folds the
seed to 32 bits for numpy's Mersenne Twister: 2**32 possible masks, predictable from outputs.)

Pairwise masks cancel in the sum because the node with the smaller id adds the mask it shares
with a neighbour and the node with the larger id subtracts it.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedfm.secagg.channel import KEY_BYTES, PAIRWISE_MASK, SELF_MASK, agree, derive_key

# Each mask key is used for exactly one stream, so a fixed nonce (and counter 0) is safe.
_ZERO_NONCE = bytes(16)


def expand_mask(key: bytes, length: int) -> np.ndarray:
    """``length`` uint64 words of ChaCha20 keystream under the 32-byte ``key``."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"mask keys are {KEY_BYTES} bytes, got {len(key)}")
    encryptor = Cipher(algorithms.ChaCha20(key, _ZERO_NONCE), mode=None).encryptor()
    stream = encryptor.update(bytes(8 * length))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64)


def self_mask(seed: bytes, round_id: int, owner: int, length: int) -> np.ndarray:
    """The mask ``PRG(b_u)`` node ``owner`` adds to its own input."""
    return expand_mask(derive_key(seed, SELF_MASK, round_id, owner), length)


def pairwise_mask(
    own_private_key: bytes,
    peer_public_key: bytes,
    round_id: int,
    owner: int,
    peer: int,
    length: int,
) -> np.ndarray:
    """The mask ``PRG(s_uv)`` shared by ``owner`` and ``peer`` (the same from either end)."""
    shared = agree(own_private_key, peer_public_key)
    key = derive_key(shared, PAIRWISE_MASK, round_id, min(owner, peer), max(owner, peer))
    return expand_mask(key, length)


def add_pairwise_mask(vector: np.ndarray, mask: np.ndarray, owner: int, peer: int) -> np.ndarray:
    """``vector`` plus the mask if ``owner < peer``, minus it otherwise."""
    return vector + mask if owner < peer else vector - mask


def remove_pairwise_mask(vector: np.ndarray, mask: np.ndarray, owner: int, peer: int) -> np.ndarray:
    """Undo :func:`add_pairwise_mask` (what the server does for a neighbour that dropped)."""
    return vector - mask if owner < peer else vector + mask
