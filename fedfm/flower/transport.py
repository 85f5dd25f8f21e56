"""fedfm's :class:`~fedfm.runtime.transport.Transport` over a Flower ``Grid``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from flwr.serverapp import Grid

from fedfm.errors import ProtocolError
from fedfm.flower.codec import envelope_to_message, message_to_envelope
from fedfm.runtime.transport import Envelope, Failure


class FlowerTransport:
    """Sends envelopes as Flower messages through a grid and turns the replies back.

    Replies are polled every ``poll_interval`` seconds. (Flower 1.41's ``Grid.send_and_receive``
    does the same with the grid's own interval, which is 3 s for the deployment runtime's grid:
    too slow for a protocol of ``2L + 1`` round trips per round.) A reply carrying an error, a
    malformed reply and a missing reply all become a :class:`~fedfm.runtime.transport.Failure`.
    """

    def __init__(self, grid: Grid, *, poll_interval: float = 0.1) -> None:
        self.grid = grid
        self.poll_interval = poll_interval

    def send_and_receive(
        self, envelopes: Iterable[Envelope], *, timeout: float | None
    ) -> list[Envelope | Failure]:
        """One round trip: every envelope out, then replies until all came or ``timeout`` s."""
        envelopes = list(envelopes)
        nodes = [envelope.node_id for envelope in envelopes]
        if len(set(nodes)) != len(nodes):
            raise ProtocolError("a round trip carries at most one envelope per node")
        messages = [envelope_to_message(envelope, ttl=timeout) for envelope in envelopes]
        pushed = set(self.grid.push_messages(messages))
        node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
        waiting = {message_id for message_id in pushed if message_id in node_of}
        replies = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while waiting:
            for message in self.grid.pull_messages(sorted(waiting)):
                waiting.discard(message.metadata.reply_to_message_id)
                replies[node_of[message.metadata.reply_to_message_id]] = message
            if not waiting or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(self.poll_interval)

        results: list[Envelope | Failure] = []
        for node in nodes:
            reply = replies.get(node)
            if reply is None:
                results.append(Failure(node, "no reply before the timeout"))
            elif reply.has_error():
                results.append(Failure(node, f"error reply: {reply.error.reason}"))
            else:
                try:
                    results.append(message_to_envelope(reply, node))
                except ProtocolError as error:
                    results.append(Failure(node, str(error)))
        return results


def wait_for_nodes(
    grid: Grid,
    expected: int,
    *,
    minimum: int,
    deadline_seconds: float,
    log: Callable[[str], None],
    poll_interval: float = 1.0,
) -> list[int]:
    """The connected nodes once ``expected`` are there, or at the deadline if ``minimum`` are.

    Raises
    ------
    ProtocolError
        If fewer than ``minimum`` nodes are connected at the deadline.
    """
    deadline = time.monotonic() + deadline_seconds
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= expected:
            return nodes
        if time.monotonic() >= deadline:
            break
        log(f"[fedfm] waiting for nodes: {len(nodes)} of {expected} connected")
        time.sleep(poll_interval)
    if len(nodes) < minimum:
        raise ProtocolError(
            f"{len(nodes)} nodes connected within {deadline_seconds:.0f} s, need {minimum}"
        )
    log(f"[fedfm] {len(nodes)} of {expected} nodes connected; going on with them")
    return nodes
