"""An active server against SecAgg+: it substitutes its own keys for a target's neighbours.

The server relays every public key of :mod:`fedfm.secagg`. In ``share_keys`` it hands the target
client, in place of each neighbour's two public keys (share encryption ``c`` and masking ``s``),
public keys of key pairs it drew itself. The target then

* encrypts its shares of its self-mask seed ``b`` and of its masking private key to keys the
  server can open (``t`` of them rebuild ``b``), and
* masks its update with pairwise masks agreed with the server's masking keys, which the server
  can compute too.

In ``collect_masked_input`` the server forwards the target ``t`` or more share ciphertexts it
sealed itself under the substituted encryption keys (the target only checks that they
authenticate), receives the target's masked input ``y``, and strips ``PRG(b)`` and every pairwise
mask: what is left is ``[N q, N]``, the target's quantized update and its weight. The other
clients' view does not matter to the server; it can abandon the round at that point.

:func:`key_substitution_attack` plays that server against clients that follow the protocol
with the key authentication their data owners chose (:class:`~fedfm.secagg.KeyAuthentication`):
in the semi-honest mode (no signatures) the attack recovers the target's update to within one
quantization step; with signed keys the target refuses ``share_keys``, naming the neighbour
whose key is not signed by its pinned identity, and the server gets nothing. The server may
forge in two ways (``forgery``): sign the substituted keys with an identity of its own
(``"own-identity"``: not pinned by the target), or keep the neighbour's real identity and
signature next to the substituted keys (``"replayed-signature"``: the signature does not verify).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from fedfm.errors import ConfigError, InvariantError, ProtocolError
from fedfm.runtime.identity import Identity
from fedfm.secagg import (
    AdvertiseKeysReply,
    ArrayLayout,
    ClientSecAggState,
    ClientUpdate,
    KeyAuthentication,
    MaskedInputReply,
    MaskedInputRequest,
    NeighbourKeys,
    SecAggConfig,
    SecAggServer,
    ShareKeysReply,
    ShareKeysRequest,
    UnmaskReply,
    UnmaskRequest,
    decode_reply,
    decode_request,
    handle,
)
from fedfm.secagg.authentication import sign_keys
from fedfm.secagg.channel import (
    new_private_key,
    open_sealed,
    public_key_of,
    seal,
    share_associated_data,
    share_encryption_key,
)
from fedfm.secagg.masking import pairwise_mask, remove_pairwise_mask, self_mask
from fedfm.secagg.messages import SHARE_PLAINTEXT_BYTES, Reply, Request
from fedfm.secagg.sharing import SHARE_BYTES, combine_secret

Forgery = Literal["own-identity", "replayed-signature"]


@dataclass(frozen=True)
class KeySubstitutionOutcome:
    """What the active server got from the target.

    ``recovered`` is the target's update as the server decoded it (``None`` if the target
    refused), ``recovered_weight`` its number of examples, ``max_error`` the largest difference
    between ``recovered`` and the target's true update clipped to the clipping range, in units
    of one quantization step (below 1 means the update is recovered), and ``refusal`` the
    target's error message when it refused.
    """

    target: int
    recovered: dict[str, np.ndarray] | None
    recovered_weight: int | None
    max_error_steps: float | None
    refusal: str | None

    @property
    def succeeded(self) -> bool:
        return self.max_error_steps is not None and self.max_error_steps < 1.0


def _ask(
    states: dict[int, ClientSecAggState],
    node: int,
    request: Request,
    update: ClientUpdate,
    authentication: KeyAuthentication,
) -> Reply:
    """Deliver ``request`` to ``node`` through its records, as over a transport."""
    reply, states[node] = handle(
        states[node],
        decode_request(*request.to_records()),
        update=update,
        authentication=authentication,
    )
    return decode_reply(*reply.to_records())


def key_substitution_attack(
    config: SecAggConfig,
    updates: Mapping[int, ClientUpdate],
    authentication: Mapping[int, KeyAuthentication],
    *,
    target: int,
    round_id: int = 0,
    forgery: Forgery = "own-identity",
) -> KeySubstitutionOutcome:
    """Run one round as an active server that substitutes keys for ``target``'s neighbours.

    ``updates`` and ``authentication`` are keyed by SecAgg node id; every client follows the
    protocol with its own authentication (its data owner's choice).
    """
    if target not in updates:
        raise ConfigError(f"target {target} is not one of the clients {sorted(updates)}")
    layout = ArrayLayout.of(updates[target].arrays)
    server = SecAggServer(config, layout, round_id=round_id)
    states = {node: ClientSecAggState() for node in updates}
    requests = server.start(sorted(updates))
    advertised = {
        node: _ask(states, node, request, updates[node], authentication[node])
        for node, request in requests.items()
    }
    share_requests = server.on_replies(advertised)
    honest = share_requests[target]
    if not isinstance(honest, ShareKeysRequest):
        raise InvariantError(f"the server asked {type(honest).__name__} after advertise_keys")
    own = advertised[target]
    if not isinstance(own, AdvertiseKeysReply):
        raise InvariantError(f"the target answered {type(own).__name__} to advertise_keys")

    # The substitution: a key pair of the server's for every neighbour of the target.
    impostor = Identity.generate()
    substituted: dict[int, tuple[bytes, bytes]] = {}
    forged = []
    for neighbour in honest.neighbours:
        encryption_key, masking_key = new_private_key(), new_private_key()
        substituted[neighbour.node_id] = (encryption_key, masking_key)
        keys = NeighbourKeys(
            neighbour.node_id, public_key_of(encryption_key), public_key_of(masking_key)
        )
        if forgery == "own-identity":
            signed = sign_keys(
                impostor,
                round_id,
                neighbour.node_id,
                keys.encryption_public_key,
                keys.masking_public_key,
                server.settings,
            )
            keys = replace(keys, identity=signed.identity, signature=signed.signature)
        else:
            keys = replace(keys, identity=neighbour.identity, signature=neighbour.signature)
        forged.append(keys)
    try:
        reply = _ask(
            states,
            target,
            replace(honest, neighbours=tuple(forged)),
            updates[target],
            authentication[target],
        )
    except ProtocolError as error:
        return KeySubstitutionOutcome(target, None, None, None, str(error))
    if not isinstance(reply, ShareKeysReply):
        raise InvariantError(f"the target answered {type(reply).__name__} to share_keys")

    # The target's shares, encrypted to the server's keys: open them and rebuild b.
    seed_shares = []
    for receiver, ciphertext in sorted(reply.ciphertexts.items()):
        key = share_encryption_key(
            substituted[receiver][0], own.encryption_public_key, round_id, target, receiver
        )
        plaintext = open_sealed(
            key, ciphertext, share_associated_data(round_id, target, receiver), "target share"
        )
        seed_shares.append(plaintext[:SHARE_BYTES])
    seed = combine_secret(seed_shares, honest.threshold, "the target's self-mask seed")

    # Shares "from" every neighbour, sealed by the server under the substituted keys.
    inbound = {
        sender: seal(
            share_encryption_key(
                substituted[sender][0], own.encryption_public_key, round_id, sender, target
            ),
            os.urandom(SHARE_PLAINTEXT_BYTES),
            share_associated_data(round_id, sender, target),
        )
        for sender in substituted
    }
    masked = _ask(
        states,
        target,
        MaskedInputRequest(round_id, inbound),
        updates[target],
        authentication[target],
    )
    vector = _masked_input(masked)
    length = server.settings.vector_length
    vector = vector - self_mask(seed, round_id, target, length)
    for peer, (_, masking_key) in substituted.items():
        mask = pairwise_mask(masking_key, own.masking_public_key, round_id, peer, target, length)
        vector = remove_pairwise_mask(vector, mask, target, peer)
    steps = _decoding_error(vector, updates[target], layout, server, config)
    if steps is None:
        return KeySubstitutionOutcome(target, None, None, None, "the unmasked vector is noise")
    weight = int(vector[-1])
    values = server.settings.quantizer.dequantize(vector[:-1] // np.uint64(weight))
    return KeySubstitutionOutcome(target, layout.unflatten(values), weight, steps, None)


# -- false dropouts: what signed keys do not stop ------------------------------------------------
@dataclass(frozen=True)
class FalseDropoutOutcome:
    """An active server that lies in ``unmask`` about which neighbours dropped.

    ``claims_needed`` is ``t * t`` (the masking key of each of the ``t`` neighbours the target
    masked with needs ``t`` holders told it dropped) and ``claims_available`` the largest
    number of such claims the holders accept
    (each refuses to be told more than ``d - t`` of its neighbours dropped) that can go to
    the neighbours that need them (a maximum flow); the attack is feasible only if they meet.
    """

    target: int
    degree: int
    threshold: int
    claims_needed: int
    claims_available: int
    max_error_steps: float | None

    @property
    def succeeded(self) -> bool:
        return self.max_error_steps is not None and self.max_error_steps < 1.0


def _assign_claims(
    graph: Mapping[int, tuple[int, ...]],
    needy: tuple[int, ...],
    threshold: int,
    capacity: Mapping[int, int],
) -> dict[int, list[int]]:
    """For each node in ``needy``, holders (its neighbours) that will be told it dropped: a
    maximum flow from needy nodes (demand ``threshold``) to holders (``capacity[h]`` each)."""
    flow: dict[tuple[int, int], int] = {}  # (needy, holder) -> 0/1
    used = dict.fromkeys(graph, 0)
    got = dict.fromkeys(needy, 0)

    def augment(node: int, seen: set[int]) -> bool:
        # a path needy -> holder (free edge) [-> needy' (used edge) -> holder' ...] to spare room
        for holder in graph[node]:
            if flow.get((node, holder)) or holder in seen:
                continue
            seen.add(holder)
            if used[holder] < capacity[holder]:
                used[holder] += 1
                flow[node, holder] = 1
                return True
            for other in needy:
                if flow.get((other, holder)) and augment(other, seen):
                    flow[other, holder] = 0
                    flow[node, holder] = 1
                    return True
        return False

    for node in needy:
        while got[node] < threshold and augment(node, set()):
            got[node] += 1
    return {node: [h for h in graph[node] if flow.get((node, h))] for node in needy}


def false_dropout_attack(
    config: SecAggConfig,
    updates: Mapping[int, ClientUpdate],
    authentication: Mapping[int, KeyAuthentication],
    *,
    target: int,
    round_id: int = 0,
) -> FalseDropoutOutcome:
    """Lie about dropouts to unmask ``target``, with authentic keys.

    In ``collect_masked_input`` the server forwards the target the share ciphertexts of only
    ``t`` of its neighbours (the set ``S``; the target accepts ``t``), so the target masks with
    those ``t`` pairwise masks only. In ``unmask`` it tells holders of each ``v`` in ``S`` that
    ``v`` dropped (they reveal shares of ``v``'s masking key), within what each holder accepts
    (at most ``d - t`` dropped neighbours, so at least ``t`` survivors), and tells ``t`` of the
    target's neighbours that the target survived (they reveal shares of its self-mask seed).
    With ``t`` shares of each, it strips every mask off the target's input.

    Signing the keys does not help here (the keys are the clients' own); what decides is
    whether the holders' limits leave ``t * t`` "dropped" claims for ``S`` (see
    :class:`FalseDropoutOutcome`).
    """
    layout = ArrayLayout.of(updates[target].arrays)
    server = SecAggServer(config, layout, round_id=round_id)
    states = {node: ClientSecAggState() for node in updates}
    replies: dict[int, Reply] = {}
    requests: Mapping[int, Request] = server.start(sorted(updates))
    chosen: tuple[int, ...] = ()
    while server.stage != "unmask":
        if server.stage == "collect_masked_input":  # only t of the target's neighbours' shares
            honest = requests[target]
            if not isinstance(honest, MaskedInputRequest):
                raise InvariantError(f"the server asked {type(honest).__name__} to mask")
            chosen = tuple(sorted(honest.ciphertexts)[: server.threshold])
            kept = {sender: honest.ciphertexts[sender] for sender in chosen}
            requests = {**requests, target: replace(honest, ciphertexts=kept)}
        replies = {
            node: _ask(states, node, request, updates[node], authentication[node])
            for node, request in requests.items()
        }
        if server.stage == "advertise_keys":
            advertised = {n: r for n, r in replies.items() if isinstance(r, AdvertiseKeysReply)}
        requests = server.on_replies(replies)
    masked = replies[target]
    graph, threshold = server.graph, server.threshold
    degree = len(graph[target])
    # A holder answers only about neighbours whose shares it received, and only if at least t of
    # them survived: it accepts at most (received - t) "dropped" claims.
    received = {node: set(state.received) for node, state in states.items()}
    capacity = {node: max(len(received[node]) - threshold, 0) for node in graph}
    neighbours = graph[target]
    claims = _assign_claims(graph, chosen, threshold, capacity)
    available = sum(len(holders) for holders in claims.values())
    needed = len(chosen) * threshold
    outcome = FalseDropoutOutcome(target, degree, threshold, needed, available, None)
    if available < needed:
        return outcome
    told_dropped: dict[int, set[int]] = {}
    for node, holders in claims.items():
        for holder in holders:
            told_dropped.setdefault(holder, set()).add(node)
    key_shares: dict[int, list[bytes]] = {}
    seed_shares: list[bytes] = []
    for holder in sorted(updates):
        dropped = told_dropped.get(holder, set())
        asks_target = holder in neighbours and len(seed_shares) < threshold
        if not dropped and not asks_target:
            continue
        request = UnmaskRequest(
            round_id, tuple(sorted(received[holder] - dropped)), tuple(sorted(dropped))
        )
        reply = _ask(states, holder, request, updates[holder], authentication[holder])
        if not isinstance(reply, UnmaskReply):
            raise InvariantError(f"node {holder} answered {type(reply).__name__} to unmask")
        for node, share in reply.key_shares.items():
            key_shares.setdefault(node, []).append(share)
        if target in reply.self_mask_shares:
            seed_shares.append(reply.self_mask_shares[target])
    seed = combine_secret(seed_shares, threshold, "the target's self-mask seed")
    length = server.settings.vector_length
    vector = _masked_input(masked)
    vector = vector - self_mask(seed, round_id, target, length)
    for peer in chosen:
        private = combine_secret(key_shares[peer], threshold, f"node {peer}'s masking key")
        mask = pairwise_mask(
            private, advertised[target].masking_public_key, round_id, peer, target, length
        )
        vector = remove_pairwise_mask(vector, mask, target, peer)
    error = _decoding_error(vector, updates[target], layout, server, config)
    return replace(outcome, max_error_steps=error)


def _masked_input(reply: Reply) -> np.ndarray:
    if not isinstance(reply, MaskedInputReply):
        raise InvariantError(f"the target answered {type(reply).__name__} to collect_masked_input")
    return np.asarray(reply.masked_input, dtype=np.uint64)


def _decoding_error(
    vector: np.ndarray,
    update: ClientUpdate,
    layout: ArrayLayout,
    server: SecAggServer,
    config: SecAggConfig,
) -> float | None:
    """How far the decoded ``[N q, N]`` is from the true clipped update, in quantization
    steps; ``None`` if the vector is not such a pair (the masks did not come off)."""
    weight = int(vector[-1])
    if not 1 <= weight <= config.max_weight or np.any(vector[:-1] % np.uint64(weight)):
        return None
    quantizer = server.settings.quantizer
    values = quantizer.dequantize(vector[:-1] // np.uint64(weight))
    truth = layout.flatten(update.arrays).astype(np.float64)
    clipped = np.clip(truth, -quantizer.clipping_range, quantizer.clipping_range)
    return float(np.max(np.abs(values - clipped))) / quantizer.step
