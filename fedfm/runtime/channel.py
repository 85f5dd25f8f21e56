"""End-to-end channels between roles, and the randomness two roles share.

Every node draws a fresh X25519 key pair per session (a run of a protocol); the roles it hosts
use it. Two roles ``a`` and ``b`` agree on ``s = X25519(a's key, b's key)`` and derive from it,
with HKDF-SHA256 and a length-prefixed context that binds the protocol digest, the session, the
purpose, both roles and both public keys:

* a ChaCha20-Poly1305 key per direction (``a -> b`` and ``b -> a`` differ);
* seeds for shared randomness, per purpose: a numpy ``Generator`` (permutations, scrambling
  matrices) or a ChaCha20 keystream (masks). The relay and every other role lack ``s``.

A sealed message is a *frame*: a cleartext header the relay routes by (sender role, receiver
role, sending step, sequence number) followed by ``nonce || ciphertext || tag`` of
:func:`fedfm.secagg.channel.seal`. The associated data is the label, protocol digest, session and
the whole header, so a relay that alters any of them, or the ciphertext, makes authentication
fail. Each direction numbers its frames from 0; the receiver accepts only the next number, which
rejects replays, reordering and dropped frames. Frames for roles the node does not host are
refused as misaddressed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedfm.errors import ProtocolError
from fedfm.secagg.channel import agree, hkdf_sha256, open_sealed, seal
from fedfm.secagg.masking import expand_mask

LABEL = b"fedfm-runtime-v1"
SESSION_BYTES = 16
FRAME_MAGIC = b"FRT1"
_FIELD_LENGTH_BYTES = 4
_SEQUENCE_BYTES = 8

Pair = tuple[str, str]  # (sender, receiver)


class ChannelError(ProtocolError):
    """A sealed message was altered, replayed, reordered, misaddressed or malformed."""


def encode_fields(*parts: bytes | str) -> bytes:
    """Length-prefixed concatenation: distinct field lists never encode to the same bytes."""
    encoded = [part.encode() if isinstance(part, str) else part for part in parts]
    return b"".join(len(part).to_bytes(_FIELD_LENGTH_BYTES, "big") + part for part in encoded)


@dataclass(frozen=True)
class FrameHeader:
    """What the relay reads of a frame to route it; authenticated, not encrypted."""

    sender: str
    receiver: str
    step: str
    sequence: int

    def encode(self) -> bytes:
        return (
            FRAME_MAGIC
            + encode_fields(self.sender, self.receiver, self.step)
            + self.sequence.to_bytes(_SEQUENCE_BYTES, "big")
        )

    def describe(self) -> str:
        return (
            f"message {self.sequence} from {self.sender!r} to {self.receiver!r} "
            f"(step {self.step!r})"
        )


def read_header(frame: bytes) -> tuple[FrameHeader, int]:
    """The header of ``frame`` and where its sealed body starts.

    Raises
    ------
    ChannelError
        If the frame is truncated or does not start with a header.
    """
    if frame[: len(FRAME_MAGIC)] != FRAME_MAGIC:
        raise ChannelError("malformed frame: it does not start with a runtime frame header")
    offset, names = len(FRAME_MAGIC), []
    for _ in range(3):
        length = int.from_bytes(frame[offset : offset + _FIELD_LENGTH_BYTES], "big")
        offset += _FIELD_LENGTH_BYTES
        if offset + length + _SEQUENCE_BYTES > len(frame):
            raise ChannelError("malformed frame: truncated header")
        try:
            names.append(frame[offset : offset + length].decode())
        except UnicodeDecodeError:
            raise ChannelError("malformed frame: a role or step name is not UTF-8") from None
        offset += length
    sequence = int.from_bytes(frame[offset : offset + _SEQUENCE_BYTES], "big")
    sender, receiver, step = names
    return FrameHeader(sender, receiver, step, sequence), offset + _SEQUENCE_BYTES


@dataclass(frozen=True)
class Opened:
    """A frame that passed every check: its header and its plaintext."""

    header: FrameHeader
    plaintext: bytes


class Channels:
    """One node's channels in one session.

    Parameters
    ----------
    digest:
        The protocol digest (:meth:`fedfm.runtime.Protocol.digest`) every key is bound to.
    session:
        The session id the orchestrator chose for this run.
    private_key:
        This node's X25519 private key for the session.
    session_keys:
        Each role's X25519 public key for the session, after pin checks (including the roles
        hosted here, whose key is this node's own).
    pairs:
        The role pairs the protocol lets exchange messages and share randomness.
    hosted:
        The roles this node plays.
    sent, received:
        Frames already sealed and opened per ``(sender, receiver)``: the next sequence numbers.
    """

    def __init__(
        self,
        *,
        digest: bytes,
        session: bytes,
        private_key: bytes,
        session_keys: Mapping[str, bytes],
        pairs: frozenset[frozenset[str]],
        hosted: frozenset[str],
        sent: Mapping[Pair, int],
        received: Mapping[Pair, int],
    ) -> None:
        self.digest, self.session = digest, session
        self._private_key = private_key
        self.session_keys = dict(session_keys)
        self.pairs, self.hosted = pairs, hosted
        self.sent, self.received = dict(sent), dict(received)
        self._secrets: dict[bytes, bytes] = {}

    # -- keys -----------------------------------------------------------------------------------

    def _check_pair(self, role: str, peer: str) -> None:
        if role not in self.hosted:
            raise ProtocolError(f"this node does not host role {role!r}")
        if frozenset((role, peer)) not in self.pairs:
            raise ProtocolError(f"the protocol declares no channel between {role!r} and {peer!r}")
        if peer not in self.session_keys:
            raise ProtocolError(f"no verified session key for role {peer!r}")

    def _secret(self, peer: str) -> bytes:
        key = self.session_keys[peer]
        if key not in self._secrets:
            self._secrets[key] = agree(self._private_key, key)
        return self._secrets[key]

    def _derive(self, kind: bytes, first: str, second: str, *context: bytes | str) -> bytes:
        """A key for ``kind`` between ``first`` and ``second`` (order as the caller needs)."""
        peer = second if first in self.hosted else first
        info = encode_fields(
            LABEL,
            kind,
            self.digest,
            self.session,
            first,
            second,
            self.session_keys[first],
            self.session_keys[second],
            *context,
        )
        return hkdf_sha256(self._secret(peer), info)

    def _shared_key(self, role: str, peer: str, kind: bytes, purpose: str) -> bytes:
        self._check_pair(role, peer)
        first, second = sorted((role, peer))  # both ends derive the same key
        return self._derive(kind, first, second, purpose)

    # -- messages -------------------------------------------------------------------------------

    def seal(self, sender: str, receiver: str, step: str, plaintext: bytes) -> bytes:
        """A frame carrying ``plaintext`` from ``sender`` (hosted here) to ``receiver``."""
        self._check_pair(sender, receiver)
        header = FrameHeader(sender, receiver, step, self.sent.get((sender, receiver), 0))
        key = self._derive(b"channel", sender, receiver)
        encoded = header.encode()
        frame = encoded + seal(key, plaintext, self._associated_data(encoded))
        self.sent[(sender, receiver)] = header.sequence + 1
        return frame

    def open(self, frame: bytes) -> Opened:
        """Check a frame and decrypt it.

        Raises
        ------
        ChannelError
            Naming the problem: malformed, misaddressed (for a role not hosted here), on no
            declared channel, replayed, out of order, or failing authentication.
        """
        header, body_start = read_header(frame)
        what = header.describe()
        if header.receiver not in self.hosted:
            raise ChannelError(
                f"misaddressed message: {what} was delivered to a node hosting "
                f"{sorted(self.hosted)}"
            )
        if frozenset((header.sender, header.receiver)) not in self.pairs:
            raise ChannelError(f"{what} travels on no channel the protocol declares")
        if header.sender not in self.session_keys:
            raise ChannelError(f"{what} comes from a role with no verified session key")
        expected = self.received.get((header.sender, header.receiver), 0)
        if header.sequence < expected:
            raise ChannelError(f"replayed message: {what} was already received")
        if header.sequence > expected:
            raise ChannelError(
                f"out-of-order message: {what} arrived while message {expected} was expected "
                "(a message was dropped or reordered)"
            )
        key = self._derive(b"channel", header.sender, header.receiver)
        try:
            plaintext = open_sealed(
                key,
                memoryview(frame)[body_start:],  # no copy of a large body
                self._associated_data(frame[:body_start]),
                what,
            )
        except ProtocolError as error:
            raise ChannelError(f"tampered message: {error}") from None
        self.received[(header.sender, header.receiver)] = expected + 1
        return Opened(header, plaintext)

    def _associated_data(self, encoded_header: bytes) -> bytes:
        return encode_fields(LABEL, self.digest, self.session, encoded_header)

    # -- shared randomness ----------------------------------------------------------------------

    def shared_generator(self, role: str, peer: str, purpose: str) -> np.random.Generator:
        """A numpy ``Generator`` that ``role`` (hosted here) and ``peer`` both derive.

        Seeded with 256 bits from the pair's key agreement, so nobody else can reproduce it;
        but PCG64 is not a cryptographic generator (its outputs predict later ones): draw
        permutations and scrambling matrices from it, and masks from :meth:`shared_mask`.
        """
        seed = self._shared_key(role, peer, b"generator", purpose)
        return np.random.default_rng(int.from_bytes(seed, "big"))

    def shared_mask(self, role: str, peer: str, purpose: str, count: int) -> np.ndarray:
        """``count`` uint64 words of ChaCha20 keystream that ``role`` and ``peer`` both derive.

        The same purpose gives the same words: use one purpose per mask.
        """
        return expand_mask(self._shared_key(role, peer, b"mask", purpose), count)
