"""Long-term node identities, pinned fingerprints, and session keys signed by identities.

The relay carries every public key, so it could hand each party a key of its own and sit in the
middle. To prevent that each node has a long-term Ed25519 identity key (a file only it reads) and
signs its per-session X25519 key with it; each party is given, out of band, the fingerprint
(SHA-256 of the raw Ed25519 public key, hex) of the identity expected for every role it talks to:
its *pins*. A session key that is not signed by the pinned identity of its role is refused.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from fedfm.errors import ConfigError
from fedfm.runtime.channel import LABEL, ChannelError, encode_fields

_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


class IdentityError(ChannelError):
    """A session key is not signed by the identity pinned for its role, or no pin exists."""


def fingerprint(identity_public_key: bytes) -> str:
    """The SHA-256 of a raw Ed25519 public key, as 64 lowercase hex digits."""
    return hashlib.sha256(identity_public_key).hexdigest()


class Identity:
    """A node's long-term Ed25519 signing key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key = private_key.public_key().public_bytes_raw()
        self.fingerprint = fingerprint(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh identity from the operating system's generator."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> Identity:
        """The identity saved by :meth:`save` (an unencrypted PKCS#8 PEM file).

        Raises
        ------
        ConfigError
            If the file is missing or holds no Ed25519 private key.
        """
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as error:
            raise ConfigError(f"cannot read the identity key {path}: {error}") from error
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
        return cls(key)

    def save(self, path: Path) -> None:
        """Write the private key to a new file only its owner can read."""
        pem = self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(pem)

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data)


def create_identity_file(path: Path) -> str:
    """Generate an identity, save it to ``path`` (which must not exist); its fingerprint."""
    identity = Identity.generate()
    identity.save(path)
    return identity.fingerprint


def parse_pins(text: str) -> dict[str, str]:
    """``"alice=<fingerprint>,bob=<fingerprint>"`` (commas or spaces) as a role -> pin map."""
    pins = {}
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        role, _, pin = item.partition("=")
        pin = pin.lower()
        if not role or not _FINGERPRINT.fullmatch(pin):
            raise ConfigError(
                f"pin {item!r} is not '<role>=<64 hex digits>' (the SHA-256 fingerprint of the "
                "role's identity key)"
            )
        if role in pins:
            raise ConfigError(f"role {role!r} is pinned twice")
        pins[role] = pin
    return pins


def format_pins(pins: Mapping[str, str]) -> str:
    """The inverse of :func:`parse_pins`."""
    return ",".join(f"{role}={pin}" for role, pin in pins.items())


@dataclass(frozen=True)
class KeyBundle:
    """A node's offer for one session: its roles and session key, signed by its identity."""

    roles: tuple[str, ...]
    identity: bytes  # raw Ed25519 public key
    session_key: bytes  # raw X25519 public key
    protocol_digest: bytes
    signature: bytes

    @staticmethod
    def statement(
        roles: tuple[str, ...], identity: bytes, session_key: bytes, digest: bytes, session: bytes
    ) -> bytes:
        """What the identity signs: every field of the bundle, plus the session."""
        return encode_fields(
            LABEL, b"key-bundle", digest, session, ",".join(roles), session_key, identity
        )

    @classmethod
    def signed(
        cls,
        identity: Identity,
        roles: tuple[str, ...],
        session_key: bytes,
        digest: bytes,
        session: bytes,
    ) -> KeyBundle:
        statement = cls.statement(roles, identity.public_key, session_key, digest, session)
        return cls(roles, identity.public_key, session_key, digest, identity.sign(statement))

    def verify(self, role: str, pins: Mapping[str, str], digest: bytes, session: bytes) -> None:
        """Check that this bundle is the pinned identity's offer for ``role`` in ``session``.

        Raises
        ------
        IdentityError
            If no pin exists for ``role``, the bundle's identity is not the pinned one (a
            substituted key), its signature does not verify (an altered bundle), or the peer
            signed another protocol description.
        """
        if role not in self.roles:
            raise IdentityError(f"the key offered for role {role!r} does not claim that role")
        pin = pins.get(role)
        if pin is None:
            raise IdentityError(
                f"no identity fingerprint is pinned for role {role!r}: give it in this node's "
                "node config 'pins'"
            )
        offered = fingerprint(self.identity)
        if offered != pin:
            raise IdentityError(
                f"substituted key: role {role!r} is pinned to identity {pin[:16]}..., but its "
                f"session key comes from identity {offered[:16]}..."
            )
        statement = self.statement(
            self.roles, self.identity, self.session_key, self.protocol_digest, session
        )
        try:
            Ed25519PublicKey.from_public_bytes(self.identity).verify(self.signature, statement)
        except (InvalidSignature, ValueError):
            raise IdentityError(
                f"the session key offered for role {role!r} is not signed by its pinned identity "
                "for this session: it was altered or replayed"
            ) from None
        if self.protocol_digest != digest:
            raise IdentityError(
                f"role {role!r} runs another protocol description (digest "
                f"{self.protocol_digest.hex()[:16]}..., ours {digest.hex()[:16]}...): the "
                "parties were given different steps, roles or parameters"
            )
