"""The four stages' requests and replies, and their ``(arrays, config)`` encoding.

Every key starts with ``secagg.`` so a message can also carry other content (e.g. the global
model in the same Flower message); decoding ignores keys without the prefix and rejects unknown
ones with it. Node ids travel as ``uint64`` vectors in increasing order, fixed-width byte strings
as ``uint8`` matrices with one row per node, in the same order as the ids next to them.

=====================  ========================================  ==============================
stage                  request (server to client)                reply (client to server)
=====================  ========================================  ==============================
advertise_keys         ``node_id`` (1), settings in config:      ``encryption_public_key``
                       ``clipping_range``, ``quantization_bits``, (32), ``masking_public_key``
                       ``max_weight``, ``layout`` (JSON)          (32), ``identity_public_key``
                                                                  (32), ``signature`` (64)
share_keys             ``neighbour_ids`` (d), ``threshold``,      ``receiver_ids`` (d),
                       ``encryption_public_keys`` (d, 32),        ``ciphertexts`` (d, 132)
                       ``masking_public_keys`` (d, 32),
                       ``identity_public_keys`` (d, 32),
                       ``signatures`` (d, 64)
collect_masked_input   ``sender_ids`` (m), ``ciphertexts``        ``masked_input`` (L + 1,
                       (m, 132): the shares addressed to it       uint64)
unmask                 ``survivor_ids``, ``dropped_ids``          ``self_mask_share_owners``,
                                                                  ``self_mask_shares`` (a, 52),
                                                                  ``key_share_owners``,
                                                                  ``key_shares`` (b, 52)
=====================  ========================================  ==============================

Every message also has ``secagg.stage`` (str) and ``secagg.round`` (int) in its config.

The identity and signature are the client's Ed25519 identity key and its signature on the two
public keys for this round, node id and settings (:mod:`fedfm.secagg.authentication`); a client
in the semi-honest mode sends zeros there, and the server relays them unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol, Self

import numpy as np

from fedfm.errors import ProtocolError
from fedfm.secagg.authentication import (
    IDENTITY_BYTES,
    NO_IDENTITY,
    NO_SIGNATURE,
    SIGNATURE_BYTES,
)
from fedfm.secagg.channel import KEY_BYTES, NONCE_BYTES, TAG_BYTES
from fedfm.secagg.config import ClientSettings
from fedfm.secagg.records import (
    Arrays,
    Config,
    ConfigValue,
    bytes_array,
    check_keys,
    ids_array,
    read_bytes,
    read_ids,
    read_int,
    read_node_id,
    read_rows,
    read_uint64_vector,
    rows_array,
)
from fedfm.secagg.sharing import SHARE_BYTES

PREFIX = "secagg."
STAGE_KEY = f"{PREFIX}stage"
ROUND_KEY = f"{PREFIX}round"

ADVERTISE_KEYS = "advertise_keys"
SHARE_KEYS = "share_keys"
COLLECT_MASKED_INPUT = "collect_masked_input"
UNMASK = "unmask"
STAGES = (ADVERTISE_KEYS, SHARE_KEYS, COLLECT_MASKED_INPUT, UNMASK)

# A share ciphertext holds the b-share and the s_sk-share for one neighbour.
SHARE_PLAINTEXT_BYTES = 2 * SHARE_BYTES
CIPHERTEXT_BYTES = NONCE_BYTES + SHARE_PLAINTEXT_BYTES + TAG_BYTES

ArrayRows = Mapping[int, bytes]


def _key(name: str) -> str:
    return f"{PREFIX}{name}"


def stage_of(config: Mapping[str, ConfigValue]) -> str:
    """The stage a message belongs to; :class:`ProtocolError` if it names none."""
    stage = config.get(STAGE_KEY)
    if stage not in STAGES:
        raise ProtocolError(f"{STAGE_KEY}={stage!r} is not one of {list(STAGES)}")
    return str(stage)


class _MessageKind(Protocol):
    """What every message class says of itself: its stage and direction."""

    stage: ClassVar[str]
    direction: ClassVar[str]


def _header(
    arrays: Mapping[str, np.ndarray],
    config: Mapping[str, ConfigValue],
    message: type[_MessageKind],
    array_names: tuple[str, ...],
    config_names: tuple[str, ...] = (),
) -> int:
    """Check the stage and the key set of a message; returns its round."""
    what = f"{message.stage} {message.direction}"
    if stage_of(config) != message.stage:
        raise ProtocolError(f"expected a {what}, got a {stage_of(config)} message")
    check_keys(
        arrays,
        config,
        array_keys=[_key(name) for name in array_names],
        config_keys=[STAGE_KEY, ROUND_KEY, *(_key(name) for name in config_names)],
        prefix=PREFIX,
        what=what,
    )
    return read_int(config, ROUND_KEY, what)


def _base_config(stage: str, round_id: int) -> Config:
    return {STAGE_KEY: stage, ROUND_KEY: round_id}


def _rows_by_id(ids_name: str, rows_name: str, rows: ArrayRows, width: int) -> Arrays:
    ordered = sorted(rows)
    return {
        _key(ids_name): ids_array(ordered),
        _key(rows_name): rows_array([rows[i] for i in ordered], width),
    }


def _read_rows_by_id(
    arrays: Mapping[str, np.ndarray], ids_name: str, rows_name: str, width: int, what: str
) -> dict[int, bytes]:
    ids = read_ids(arrays, _key(ids_name), what)
    rows = read_rows(arrays, _key(rows_name), len(ids), width, what)
    return dict(zip(ids, rows, strict=True))


@dataclass(frozen=True)
class AdvertiseKeysRequest:
    """Stage 1, server to client: the client's node id and how to encode its update."""

    stage: ClassVar[str] = ADVERTISE_KEYS
    direction: ClassVar[str] = "request"
    round_id: int
    node_id: int
    settings: ClientSettings

    def to_records(self) -> tuple[Arrays, Config]:
        config = _base_config(self.stage, self.round_id) | self.settings.to_config(PREFIX)
        return {_key("node_id"): ids_array([self.node_id])}, config

    @classmethod
    def from_records(
        cls, arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]
    ) -> Self:
        what = f"{cls.stage} {cls.direction}"
        round_id = _header(arrays, config, cls, ("node_id",), ClientSettings.CONFIG_NAMES)
        settings = ClientSettings.from_config(config, PREFIX, what)
        return cls(round_id, read_node_id(arrays, _key("node_id"), what), settings)


@dataclass(frozen=True)
class AdvertiseKeysReply:
    """Stage 1, client to server: the public keys for share encryption (c) and masks (s).

    ``identity`` and ``signature``: the client's identity key and its signature on both keys
    (zeros from a semi-honest client that does not sign).
    """

    stage: ClassVar[str] = ADVERTISE_KEYS
    direction: ClassVar[str] = "reply"
    round_id: int
    encryption_public_key: bytes
    masking_public_key: bytes
    identity: bytes = NO_IDENTITY
    signature: bytes = NO_SIGNATURE

    def to_records(self) -> tuple[Arrays, Config]:
        arrays = {
            _key("encryption_public_key"): bytes_array(self.encryption_public_key),
            _key("masking_public_key"): bytes_array(self.masking_public_key),
            _key("identity_public_key"): bytes_array(self.identity),
            _key("signature"): bytes_array(self.signature),
        }
        return arrays, _base_config(self.stage, self.round_id)

    @classmethod
    def from_records(
        cls, arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]
    ) -> Self:
        what = f"{cls.stage} {cls.direction}"
        names = ("encryption_public_key", "masking_public_key")
        round_id = _header(arrays, config, cls, (*names, "identity_public_key", "signature"))
        encryption, masking = (read_bytes(arrays, _key(name), (KEY_BYTES,), what) for name in names)
        identity = read_bytes(arrays, _key("identity_public_key"), (IDENTITY_BYTES,), what)
        signature = read_bytes(arrays, _key("signature"), (SIGNATURE_BYTES,), what)
        return cls(round_id, encryption, masking, identity, signature)


@dataclass(frozen=True)
class NeighbourKeys:
    """A neighbour's node id, advertised public keys, identity key and signature on them."""

    node_id: int
    encryption_public_key: bytes
    masking_public_key: bytes
    identity: bytes = NO_IDENTITY
    signature: bytes = NO_SIGNATURE


@dataclass(frozen=True)
class ShareKeysRequest:
    """Stage 2, server to client: its neighbours (by increasing id) and the threshold."""

    stage: ClassVar[str] = SHARE_KEYS
    direction: ClassVar[str] = "request"
    round_id: int
    threshold: int
    neighbours: tuple[NeighbourKeys, ...]

    def to_records(self) -> tuple[Arrays, Config]:
        neighbours = sorted(self.neighbours, key=lambda n: n.node_id)
        arrays = {
            _key("neighbour_ids"): ids_array(n.node_id for n in neighbours),
            _key("encryption_public_keys"): rows_array(
                [n.encryption_public_key for n in neighbours], KEY_BYTES
            ),
            _key("masking_public_keys"): rows_array(
                [n.masking_public_key for n in neighbours], KEY_BYTES
            ),
            _key("identity_public_keys"): rows_array(
                [n.identity for n in neighbours], IDENTITY_BYTES
            ),
            _key("signatures"): rows_array([n.signature for n in neighbours], SIGNATURE_BYTES),
        }
        config = _base_config(self.stage, self.round_id)
        config[_key("threshold")] = self.threshold
        return arrays, config

    @classmethod
    def from_records(
        cls, arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]
    ) -> Self:
        what = f"{cls.stage} {cls.direction}"
        names = (
            "neighbour_ids",
            "encryption_public_keys",
            "masking_public_keys",
            "identity_public_keys",
            "signatures",
        )
        round_id = _header(arrays, config, cls, names, ("threshold",))
        ids = read_ids(arrays, _key("neighbour_ids"), what)
        count = len(ids)
        encryption = read_rows(arrays, _key("encryption_public_keys"), count, KEY_BYTES, what)
        masking = read_rows(arrays, _key("masking_public_keys"), count, KEY_BYTES, what)
        identities = read_rows(arrays, _key("identity_public_keys"), count, IDENTITY_BYTES, what)
        signatures = read_rows(arrays, _key("signatures"), count, SIGNATURE_BYTES, what)
        neighbours = tuple(
            NeighbourKeys(*fields)
            for fields in zip(ids, encryption, masking, identities, signatures, strict=True)
        )
        return cls(round_id, read_int(config, _key("threshold"), what, minimum=1), neighbours)


@dataclass(frozen=True)
class _ShareCiphertexts:
    """Share ciphertexts by the id of the node at the other end (``ids_name`` says which)."""

    stage: ClassVar[str]
    direction: ClassVar[str]
    ids_name: ClassVar[str]
    round_id: int
    ciphertexts: ArrayRows

    def to_records(self) -> tuple[Arrays, Config]:
        arrays = _rows_by_id(self.ids_name, "ciphertexts", self.ciphertexts, CIPHERTEXT_BYTES)
        return arrays, _base_config(self.stage, self.round_id)

    @classmethod
    def from_records(
        cls, arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]
    ) -> Self:
        what = f"{cls.stage} {cls.direction}"
        round_id = _header(arrays, config, cls, (cls.ids_name, "ciphertexts"))
        rows = _read_rows_by_id(arrays, cls.ids_name, "ciphertexts", CIPHERTEXT_BYTES, what)
        return cls(round_id, rows)


@dataclass(frozen=True)
class ShareKeysReply(_ShareCiphertexts):
    """Stage 2, client to server: one share ciphertext per neighbour (receiver id to bytes)."""

    stage: ClassVar[str] = SHARE_KEYS
    direction: ClassVar[str] = "reply"
    ids_name: ClassVar[str] = "receiver_ids"


@dataclass(frozen=True)
class MaskedInputRequest(_ShareCiphertexts):
    """Stage 3, server to client: the share ciphertexts addressed to it (sender id to bytes).

    The senders are the neighbours that completed ``share_keys``; the client masks with exactly
    these.
    """

    stage: ClassVar[str] = COLLECT_MASKED_INPUT
    direction: ClassVar[str] = "request"
    ids_name: ClassVar[str] = "sender_ids"


@dataclass(frozen=True)
class MaskedInputReply:
    """Stage 3, client to server: ``y = [N q, N] + PRG(b) + sum of signed PRG(s_uv) mod 2**64``."""

    stage: ClassVar[str] = COLLECT_MASKED_INPUT
    direction: ClassVar[str] = "reply"
    round_id: int
    masked_input: np.ndarray

    def to_records(self) -> tuple[Arrays, Config]:
        arrays = {_key("masked_input"): np.asarray(self.masked_input, dtype=np.uint64)}
        return arrays, _base_config(self.stage, self.round_id)

    @classmethod
    def from_records(
        cls, arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]
    ) -> Self:
        what = f"{cls.stage} {cls.direction}"
        round_id = _header(arrays, config, cls, ("masked_input",))
        return cls(round_id, read_uint64_vector(arrays, _key("masked_input"), what))


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 4, server to client: which of its neighbours sent a masked input and which not."""

    stage: ClassVar[str] = UNMASK
    direction: ClassVar[str] = "request"
    round_id: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]

    def to_records(self) -> tuple[Arrays, Config]:
        arrays = {
            _key("survivor_ids"): ids_array(sorted(self.survivors)),
            _key("dropped_ids"): ids_array(sorted(self.dropped)),
        }
        return arrays, _base_config(self.stage, self.round_id)

    @classmethod
    def from_records(
        cls, arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]
    ) -> Self:
        what = f"{cls.stage} {cls.direction}"
        round_id = _header(arrays, config, cls, ("survivor_ids", "dropped_ids"))
        survivors = read_ids(arrays, _key("survivor_ids"), what)
        return cls(round_id, survivors, read_ids(arrays, _key("dropped_ids"), what))


@dataclass(frozen=True)
class UnmaskReply:
    """Stage 4, client to server: b-shares of survivors and s_sk-shares of dropped neighbours."""

    stage: ClassVar[str] = UNMASK
    direction: ClassVar[str] = "reply"
    round_id: int
    self_mask_shares: ArrayRows
    key_shares: ArrayRows

    def to_records(self) -> tuple[Arrays, Config]:
        arrays = _rows_by_id(
            "self_mask_share_owners", "self_mask_shares", self.self_mask_shares, SHARE_BYTES
        )
        arrays |= _rows_by_id("key_share_owners", "key_shares", self.key_shares, SHARE_BYTES)
        return arrays, _base_config(self.stage, self.round_id)

    @classmethod
    def from_records(
        cls, arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]
    ) -> Self:
        what = f"{cls.stage} {cls.direction}"
        names = ("self_mask_share_owners", "self_mask_shares", "key_share_owners", "key_shares")
        round_id = _header(arrays, config, cls, names)
        self_mask_shares = _read_rows_by_id(
            arrays, "self_mask_share_owners", "self_mask_shares", SHARE_BYTES, what
        )
        key_shares = _read_rows_by_id(arrays, "key_share_owners", "key_shares", SHARE_BYTES, what)
        return cls(round_id, self_mask_shares, key_shares)


Request = AdvertiseKeysRequest | ShareKeysRequest | MaskedInputRequest | UnmaskRequest
Reply = AdvertiseKeysReply | ShareKeysReply | MaskedInputReply | UnmaskReply
_REQUESTS: dict[str, type[Request]] = {
    m.stage: m for m in (AdvertiseKeysRequest, ShareKeysRequest, MaskedInputRequest, UnmaskRequest)
}
_REPLIES: dict[str, type[Reply]] = {
    m.stage: m for m in (AdvertiseKeysReply, ShareKeysReply, MaskedInputReply, UnmaskReply)
}


def decode_request(arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]) -> Request:
    """The request a server sent, validated; :class:`ProtocolError` naming what is wrong."""
    return _REQUESTS[stage_of(config)].from_records(arrays, config)


def decode_reply(arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]) -> Reply:
    """The reply a client sent, validated; :class:`ProtocolError` naming what is wrong."""
    return _REPLIES[stage_of(config)].from_records(arrays, config)
