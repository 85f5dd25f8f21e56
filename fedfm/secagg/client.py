"""The client's role: a pure step function from (state, request) to (reply, new state).

The state is a frozen :class:`ClientSecAggState` that round-trips through
``to_records``/``from_records`` as ``(arrays, config)``, so a Flower client can keep it in
``context.state`` and handle every stage in a fresh process. No step mutates its input state,
so a refused request (a :class:`ProtocolError`) leaves the old state usable.

Stages and what the client keeps:

``new`` -> ``advertised`` (``advertise_keys``)
    Two fresh X25519 private keys (``c`` encrypts shares, ``s`` agrees pairwise masks) and the
    32-byte self-mask seed ``b`` from ``os.urandom``. The reply's two public keys are signed by
    the client's long-term identity (unless its data owner chose the semi-honest mode).
``advertised`` -> ``shared`` (``share_keys``)
    Its neighbours' public keys and the threshold ``t``, after checking that every neighbour's
    keys are signed by an identity its data owner pinned (:mod:`fedfm.secagg.authentication`);
    the reply holds one ciphertext per neighbour with that neighbour's Shamir shares of ``b``
    and of ``s``'s private key.
``shared`` -> ``masked`` (``collect_masked_input``)
    The ciphertexts addressed to it (each is authenticated on arrival). The reply is the masked
    input; ``b`` and ``s``'s private key are then dropped from the state (their shares are with
    the neighbours, the client needs neither again).
``masked`` -> ``unmasked`` (``unmask``)
    Which kind of share it revealed for each neighbour; a repeated request may ask again but
    never for the other kind.

What the client sees: its neighbours' public keys and ids, shares of its neighbours' secrets
(fewer than ``t`` of anything, since it holds one share per neighbour), and which neighbours the
server says survived. It never sees another client's input or masked input.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Self

import numpy as np

from fedfm.errors import ConfigError, InvariantError, ProtocolError
from fedfm.secagg.authentication import (
    IDENTITY_BYTES,
    SIGNATURE_BYTES,
    KeyAuthentication,
    check_neighbour_keys,
    sign_keys,
)
from fedfm.secagg.channel import (
    KEY_BYTES,
    new_private_key,
    open_sealed,
    public_key_of,
    seal,
    share_associated_data,
    share_encryption_key,
)
from fedfm.secagg.config import ClientSettings, check_threshold
from fedfm.secagg.masking import add_pairwise_mask, pairwise_mask, self_mask
from fedfm.secagg.messages import (
    CIPHERTEXT_BYTES,
    PREFIX,
    AdvertiseKeysReply,
    AdvertiseKeysRequest,
    MaskedInputReply,
    MaskedInputRequest,
    NeighbourKeys,
    Reply,
    Request,
    ShareKeysReply,
    ShareKeysRequest,
    UnmaskReply,
    UnmaskRequest,
)
from fedfm.secagg.quantization import rounding_generator
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
    read_rows,
    rows_array,
)
from fedfm.secagg.sharing import SHARE_BYTES, split_secret

NEW, ADVERTISED, SHARED, MASKED, UNMASKED = "new", "advertised", "shared", "masked", "unmasked"
CLIENT_STAGES = (NEW, ADVERTISED, SHARED, MASKED, UNMASKED)


@dataclass(frozen=True)
class ClientUpdate:
    """A client's contribution: its arrays (matching the layout) and its number of examples."""

    arrays: Mapping[str, np.ndarray]
    num_examples: int


_STATE_ARRAYS = (
    "node_id",
    "encryption_private_key",
    "masking_private_key",
    "self_mask_seed",
    "neighbour_ids",
    "neighbour_encryption_public_keys",
    "neighbour_masking_public_keys",
    "neighbour_identities",
    "neighbour_signatures",
    "received_sender_ids",
    "received_ciphertexts",
    "revealed_self_mask_share_owners",
    "revealed_key_share_owners",
)


def _key(name: str) -> str:
    return f"{PREFIX}{name}"


@dataclass(frozen=True)
class ClientSecAggState:
    """Everything a client carries between stages (all of it stays on the client).

    ``clipped_values`` is how many values of its update the client clipped to ``[-c, c]`` in
    ``collect_masked_input``: a local diagnostic, never sent.
    """

    stage: str = NEW
    round_id: int = 0
    node_id: int = 0
    settings: ClientSettings | None = None
    encryption_private_key: bytes = b""
    masking_private_key: bytes = b""
    self_mask_seed: bytes = b""
    threshold: int = 0
    neighbours: tuple[NeighbourKeys, ...] = ()
    received: Mapping[int, bytes] = field(default_factory=dict)
    revealed_self_mask_shares: frozenset[int] = frozenset()
    revealed_key_shares: frozenset[int] = frozenset()
    clipped_values: int = 0

    def neighbour(self, node_id: int) -> NeighbourKeys:
        for neighbour in self.neighbours:
            if neighbour.node_id == node_id:
                return neighbour
        raise ProtocolError(f"node {node_id} is not a neighbour of node {self.node_id}")

    def to_records(self) -> tuple[Arrays, Config]:
        """The state as ``(arrays, config)`` for Flower's ``ArrayRecord`` and ``ConfigRecord``."""
        received = sorted(self.received)
        arrays = {
            _key("node_id"): ids_array([self.node_id] if self.node_id else []),
            _key("encryption_private_key"): bytes_array(self.encryption_private_key),
            _key("masking_private_key"): bytes_array(self.masking_private_key),
            _key("self_mask_seed"): bytes_array(self.self_mask_seed),
            _key("neighbour_ids"): ids_array(n.node_id for n in self.neighbours),
            _key("neighbour_encryption_public_keys"): rows_array(
                [n.encryption_public_key for n in self.neighbours], KEY_BYTES
            ),
            _key("neighbour_masking_public_keys"): rows_array(
                [n.masking_public_key for n in self.neighbours], KEY_BYTES
            ),
            _key("neighbour_identities"): rows_array(
                [n.identity for n in self.neighbours], IDENTITY_BYTES
            ),
            _key("neighbour_signatures"): rows_array(
                [n.signature for n in self.neighbours], SIGNATURE_BYTES
            ),
            _key("received_sender_ids"): ids_array(received),
            _key("received_ciphertexts"): rows_array(
                [self.received[i] for i in received], CIPHERTEXT_BYTES
            ),
            _key("revealed_self_mask_share_owners"): ids_array(
                sorted(self.revealed_self_mask_shares)
            ),
            _key("revealed_key_share_owners"): ids_array(sorted(self.revealed_key_shares)),
        }
        config: Config = {
            _key("stage"): self.stage,
            _key("round"): self.round_id,
            _key("threshold"): self.threshold,
            _key("clipped_values"): self.clipped_values,
        }
        if self.settings is not None:
            config |= self.settings.to_config(PREFIX)
        return arrays, config

    @classmethod
    def from_records(
        cls, arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]
    ) -> Self:
        """Rebuild a state from :meth:`to_records`; :class:`ProtocolError` if it is malformed."""
        what = "client secagg state"
        stage = config.get(_key("stage"))
        if stage not in CLIENT_STAGES:
            raise ProtocolError(f"{what}: stage {stage!r} is not one of {list(CLIENT_STAGES)}")
        settings_names = () if stage == NEW else ClientSettings.CONFIG_NAMES
        check_keys(
            arrays,
            config,
            array_keys=[_key(name) for name in _STATE_ARRAYS],
            config_keys=[
                _key(name)
                for name in ("stage", "round", "threshold", "clipped_values", *settings_names)
            ],
            prefix=PREFIX,
            what=what,
        )
        node_ids = read_ids(arrays, _key("node_id"), what)
        if len(node_ids) != (0 if stage == NEW else 1):
            raise ProtocolError(f"{what}: a {stage} state has {len(node_ids)} node ids")
        settings = None if stage == NEW else ClientSettings.from_config(config, PREFIX, what)
        private = {
            name: read_bytes(arrays, _key(name), (0, KEY_BYTES), what)
            for name in ("encryption_private_key", "masking_private_key", "self_mask_seed")
        }
        neighbour_ids = read_ids(arrays, _key("neighbour_ids"), what)
        count = len(neighbour_ids)
        encryption = read_rows(
            arrays, _key("neighbour_encryption_public_keys"), count, KEY_BYTES, what
        )
        masking = read_rows(arrays, _key("neighbour_masking_public_keys"), count, KEY_BYTES, what)
        identities = read_rows(arrays, _key("neighbour_identities"), count, IDENTITY_BYTES, what)
        signatures = read_rows(arrays, _key("neighbour_signatures"), count, SIGNATURE_BYTES, what)
        senders = read_ids(arrays, _key("received_sender_ids"), what)
        ciphertexts = read_rows(
            arrays, _key("received_ciphertexts"), len(senders), CIPHERTEXT_BYTES, what
        )
        return cls(
            stage=stage,
            round_id=read_int(config, _key("round"), what),
            node_id=node_ids[0] if node_ids else 0,
            settings=settings,
            threshold=read_int(config, _key("threshold"), what),
            neighbours=tuple(
                NeighbourKeys(*row)
                for row in zip(
                    neighbour_ids, encryption, masking, identities, signatures, strict=True
                )
            ),
            received=dict(zip(senders, ciphertexts, strict=True)),
            revealed_self_mask_shares=frozenset(
                read_ids(arrays, _key("revealed_self_mask_share_owners"), what)
            ),
            revealed_key_shares=frozenset(
                read_ids(arrays, _key("revealed_key_share_owners"), what)
            ),
            clipped_values=read_int(config, _key("clipped_values"), what),
            **private,
        )


def handle(
    state: ClientSecAggState,
    request: Request,
    *,
    update: ClientUpdate | None = None,
    authentication: KeyAuthentication,
) -> tuple[Reply, ClientSecAggState]:
    """Answer ``request`` from ``state``; ``update`` is needed for ``collect_masked_input`` only.

    ``authentication`` is the data owner's choice of how SecAgg keys are authenticated
    (signed against its pins, or semi-honest); it is a required argument so that no caller
    falls into the unauthenticated mode by omission.

    Raises :class:`ProtocolError` when the request does not fit the state or breaks a rule of
    the protocol (:class:`~fedfm.secagg.authentication.KeyAuthenticationError` when a
    neighbour's keys are not signed by its pinned identity); the old state is then unchanged
    and still usable.
    """
    match request:
        case AdvertiseKeysRequest():
            return advertise_keys(request, authentication)
        case ShareKeysRequest():
            return share_keys(state, request, authentication)
        case MaskedInputRequest():
            if update is None:
                raise ProtocolError("collect_masked_input needs the client's update")
            return collect_masked_input(state, request, update)
        case UnmaskRequest():
            return unmask(state, request)
    raise ProtocolError(f"not a secagg request: {type(request).__name__}")


def _expect(state: ClientSecAggState, request: Request, stages: tuple[str, ...]) -> None:
    if state.stage not in stages:
        raise ProtocolError(f"a client in stage {state.stage!r} cannot answer {request.stage}")
    if request.round_id != state.round_id:
        raise ProtocolError(
            f"{request.stage} request for round {request.round_id}, but the client is in round "
            f"{state.round_id}"
        )


def advertise_keys(
    request: AdvertiseKeysRequest, authentication: KeyAuthentication
) -> tuple[AdvertiseKeysReply, ClientSecAggState]:
    """Stage 1: fresh key pairs and self-mask seed, the public keys signed by the client's
    identity (for this round, its node id and the settings). Always allowed: it starts a new
    round."""
    encryption_private_key, masking_private_key = new_private_key(), new_private_key()
    state = ClientSecAggState(
        stage=ADVERTISED,
        round_id=request.round_id,
        node_id=request.node_id,
        settings=request.settings,
        encryption_private_key=encryption_private_key,
        masking_private_key=masking_private_key,
        self_mask_seed=os.urandom(KEY_BYTES),
    )
    encryption_public_key = public_key_of(encryption_private_key)
    masking_public_key = public_key_of(masking_private_key)
    signed = sign_keys(
        authentication.signer,
        request.round_id,
        request.node_id,
        encryption_public_key,
        masking_public_key,
        request.settings,
    )
    reply = AdvertiseKeysReply(
        request.round_id,
        encryption_public_key,
        masking_public_key,
        signed.identity,
        signed.signature,
    )
    return reply, state


def share_keys(
    state: ClientSecAggState, request: ShareKeysRequest, authentication: KeyAuthentication
) -> tuple[ShareKeysReply, ClientSecAggState]:
    """Stage 2: Shamir-share ``b`` and ``s``'s private key among the neighbours, encrypted.

    First, unless ``authentication`` is semi-honest, every neighbour's keys must be signed by
    a distinct pinned identity for this round, that neighbour's node id and these settings;
    otherwise nothing is shared (:class:`~fedfm.secagg.authentication.KeyAuthenticationError`
    naming the neighbour).
    """
    _expect(state, request, (ADVERTISED,))
    if state.settings is None:
        raise InvariantError(f"SecAgg state {state.stage!r} has no settings (set past NEW)")
    neighbours = tuple(sorted(request.neighbours, key=lambda n: n.node_id))
    ids = [n.node_id for n in neighbours]
    if state.node_id in ids:
        raise ProtocolError(f"node {state.node_id} is listed as its own neighbour")
    if len(set(ids)) != len(ids):
        raise ProtocolError("share_keys request repeats a neighbour")
    try:
        check_threshold(request.threshold, len(neighbours))
    except ConfigError as error:
        raise ProtocolError(f"share_keys request: {error}") from error
    keys = [public_key_of(state.encryption_private_key), public_key_of(state.masking_private_key)]
    keys += [key for n in neighbours for key in (n.encryption_public_key, n.masking_public_key)]
    if len(set(keys)) != len(keys):
        # Bonawitz et al.: distinct keys, else a server could make two parties one.
        raise ProtocolError("share_keys request: public keys are not all distinct")
    check_neighbour_keys(
        authentication,
        node_id=state.node_id,
        round_id=state.round_id,
        settings=state.settings,
        neighbours=neighbours,
    )
    seed_shares = split_secret(state.self_mask_seed, request.threshold, len(neighbours))
    key_shares = split_secret(state.masking_private_key, request.threshold, len(neighbours))
    ciphertexts = {}
    for neighbour, seed_share, key_share in zip(neighbours, seed_shares, key_shares, strict=True):
        key = share_encryption_key(
            state.encryption_private_key,
            neighbour.encryption_public_key,
            state.round_id,
            state.node_id,
            neighbour.node_id,
        )
        associated = share_associated_data(state.round_id, state.node_id, neighbour.node_id)
        ciphertexts[neighbour.node_id] = seal(key, seed_share + key_share, associated)
    new_state = replace(state, stage=SHARED, threshold=request.threshold, neighbours=neighbours)
    return ShareKeysReply(state.round_id, ciphertexts), new_state


def _open_shares(state: ClientSecAggState, sender: int, ciphertext: bytes) -> tuple[bytes, bytes]:
    """The (b-share, s_sk-share) pair ``sender`` encrypted for this client."""
    key = share_encryption_key(
        state.encryption_private_key,
        state.neighbour(sender).encryption_public_key,
        state.round_id,
        sender,
        state.node_id,
    )
    plaintext = open_sealed(
        key,
        ciphertext,
        share_associated_data(state.round_id, sender, state.node_id),
        f"share ciphertext from node {sender} to node {state.node_id}",
    )
    return plaintext[:SHARE_BYTES], plaintext[SHARE_BYTES:]


def collect_masked_input(
    state: ClientSecAggState, request: MaskedInputRequest, update: ClientUpdate
) -> tuple[MaskedInputReply, ClientSecAggState]:
    """Stage 3: ``y = [N q, N] + PRG(b) + sum_v +-PRG(s_uv) mod 2**64``.

    ``v`` runs over the neighbours whose share ciphertexts arrived (those that completed
    ``share_keys``). The number of clipped values goes into the new state.
    """
    _expect(state, request, (SHARED,))
    if state.settings is None:
        raise InvariantError(f"SecAgg state {state.stage!r} has no settings (set past NEW)")
    strangers = sorted(set(request.ciphertexts) - {n.node_id for n in state.neighbours})
    if strangers:
        raise ProtocolError(f"shares arrived from nodes {strangers}, which are not neighbours")
    if len(request.ciphertexts) < state.threshold:
        raise ProtocolError(
            f"only {len(request.ciphertexts)} of node {state.node_id}'s "
            f"{len(state.neighbours)} neighbours shared keys, fewer than the threshold "
            f"{state.threshold}: its own secrets could not be rebuilt"
        )
    for sender, ciphertext in request.ciphertexts.items():
        _open_shares(state, sender, ciphertext)  # reject tampering before masking with sender
    weight = update.num_examples
    if isinstance(weight, bool) or not isinstance(weight, int | np.integer):
        raise ConfigError(f"num_examples must be an int, got {weight!r}")
    if not 1 <= weight <= state.settings.max_weight:
        raise ConfigError(
            f"num_examples={weight} is outside 1..max_weight={state.settings.max_weight}"
        )
    values = state.settings.layout.flatten(update.arrays)
    if not np.all(np.isfinite(values)):
        bad = int(np.count_nonzero(~np.isfinite(values)))
        raise ProtocolError(f"the update holds {bad} non-finite values; refusing to mask it")
    quantized, clipped = state.settings.quantizer.quantize(values, rounding_generator())
    length = state.settings.vector_length
    vector = np.empty(length, dtype=np.uint64)
    vector[:-1] = quantized * np.uint64(weight)  # cannot wrap: ClientSettings checks the bound
    vector[-1] = weight
    vector += self_mask(state.self_mask_seed, state.round_id, state.node_id, length)
    for sender in sorted(request.ciphertexts):
        mask = pairwise_mask(
            state.masking_private_key,
            state.neighbour(sender).masking_public_key,
            state.round_id,
            state.node_id,
            sender,
            length,
        )
        vector = add_pairwise_mask(vector, mask, state.node_id, sender)
    new_state = replace(
        state,
        stage=MASKED,
        received=dict(request.ciphertexts),
        masking_private_key=b"",
        self_mask_seed=b"",
        clipped_values=clipped,
    )
    return MaskedInputReply(state.round_id, vector), new_state


def unmask(
    state: ClientSecAggState, request: UnmaskRequest
) -> tuple[UnmaskReply, ClientSecAggState]:
    """Stage 4: b-shares of neighbours that survived, s_sk-shares of those that dropped.

    Refuses to reveal both kinds for one node (in this request or across requests), to answer
    for nodes that are not neighbours or sent no shares, and to answer at all when fewer than
    ``t`` neighbours survived.
    """
    _expect(state, request, (MASKED, UNMASKED))
    survivors, dropped = set(request.survivors), set(request.dropped)
    if both := sorted(survivors & dropped):
        raise ProtocolError(
            f"unmask request lists nodes {both} as both survived and dropped: revealing both "
            "shares of a node would expose its input"
        )
    if state.node_id in survivors | dropped:
        raise ProtocolError(f"unmask request asks node {state.node_id} about itself")
    neighbour_ids = {n.node_id for n in state.neighbours}
    if strangers := sorted((survivors | dropped) - neighbour_ids):
        raise ProtocolError(f"unmask request asks about nodes {strangers}, not neighbours")
    if silent := sorted((survivors | dropped) - set(state.received)):
        raise ProtocolError(f"unmask request asks about nodes {silent}, which sent no shares")
    if len(survivors) < state.threshold:
        raise ProtocolError(
            f"only {len(survivors)} of node {state.node_id}'s neighbours survived, fewer than "
            f"the threshold {state.threshold}"
        )
    if switched := sorted(
        (survivors & state.revealed_key_shares) | (dropped & state.revealed_self_mask_shares)
    ):
        raise ProtocolError(
            f"unmask request asks for the other kind of share of nodes {switched} than "
            "revealed before: revealing both would expose their inputs"
        )
    self_mask_shares, key_shares = {}, {}
    for node in sorted(survivors | dropped):
        seed_share, key_share = _open_shares(state, node, state.received[node])
        if node in survivors:
            self_mask_shares[node] = seed_share
        else:
            key_shares[node] = key_share
    new_state = replace(
        state,
        stage=UNMASKED,
        revealed_self_mask_shares=state.revealed_self_mask_shares | survivors,
        revealed_key_shares=state.revealed_key_shares | dropped,
    )
    return UnmaskReply(state.round_id, self_mask_shares, key_shares), new_state
