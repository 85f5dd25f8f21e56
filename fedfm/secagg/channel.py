"""Key agreement, key derivation and authenticated encryption between two clients.

* X25519 for key agreement (raw 32-byte keys).
* HKDF-SHA256 for every derived key, with an ``info`` string that binds the protocol label,
  the key's purpose, the round and the node ids (ordered as the purpose requires), so a key
  derived for one purpose, round or pair is unrelated to any other.
* ChaCha20-Poly1305 for the shares one client sends another through the server, with associated
  data binding round, stage, sender and receiver: a ciphertext the server replays in another
  round, attributes to another sender or forwards to another receiver fails authentication.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedfm.errors import ProtocolError

PROTOCOL_LABEL = b"fedfm-secagg-v1"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16

# Purposes of derived keys (HKDF info) and of authenticated data.
SHARE_ENCRYPTION = b"share-encryption"  # ordered (sender, receiver): one key per direction
PAIRWISE_MASK = b"pairwise-mask"  # ordered (smaller id, larger id): both ends derive it
SELF_MASK = b"self-mask"  # (owner,)


def _encode_ids(round_id: int, node_ids: tuple[int, ...]) -> bytes:
    return round_id.to_bytes(8, "big") + b"".join(i.to_bytes(8, "big") for i in node_ids)


def new_private_key() -> bytes:
    """A fresh X25519 private key (32 raw bytes) from the operating system's generator."""
    return X25519PrivateKey.generate().private_bytes_raw()


def public_key_of(private_key: bytes) -> bytes:
    """The 32-byte X25519 public key of a raw private key."""
    return X25519PrivateKey.from_private_bytes(private_key).public_key().public_bytes_raw()


def agree(private_key: bytes, peer_public_key: bytes) -> bytes:
    """X25519 shared secret; :class:`ProtocolError` for a low-order (all-zero result) peer key."""
    try:
        return X25519PrivateKey.from_private_bytes(private_key).exchange(
            X25519PublicKey.from_public_bytes(peer_public_key)
        )
    except ValueError as error:
        raise ProtocolError(f"key agreement failed: {error}") from error


def hkdf_sha256(secret: bytes, info: bytes, length: int = KEY_BYTES) -> bytes:
    """``length`` bytes of HKDF-SHA256 output (no salt) for the context string ``info``."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def derive_key(secret: bytes, purpose: bytes, round_id: int, *node_ids: int) -> bytes:
    """A 32-byte key for ``purpose`` in ``round_id`` between ``node_ids`` (HKDF-SHA256)."""
    info = PROTOCOL_LABEL + b"|" + purpose + b"|" + _encode_ids(round_id, node_ids)
    return hkdf_sha256(secret, info)


def share_associated_data(round_id: int, sender: int, receiver: int) -> bytes:
    """What a share ciphertext is bound to: protocol, stage, round, sender and receiver."""
    return PROTOCOL_LABEL + b"|share_keys|" + _encode_ids(round_id, (sender, receiver))


def share_encryption_key(
    own_private_key: bytes, peer_public_key: bytes, round_id: int, sender: int, receiver: int
) -> bytes:
    """The key ``sender`` encrypts to ``receiver`` with; ``receiver`` derives it the same way."""
    shared = agree(own_private_key, peer_public_key)
    return derive_key(shared, SHARE_ENCRYPTION, round_id, sender, receiver)


def seal(key: bytes, plaintext: bytes, associated_data: bytes) -> bytes:
    """``nonce || ChaCha20-Poly1305(plaintext)``.

    The nonce is random rather than a counter: a client that answers a retried message from
    the same state encrypts fresh shares under the same key, and must not reuse a nonce.
    """
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated_data)


def open_sealed(
    key: bytes, ciphertext: bytes | memoryview, associated_data: bytes, what: str
) -> bytes:
    """Decrypt :func:`seal` output; :class:`ProtocolError` if it was altered or misaddressed."""
    nonce, body = ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:]
    try:
        return ChaCha20Poly1305(key).decrypt(nonce, body, associated_data)
    except InvalidTag:
        raise ProtocolError(
            f"{what} failed authentication: it was altered, or was not encrypted by that sender "
            "for this receiver in this round"
        ) from None
