"""Secure aggregation's four stages as round trips over any transport.

:func:`run_secure_aggregation` drives a :class:`~fedfm.secagg.SecAggServer` over a transport:
each stage's requests go out as envelopes of one message type (the stage travels in their config,
under ``secagg.stage``), each with the round's ``timeout``; a :class:`Failure`, an undecodable
reply or a reply of the wrong type counts as a dropout, and the server goes on with the others
while enough remain. The clients answer from state they keep between the stages (see
:func:`fedfm.secagg.handle`). Protocols plug it in after their training step; the double-blind
driver does (``train.secagg``).

Each client authenticates the other clients' SecAgg keys as its data owner chose
(:class:`~fedfm.secagg.KeyAuthentication`): signed by its long-term identity and checked against
the identities it pinned, or (explicitly) semi-honest. :func:`run_in_process` gives every client
a fresh identity and pins the others' (:func:`signed_federation`) unless told otherwise.

SecAgg labels the participants of a round ``1..K`` (its node ids must be positive and distinct;
transports may use any ids, the in-process one starts at 0): the ``k``-th smallest transport id
is participant ``k``, and the request of the first stage tells each client its label. Everything
returned here is in transport ids again.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.runtime.identity import Identity
from fedfm.runtime.local import LocalNode
from fedfm.runtime.transport import Envelope, Failure, InProcessTransport, Transport
from fedfm.secagg import (
    ArrayLayout,
    ClientSecAggState,
    ClientUpdate,
    KeyAuthentication,
    SecAggConfig,
    SecAggServer,
    decode_reply,
    decode_request,
)
from fedfm.secagg import handle as handle_secagg
from fedfm.secagg.messages import STAGE_KEY, Request

# The message type of SecAgg's stages when it runs alone (protocols pass their own).
IN_PROCESS_MESSAGE_TYPE = "train.secagg"

Node = TypeVar("Node", bound=Hashable)


def signed_federation(nodes: Iterable[Node]) -> dict[Node, KeyAuthentication]:
    """A fresh identity for every node, each node pinning every other node's identity.

    What the data owners of a deployment set up out of band (each its own identity key, the
    others' fingerprints), done in one process: the default of the in-process runs. Pins are
    named ``node-<node>``.
    """
    identities = {node: Identity.generate() for node in nodes}
    return {
        node: KeyAuthentication.signed(
            identity,
            {
                f"node-{peer}": other.fingerprint
                for peer, other in identities.items()
                if peer != node
            },
        )
        for node, identity in identities.items()
    }


@dataclass(frozen=True)
class SecureAggregation:
    """The outcome of one secure aggregation, in transport node ids.

    ``arrays`` is the weighted average ``sum_k N_k x_k / sum_k N_k`` over ``included`` (float32,
    the layout's names and shapes) within one quantization step per value of the average of the
    clipped inputs; ``total_weight`` is ``sum_k N_k``. ``dropouts`` says why each node that left
    did so (a node that failed only the last stage is still included: its neighbours' shares
    stood in for it). ``round_trips`` counts the transport's round trips (one per stage).
    """

    arrays: dict[str, np.ndarray]
    total_weight: int
    included: frozenset[int]
    dropouts: dict[int, str]
    round_trips: int


def run_secure_aggregation(
    transport: Transport,
    node_ids: Collection[int],
    layout: ArrayLayout,
    config: SecAggConfig,
    *,
    message_type: str,
    round_id: int,
    timeout: float | None,
    log: Callable[[str], None] = print,
) -> SecureAggregation:
    """Run the four stages with the clients ``node_ids``, whose updates follow ``layout``.

    Raises
    ------
    ProtocolError
        If fewer than ``config.min_clients`` clients remain at some stage or a secret cannot be
        rebuilt (the message names the stage or the node), prefixed with the round.
    ConfigError
        If the settings do not fit the number of clients (e.g. a threshold above the degree).
    """
    labels = {node: label for label, node in enumerate(sorted(node_ids), start=1)}
    nodes = {label: node for node, label in labels.items()}
    server = SecAggServer(config, layout, round_id=round_id)
    requests: Mapping[int, Request] = server.start(nodes)
    reasons: dict[int, str] = {}
    trips = 0
    while requests:
        stage = server.stage
        envelopes = [
            Envelope(message_type, nodes[label], round_id, *request.to_records())
            for label, request in requests.items()
        ]
        answers = transport.send_and_receive(envelopes, timeout=timeout)
        trips += 1
        replies = {}
        for answer in answers:
            if isinstance(answer, Failure):
                reasons[answer.node_id] = f"{stage}: {answer.reason}"
            elif answer.message_type != message_type or answer.round != round_id:
                reasons[answer.node_id] = (
                    f"{stage}: a {answer.message_type} reply for round {answer.round}"
                )
            else:
                try:
                    replies[labels[answer.node_id]] = decode_reply(answer.arrays, answer.config)
                except ProtocolError as error:
                    reasons[answer.node_id] = f"{stage}: {error}"
        log(
            f"[fedfm] secure aggregation, round {round_id}: stage {stage}, {len(replies)} "
            f"replies of {len(envelopes)}"
        )
        try:
            requests = server.on_replies(replies)
        except ProtocolError as error:
            dropouts = _dropouts(server.dropouts, nodes, reasons)
            listed = "; ".join(f"node {node}: {reason}" for node, reason in dropouts.items())
            raise ProtocolError(
                f"round {round_id}: secure aggregation failed: {error} (SecAgg's node k is the "
                f"k-th of nodes {sorted(labels)}); dropouts: {listed or 'none'}"
            ) from error
    result = server.result()
    return SecureAggregation(
        arrays=result.arrays,
        total_weight=result.total_weight,
        included=frozenset(nodes[label] for label in result.included),
        dropouts=_dropouts(result.dropouts, nodes, reasons),
        round_trips=trips,
    )


def _dropouts(
    by_label: Mapping[int, str], nodes: Mapping[int, int], reasons: Mapping[int, str]
) -> dict[int, str]:
    """The server's dropouts in transport ids, with the transport's reason where it has one."""
    return {nodes[label]: reasons.get(nodes[label], reason) for label, reason in by_label.items()}


class SecAggClientRole:
    """A client of secure aggregation alone, as a node role (:class:`~fedfm.runtime.transport.
    NodeRole`): it answers each stage's request for the update it was given, authenticating
    keys as ``authentication`` says. Protocols that run SecAgg after their own steps answer
    these requests inside their own role instead (the double-blind client does); this role
    serves :func:`run_in_process` and tests."""

    def __init__(self, update: ClientUpdate, authentication: KeyAuthentication) -> None:
        self.update = update
        self.authentication = authentication

    def handle(
        self, envelope: Envelope, state: ClientSecAggState
    ) -> tuple[Envelope, ClientSecAggState]:
        request = decode_request(envelope.arrays, envelope.config)
        reply, new_state = handle_secagg(
            state, request, update=self.update, authentication=self.authentication
        )
        arrays, config = reply.to_records()
        return Envelope(envelope.message_type, envelope.node_id, envelope.round, arrays, config), (
            new_state
        )


def run_in_process(
    config: SecAggConfig,
    updates: Mapping[int, ClientUpdate],
    *,
    round_id: int = 0,
    dropouts: Mapping[str, Collection[int]] | None = None,
    message_type: str = IN_PROCESS_MESSAGE_TYPE,
    authentication: Mapping[int, KeyAuthentication] | None = None,
) -> SecureAggregation:
    """One round of secure aggregation of ``updates`` (node id to update) in this process.

    The clients are the runtime's in-process nodes (:class:`~fedfm.runtime.local.LocalNode`: each
    keeps only its state's records between stages, as in Flower's ``context.state``) behind an
    :class:`~fedfm.runtime.transport.InProcessTransport`; ``dropouts`` maps a stage to the nodes
    that never answer its request (they crash or time out on receiving it). ``authentication``
    is each node's choice of key authentication; by default every node signs its keys with a
    fresh identity and pins the others' (:func:`signed_federation`).
    """
    if not updates:
        raise ConfigError("a round needs at least one client update")
    chosen = dict(authentication) if authentication is not None else signed_federation(updates)
    if missing := sorted(set(updates) - set(chosen)):
        raise ConfigError(f"no key authentication for nodes {missing}")
    silent = {stage: set(nodes) for stage, nodes in (dropouts or {}).items()}

    def drop(envelope: Envelope) -> bool:
        return envelope.node_id in silent.get(str(envelope.config.get(STAGE_KEY)), ())

    handlers = {
        node: LocalNode(SecAggClientRole(update, chosen[node]), ClientSecAggState)
        for node, update in updates.items()
    }
    return run_secure_aggregation(
        InProcessTransport(dict(handlers), drop=drop),
        sorted(updates),
        ArrayLayout.of(next(iter(updates.values())).arrays),
        config,
        message_type=message_type,
        round_id=round_id,
        timeout=None,
        log=lambda _line: None,
    )
