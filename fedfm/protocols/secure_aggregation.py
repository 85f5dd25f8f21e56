"""Secure aggregation's four stages as round trips over any transport.

:func:`run_secure_aggregation` drives a :class:`~fedfm.secagg.SecAggServer` over a transport:
each stage's requests go out as envelopes of one message type (the stage travels in their config,
under ``secagg.stage``), each with the round's ``timeout``; a :class:`Failure`, an undecodable
reply or a reply of the wrong type counts as a dropout, and the server goes on with the others
while enough remain. The clients answer from state they keep between the stages (see
:func:`fedfm.secagg.handle`). Protocols plug it in after their training step; the double-blind
driver does (``train.secagg``).

SecAgg labels the participants of a round ``1..K`` (its node ids must be positive and distinct;
transports may use any ids, the in-process one starts at 0): the ``k``-th smallest transport id
is participant ``k``, and the request of the first stage tells each client its label. Everything
returned here is in transport ids again.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np

from fedfm.errors import ProtocolError
from fedfm.runtime.transport import Envelope, Failure, Transport
from fedfm.secagg import ArrayLayout, SecAggConfig, SecAggServer, decode_reply
from fedfm.secagg.messages import Request


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
