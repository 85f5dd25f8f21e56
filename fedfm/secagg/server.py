"""The server's role: drives the four stages and unmasks the sum.

:class:`SecAggServer` is a plain in-memory object for one round:
``start(node_ids)`` gives the ``advertise_keys`` requests; each ``on_replies(replies)`` takes
the replies of the current stage (a node missing from them has dropped and stays dropped) and
gives the next stage's requests, until ``unmask``'s replies yield :meth:`result`.

A reply that is malformed for its stage (wrong round, wrong neighbours, wrong length, a share
with the wrong index) counts as that node dropping, with the reason kept in ``dropouts``.
When the round can no longer finish (fewer than ``min_clients`` remain, or some node's secret
cannot get ``t`` shares) the server raises :class:`ProtocolError` saying which node and how many
shares it needed and got, and refuses further calls.

Who is included. Writing U1..U4 for the nodes that answered each stage: the aggregate covers
exactly U3, the nodes that sent a masked input, including those that dropped afterwards (their
self-masks are rebuilt from their neighbours' shares). For nodes in U2 - U3 the server rebuilds
the masking private key and removes their pairwise masks from their surviving neighbours'
inputs. It never asks for both kinds of share of one node: survivors (U3) only ever get their
self-mask seed rebuilt, dropped nodes (U2 - U3) only their masking key.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.secagg.authentication import NO_IDENTITY, signature_is_valid
from fedfm.secagg.channel import KEY_BYTES, public_key_of
from fedfm.secagg.config import SecAggConfig
from fedfm.secagg.graph import Graph, random_neighbour_graph
from fedfm.secagg.layout import ArrayLayout
from fedfm.secagg.masking import pairwise_mask, remove_pairwise_mask, self_mask
from fedfm.secagg.messages import (
    ADVERTISE_KEYS,
    CIPHERTEXT_BYTES,
    COLLECT_MASKED_INPUT,
    SHARE_KEYS,
    UNMASK,
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
from fedfm.secagg.records import MAX_CONFIG_INT, check_node_id
from fedfm.secagg.sharing import SHARE_BYTES, combine_secret, share_index

IDLE, DONE, FAILED = "idle", "done", "failed"
_REPLY_TYPES: dict[str, type] = {
    ADVERTISE_KEYS: AdvertiseKeysReply,
    SHARE_KEYS: ShareKeysReply,
    COLLECT_MASKED_INPUT: MaskedInputReply,
    UNMASK: UnmaskReply,
}


@dataclass(frozen=True)
class SecAggResult:
    """The unmasked round.

    ``arrays`` is the weighted average ``sum_k N_k x_k / sum_k N_k`` over ``included`` (float32,
    the layout's names and shapes), within one quantization step per value of the average of the
    clipped inputs; ``total_weight`` is ``sum_k N_k``; ``dropouts`` says why each other node is
    missing.
    """

    arrays: dict[str, np.ndarray]
    total_weight: int
    included: frozenset[int]
    dropouts: Mapping[int, str]


class SecAggServer:
    """One round of SecAgg+ on the server (it follows the protocol).

    It relays each client's identity key and signature with its public keys; the clients check
    them against their own pins, so a server that deviates cannot substitute keys.
    """

    def __init__(self, config: SecAggConfig, layout: ArrayLayout, *, round_id: int = 0) -> None:
        if isinstance(round_id, bool) or not isinstance(round_id, int):
            raise ConfigError(f"round_id must be an int, got {round_id!r}")
        if not 0 <= round_id <= MAX_CONFIG_INT:
            raise ConfigError(f"round_id must be in 0..2**63-1, got {round_id}")
        self.config = config
        self.settings = config.client_settings(layout)
        self.round_id = round_id
        self.dropouts: dict[int, str] = {}
        self._stage = IDLE
        self._asked: dict[int, Request] = {}
        self._public_keys: dict[int, AdvertiseKeysReply] = {}
        self._graph: Graph = {}
        self._threshold = 0
        self._shared: set[int] = set()
        self._ciphertexts: dict[tuple[int, int], bytes] = {}  # (sender, receiver)
        self._masked_inputs: dict[int, np.ndarray] = {}
        self._result: SecAggResult | None = None

    @property
    def stage(self) -> str:
        """The stage whose replies the server awaits, or ``idle``, ``done``, ``failed``."""
        return self._stage

    @property
    def graph(self) -> Graph:
        """Each participant's neighbours (increasing ids), drawn after ``advertise_keys``."""
        return dict(self._graph)

    @property
    def threshold(self) -> int:
        """Shares needed to rebuild a secret (0 before the graph is drawn)."""
        return self._threshold

    # -- entry points ------------------------------------------------------------------------
    def start(self, node_ids: Collection[int]) -> dict[int, AdvertiseKeysRequest]:
        """The ``advertise_keys`` request for every participant (Flower node ids)."""
        if self._stage != IDLE:
            raise ProtocolError(f"this round already started (stage {self._stage!r})")
        try:
            ids = sorted(check_node_id(node_id, "start") for node_id in node_ids)
        except ProtocolError as error:
            raise ConfigError(str(error)) from error
        if len(set(ids)) != len(ids):
            raise ConfigError("start got repeated node ids")
        if len(ids) < self.config.min_clients:
            raise ConfigError(
                f"start got {len(ids)} node ids, fewer than min_clients={self.config.min_clients}"
            )
        self.config.check_capacity(len(ids))
        self.config.round_parameters(len(ids))
        requests = {node: AdvertiseKeysRequest(self.round_id, node, self.settings) for node in ids}
        self._advance(ADVERTISE_KEYS, requests)
        return requests

    def on_replies(self, replies: Mapping[int, Reply]) -> dict[int, Request]:
        """Take the current stage's replies; returns the next requests (none after ``unmask``).

        A node asked in this stage but missing from ``replies`` has dropped.
        """
        stage = self._stage
        if stage not in _REPLY_TYPES:
            raise ProtocolError(f"the server awaits no replies (stage {stage!r})")
        if strangers := sorted(set(replies) - set(self._asked)):
            raise ProtocolError(f"replies from nodes {strangers}, which were not asked in {stage}")
        valid = {}
        for node in sorted(self._asked):
            if node not in replies:
                self.dropouts[node] = f"no reply to {stage}"
            elif problem := self._problem(node, replies[node]):
                self.dropouts[node] = f"invalid {stage} reply: {problem}"
            else:
                valid[node] = replies[node]
        handlers = {
            ADVERTISE_KEYS: self._after_advertise_keys,
            SHARE_KEYS: self._after_share_keys,
            COLLECT_MASKED_INPUT: self._after_masked_input,
            UNMASK: self._after_unmask,
        }
        try:
            return handlers[stage](valid)
        except ProtocolError:
            self._stage = FAILED
            raise

    def result(self) -> SecAggResult:
        """The unmasked aggregate, once ``unmask``'s replies are in."""
        if self._result is None:
            raise ProtocolError(f"the round has no result (stage {self._stage!r})")
        return self._result

    # -- bookkeeping -------------------------------------------------------------------------
    def _advance(self, stage: str, requests: Mapping[int, Request]) -> dict[int, Request]:
        self._stage, self._asked = stage, dict(requests)
        return dict(requests)

    def _require_enough(self, nodes: Collection[int], stage: str) -> None:
        if len(nodes) < self.config.min_clients:
            raise ProtocolError(
                f"only {len(nodes)} clients remain after {stage}, fewer than min_clients="
                f"{self.config.min_clients} ({len(self.dropouts)} dropped, reasons in dropouts)"
            )

    def _problem(self, node: int, reply: Reply) -> str | None:
        """Why ``reply`` is unusable for the current stage, or ``None``."""
        if not isinstance(reply, _REPLY_TYPES[self._stage]):
            return f"got a {type(reply).__name__}"
        if reply.round_id != self.round_id:
            return f"round {reply.round_id}, expected {self.round_id}"
        match reply:
            case AdvertiseKeysReply():
                if {len(reply.encryption_public_key), len(reply.masking_public_key)} != {KEY_BYTES}:
                    return f"public keys must be {KEY_BYTES} bytes"
                # The server cannot know which identities the clients pinned (only they can
                # check that); it drops a client whose signature is broken outright, so that
                # one such client does not make all its neighbours refuse the round.
                if reply.identity != NO_IDENTITY and not signature_is_valid(
                    reply.identity,
                    reply.signature,
                    self.round_id,
                    node,
                    reply.encryption_public_key,
                    reply.masking_public_key,
                    self.settings,
                ):
                    return "the signature on its keys does not verify under its identity key"
            case ShareKeysReply():
                if set(reply.ciphertexts) != set(self._graph[node]):
                    return "ciphertexts are not addressed to exactly its neighbours"
                if any(len(c) != CIPHERTEXT_BYTES for c in reply.ciphertexts.values()):
                    return f"ciphertexts must be {CIPHERTEXT_BYTES} bytes"
            case MaskedInputReply():
                vector = reply.masked_input
                if vector.dtype != np.uint64 or vector.shape != (self.settings.vector_length,):
                    return (
                        f"masked input is {vector.dtype} {vector.shape}, expected uint64 "
                        f"({self.settings.vector_length},)"
                    )
            case UnmaskReply():
                request = cast(UnmaskRequest, self._asked[node])
                if set(reply.self_mask_shares) != set(request.survivors) or set(
                    reply.key_shares
                ) != set(request.dropped):
                    return "shares are not for exactly the nodes asked about"
                for owner, share in {**reply.self_mask_shares, **reply.key_shares}.items():
                    expected = self._graph[owner].index(node) + 1
                    if len(share) != SHARE_BYTES or share_index(share) != expected:
                        return f"its share of node {owner}'s secret is malformed"
        return None

    # -- stages ------------------------------------------------------------------------------
    def _after_advertise_keys(self, valid: dict[int, Reply]) -> dict[int, Request]:
        self._public_keys = cast(dict[int, AdvertiseKeysReply], dict(valid))
        self._require_enough(valid, ADVERTISE_KEYS)
        try:
            parameters = self.config.round_parameters(len(valid))
        except ConfigError as error:
            raise ProtocolError(
                f"after advertise_keys {len(valid)} clients remain: {error}"
            ) from error
        self._graph = random_neighbour_graph(valid, parameters.degree)
        self._threshold = parameters.threshold
        requests = {
            node: ShareKeysRequest(
                self.round_id,
                self._threshold,
                tuple(
                    NeighbourKeys(
                        peer,
                        self._public_keys[peer].encryption_public_key,
                        self._public_keys[peer].masking_public_key,
                        self._public_keys[peer].identity,
                        self._public_keys[peer].signature,
                    )
                    for peer in neighbours
                ),
            )
            for node, neighbours in self._graph.items()
        }
        return self._advance(SHARE_KEYS, requests)

    def _after_share_keys(self, valid: dict[int, Reply]) -> dict[int, Request]:
        for sender, reply in cast(dict[int, ShareKeysReply], valid).items():
            for receiver, ciphertext in reply.ciphertexts.items():
                self._ciphertexts[sender, receiver] = ciphertext
        # A node with fewer than t neighbours left could never have its secrets rebuilt, and
        # removing it may leave others short: drop such nodes until none remain, before any
        # client masks with them.
        shared = set(valid)
        while short := sorted(
            node for node in shared if len(shared.intersection(self._graph[node])) < self._threshold
        ):
            for node in short:
                remaining = len(shared.intersection(self._graph[node]))
                self.dropouts[node] = (
                    f"only {remaining} of its neighbours completed share_keys, fewer than the "
                    f"threshold {self._threshold}"
                )
            shared.difference_update(short)
        self._shared = shared
        self._require_enough(shared, SHARE_KEYS)
        requests = {
            node: MaskedInputRequest(
                self.round_id,
                {
                    peer: self._ciphertexts[peer, node]
                    for peer in self._graph[node]
                    if peer in shared
                },
            )
            for node in sorted(shared)
        }
        return self._advance(COLLECT_MASKED_INPUT, requests)

    def _after_masked_input(self, valid: dict[int, Reply]) -> dict[int, Request]:
        self._masked_inputs = {
            node: reply.masked_input
            for node, reply in cast(dict[int, MaskedInputReply], valid).items()
        }
        included = set(valid)
        self._require_enough(included, COLLECT_MASKED_INPUT)
        dropped = self._shared - included
        # Fail now, before anyone reveals a share, if some secret cannot reach t shares.
        for node in sorted(self._shared):
            holders = included.intersection(self._graph[node])
            what = "self-mask seed" if node in included else "masking key"
            if (node in included or holders) and len(holders) < self._threshold:
                raise ProtocolError(
                    f"cannot reconstruct the {what} of node {node}: needs {self._threshold} "
                    f"shares, but only {len(holders)} of its neighbours that hold one sent a "
                    "masked input; too many clients dropped"
                )
        requests = {
            node: UnmaskRequest(
                self.round_id,
                tuple(p for p in self._graph[node] if p in included),
                tuple(p for p in self._graph[node] if p in dropped),
            )
            for node in sorted(included)
        }
        return self._advance(UNMASK, requests)

    def _after_unmask(self, valid: dict[int, Reply]) -> dict[int, Request]:
        replies = cast(dict[int, UnmaskReply], valid)
        included = set(self._masked_inputs)
        length = self.settings.vector_length
        total = np.zeros(length, dtype=np.uint64)
        for vector in self._masked_inputs.values():
            total += vector
        for node in sorted(included):
            holders = [p for p in self._graph[node] if p in replies]
            seed = combine_secret(
                [replies[p].self_mask_shares[node] for p in holders],
                self._threshold,
                f"the self-mask seed of node {node} (shares from nodes {holders})",
            )
            total -= self_mask(seed, self.round_id, node, length)
        for node in sorted(self._shared - included):
            survivors = [p for p in self._graph[node] if p in included]
            if not survivors:
                continue  # none of its pairwise masks is in the sum
            holders = [p for p in self._graph[node] if p in replies]
            private_key = combine_secret(
                [replies[p].key_shares[node] for p in holders],
                self._threshold,
                f"the masking key of dropped node {node} (shares from nodes {holders})",
            )
            if public_key_of(private_key) != self._public_keys[node].masking_public_key:
                raise ProtocolError(
                    f"the masking key rebuilt for node {node} does not match its public key: "
                    "its neighbours returned inconsistent shares"
                )
            for survivor in survivors:
                masking_public_key = self._public_keys[survivor].masking_public_key
                mask = pairwise_mask(
                    private_key, masking_public_key, self.round_id, node, survivor, length
                )
                total = remove_pairwise_mask(total, mask, survivor, node)
        self._result = self._unquantize(total, included)
        return self._advance(DONE, {})

    def _unquantize(self, total: np.ndarray, included: set[int]) -> SecAggResult:
        """Check the unmasked sum is plausible and turn it into the weighted average."""
        total_weight = int(total[-1])
        max_level = self.settings.quantizer.max_level
        # Masks that failed to cancel leave uniform noise, which these bounds catch.
        if not len(included) <= total_weight <= len(included) * self.settings.max_weight or (
            np.any(total[:-1] > np.uint64(max_level * total_weight))  # < 2**64: weight in range
        ):
            raise ProtocolError(
                f"the unmasked sum is inconsistent (total weight {total_weight} for "
                f"{len(included)} clients): some client's masked input or shares were corrupt"
            )
        average_levels = total[:-1].astype(np.float64) / total_weight
        values = self.settings.quantizer.dequantize(average_levels)
        return SecAggResult(
            self.settings.layout.unflatten(values),
            total_weight,
            frozenset(included),
            dict(sorted(self.dropouts.items())),
        )
