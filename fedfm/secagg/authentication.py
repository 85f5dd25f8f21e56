"""Signed SecAgg+ public keys, checked against the identities a data owner pinned.

The server relays every public key, so an active server could hand a client its own keys in
place of its neighbours' and read the shares sent to them (see
``fedfm.experiments.secagg_attack``). Here each client signs its two public keys with its
long-term Ed25519 identity, and each client accepts a neighbour's keys only if they are signed
by an identity its data owner pinned (the SHA-256 fingerprint of the raw Ed25519 public key,
hex: the runtime's fingerprints, :func:`fedfm.runtime.identity.fingerprint`).

What is signed (:func:`key_statement`): the protocol label, the round, the node id the server
gave the signer in this round, both public keys and the round's client settings. So a signature
cannot be moved to other keys, to another node id (the server numbers the nodes, so node ids
alone prove nothing; the pinned identity does) or into another round, and two clients that were
given different settings cannot agree on keys.

This module does not import the runtime (SecAgg sits below it): the client's identity comes in
as any :class:`Signer` (the runtime's :class:`~fedfm.runtime.identity.Identity` is one), and
its pins as a ``name -> fingerprint`` mapping (the runtime's :func:`parse_pins` output). Which
mode a client runs in is its data owner's choice, passed to every step as a
:class:`KeyAuthentication`; nothing the server sends changes it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fedfm.errors import ConfigError, ProtocolError
from fedfm.secagg.channel import PROTOCOL_LABEL
from fedfm.secagg.config import ClientSettings

IDENTITY_BYTES = 32  # raw Ed25519 public key
SIGNATURE_BYTES = 64
# What an unsigned (semi-honest) client sends in place of its identity and signature.
NO_IDENTITY = bytes(IDENTITY_BYTES)
NO_SIGNATURE = bytes(SIGNATURE_BYTES)
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


class KeyAuthenticationError(ProtocolError):
    """A neighbour's SecAgg keys are unsigned, signed by an unpinned identity, or forged."""


class Signer(Protocol):
    """A long-term Ed25519 identity: its raw public key and a signing function."""

    @property
    def public_key(self) -> bytes: ...

    def sign(self, data: bytes) -> bytes: ...


def fingerprint(identity_public_key: bytes) -> str:
    """SHA-256 of a raw Ed25519 public key, 64 lowercase hex digits (as the runtime's pins)."""
    return hashlib.sha256(identity_public_key).hexdigest()


@dataclass(frozen=True)
class KeyAuthentication:
    """How a client authenticates SecAgg keys: its data owner's choice, never the server's.

    Build it with :meth:`signed` (the default everywhere in fedfm) or :meth:`semi_honest`.

    Attributes
    ----------
    signer:
        The client's identity; it signs the client's public keys. ``None`` only in the
        semi-honest mode (then the client sends :data:`NO_IDENTITY` and :data:`NO_SIGNATURE`).
    pinned:
        Fingerprint -> name of every identity this client accepts as a neighbour; the names
        only label error messages. (:meth:`signed` takes the usual ``name -> fingerprint``.)
        Empty: it accepts no neighbour (a federation of one; node config refuses it).
    check_neighbours:
        ``True``: refuse ``share_keys`` unless every neighbour's keys are signed by a distinct
        pinned identity other than the client's own, for this round, node id and settings.
        ``False`` (semi-honest): take the keys the server relays as they are.
    """

    signer: Signer | None
    pinned: Mapping[str, str] = field(default_factory=dict)
    check_neighbours: bool = True

    def __post_init__(self) -> None:
        if self.check_neighbours and self.signer is None:
            raise ConfigError("signed SecAgg keys need the client's identity (a signer)")
        for pin in self.pinned:
            if not _FINGERPRINT.fullmatch(pin):
                raise ConfigError(f"pin {pin!r} is not 64 lowercase hex digits")

    @classmethod
    def signed(cls, signer: Signer, pins: Mapping[str, str]) -> KeyAuthentication:
        """Sign this client's keys and accept only neighbours whose keys ``pins`` vouch for.

        ``pins`` maps a name (e.g. ``owner-2``) to that data owner's identity fingerprint, as
        :func:`fedfm.runtime.identity.parse_pins` returns it. Two names for one fingerprint
        are refused (one of them is a mistake).
        """
        by_fingerprint: dict[str, str] = {}
        for name, pin in pins.items():
            pin = pin.lower()
            if pin in by_fingerprint:
                raise ConfigError(
                    f"identity {pin[:16]}... is pinned twice, as {by_fingerprint[pin]!r} and "
                    f"{name!r}"
                )
            by_fingerprint[pin] = name
        return cls(signer, by_fingerprint, check_neighbours=True)

    @classmethod
    def semi_honest(cls, signer: Signer | None = None) -> KeyAuthentication:
        """Take the relayed keys as they are: secure only if the server follows the protocol.

        With a ``signer`` the client still signs its own keys (so that neighbours that check
        can accept them); it just does not check theirs.
        """
        return cls(signer, {}, check_neighbours=False)

    @property
    def mode(self) -> str:
        """``"signed"`` or ``"semi-honest"``."""
        return "signed" if self.check_neighbours else "semi-honest"


@dataclass(frozen=True)
class SignedKeys:
    """An identity's signature on one client's keys (:data:`NO_IDENTITY` etc. if unsigned)."""

    identity: bytes
    signature: bytes


def _fields(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: no two field lists encode to the same bytes."""
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


def key_statement(
    round_id: int,
    node_id: int,
    encryption_public_key: bytes,
    masking_public_key: bytes,
    settings: ClientSettings,
) -> bytes:
    """What a client's identity signs in ``advertise_keys``."""
    canonical = json.dumps(settings.to_config(""), sort_keys=True).encode()
    return _fields(
        PROTOCOL_LABEL,
        b"advertise-keys",
        round_id.to_bytes(8, "big"),
        node_id.to_bytes(8, "big"),
        encryption_public_key,
        masking_public_key,
        canonical,
    )


def sign_keys(
    signer: Signer | None,
    round_id: int,
    node_id: int,
    encryption_public_key: bytes,
    masking_public_key: bytes,
    settings: ClientSettings,
) -> SignedKeys:
    """``signer``'s signature on the keys, or the unsigned placeholders if ``signer`` is None."""
    if signer is None:
        return SignedKeys(NO_IDENTITY, NO_SIGNATURE)
    statement = key_statement(
        round_id, node_id, encryption_public_key, masking_public_key, settings
    )
    return SignedKeys(signer.public_key, signer.sign(statement))


def signature_is_valid(
    identity: bytes,
    signature: bytes,
    round_id: int,
    node_id: int,
    encryption_public_key: bytes,
    masking_public_key: bytes,
    settings: ClientSettings,
) -> bool:
    """Whether ``identity`` signed these keys for this round, node id and settings."""
    statement = key_statement(
        round_id, node_id, encryption_public_key, masking_public_key, settings
    )
    try:
        Ed25519PublicKey.from_public_bytes(identity).verify(signature, statement)
    except (InvalidSignature, ValueError):
        return False
    return True


class NeighbourKeysLike(Protocol):
    """The fields of a :class:`~fedfm.secagg.messages.NeighbourKeys` this check reads."""

    @property
    def node_id(self) -> int: ...
    @property
    def encryption_public_key(self) -> bytes: ...
    @property
    def masking_public_key(self) -> bytes: ...
    @property
    def identity(self) -> bytes: ...
    @property
    def signature(self) -> bytes: ...


def check_neighbour_keys(
    authentication: KeyAuthentication,
    *,
    node_id: int,
    round_id: int,
    settings: ClientSettings,
    neighbours: Sequence[NeighbourKeysLike],
) -> None:
    """Refuse, naming the neighbour, unless every neighbour's keys are signed as required.

    Nothing is checked in the semi-honest mode. Otherwise each neighbour's identity must be
    pinned, must not be this client's own, must not appear for two neighbours, and must have
    signed that neighbour's two keys for this round, its node id and these settings.

    Raises
    ------
    KeyAuthenticationError
        Naming the neighbour's node id (and pinned name, if any) and what is wrong.
    """
    if not authentication.check_neighbours:
        return
    own = fingerprint(authentication.signer.public_key) if authentication.signer else ""
    seen: dict[str, int] = {}
    for neighbour in neighbours:
        where = f"node {node_id}, round {round_id}: neighbour node {neighbour.node_id}"
        if neighbour.identity == NO_IDENTITY:
            raise KeyAuthenticationError(
                f"{where} offers unsigned keys (the server stripped its signature, or its data "
                "owner runs SecAgg semi-honest); refusing to share secrets with it"
            )
        offered = fingerprint(neighbour.identity)
        name = authentication.pinned.get(offered)
        if offered == own:
            raise KeyAuthenticationError(
                f"{where} offers keys signed by this node's own identity: a replayed key"
            )
        if name is None:
            raise KeyAuthenticationError(
                f"{where} offers keys signed by identity {offered[:16]}..., which is not pinned "
                "(secagg-pins): a substituted key or a data owner this one does not know"
            )
        if offered in seen:
            raise KeyAuthenticationError(
                f"{where} and neighbour node {seen[offered]} both offer keys of identity "
                f"{name!r}: one identity, two node ids"
            )
        seen[offered] = neighbour.node_id
        if not signature_is_valid(
            neighbour.identity,
            neighbour.signature,
            round_id,
            neighbour.node_id,
            neighbour.encryption_public_key,
            neighbour.masking_public_key,
            settings,
        ):
            raise KeyAuthenticationError(
                f"{where} (pinned as {name!r}) offers keys its identity did not sign for this "
                "round, node id and settings: substituted, altered or replayed keys"
            )
