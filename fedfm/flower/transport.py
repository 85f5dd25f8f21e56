"""fedfm's :class:`~fedfm.runtime.transport.Transport` over a Flower ``Grid``."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable

from flwr.app import Message
from flwr.serverapp import Grid

from fedfm.errors import ProtocolError
from fedfm.flower.codec import (
    MAX_HOLD_SECONDS,
    envelope_to_message,
    hold_message,
    message_to_envelope,
)
from fedfm.runtime.transport import Envelope, Failure

# keep-warm: the SuperNode must ask for its next message no earlier than HOLD_MARGIN times the
# median of the server's last HOLD_WINDOW answer times for that node, plus HOLD_SLACK seconds
# (the reply's way to the server). It notices the hold's reply at the earliest SUPERNODE_REPLY_POLL
# after taking the hold (Flower 1.41 checks every 0.5 s), so the hold itself waits that much
# less, and at most HOLD_LONGEST; HOLD_FIRST before any answer time is known. Too short a hold
# costs up to the SuperNode's 3-s idle sleep, too long one its excess, in full: the margin errs
# long, the median ignores the odd long answer (a phase's end) and no hold outlasts the sleep it
# is there to avoid.
HOLD_MARGIN = 1.25
HOLD_SLACK = 0.25
HOLD_FIRST = 0.0
HOLD_WINDOW = 5
HOLD_LONGEST = 3.0
SUPERNODE_REPLY_POLL = 0.5


class FlowerTransport:
    """Sends envelopes as Flower messages through a grid and turns the replies back.

    Replies are polled every ``poll_interval`` seconds. (Flower 1.41's ``Grid.send_and_receive``
    does the same with the grid's own interval, which is 3 s for the deployment runtime's grid:
    too slow for a protocol of ``2L + 1`` round trips per round.) A reply carrying an error, a
    malformed reply and a missing reply all become a :class:`~fedfm.runtime.transport.Failure`.
    With ``keep_warm`` each request is followed by a hold for the same node
    (:func:`~fedfm.flower.codec.hold_message`, sized by :meth:`hold_seconds`), whose empty reply
    is pulled and dropped: it keeps a Flower SuperNode from its 3-s idle sleep while the server
    answers the node's reply.
    """

    def __init__(self, grid: Grid, *, poll_interval: float = 0.1, keep_warm: bool = False) -> None:
        self.grid = grid
        self.poll_interval = poll_interval
        self.keep_warm = keep_warm
        # posted and not yet answered: message id -> (node, deadline or None)
        self._posted: dict[str, tuple[int, float | None]] = {}
        # keep-warm: holds not yet answered (message id -> when to stop pulling for it), when
        # each node's last reply came in, and the server's last answer times per node
        self._holds: dict[str, float] = {}
        self._answered_at: dict[int, float] = {}
        self._answer_times: dict[int, deque[float]] = {}
        self.holds_sent = 0

    def hold_seconds(self, node: int) -> float:
        """How long the next hold for ``node`` lasts (see ``HOLD_MARGIN``)."""
        recent = self._answer_times.get(node)
        if not recent:
            return HOLD_FIRST
        due = HOLD_MARGIN * statistics.median(recent) + HOLD_SLACK
        return min(HOLD_LONGEST, max(0.0, due - SUPERNODE_REPLY_POLL))

    def _push(self, messages: list[Message], timeout: float | None) -> list[str]:
        """Push ``messages``; with ``keep_warm``, then one hold for each of their nodes."""
        pushed = list(self.grid.push_messages(messages))
        if not self.keep_warm:
            return pushed
        now = time.monotonic()
        holds = []
        for message in messages:
            node = message.metadata.dst_node_id
            if (answered := self._answered_at.pop(node, None)) is not None:
                self._answer_times.setdefault(node, deque(maxlen=HOLD_WINDOW)).append(
                    now - answered
                )
            # pushed after the request, so the SuperNode takes it once the request is answered
            holds.append(hold_message(node, self.hold_seconds(node), ttl=timeout))
        forget_at = now + (MAX_HOLD_SECONDS if timeout is None else timeout) + MAX_HOLD_SECONDS
        for message_id in self.grid.push_messages(holds):
            self._holds[message_id] = forget_at
        self.holds_sent += len(holds)
        return pushed

    def _pull(self, message_ids: Iterable[str], *, lockstep: bool = False) -> list[Message]:
        """The replies to ``message_ids`` in by now; replies to holds are pulled and dropped.
        The server's answer time to a reply counts from its arrival, or with ``lockstep`` from
        the exchange's end (:meth:`send_and_receive` marks it): a hold must cover the server's
        work, not the wait for the other nodes, which their own holds would lengthen."""
        now = time.monotonic()
        for message_id, forget_at in list(self._holds.items()):
            if now >= forget_at:  # expired unanswered (a node that left): stop asking
                del self._holds[message_id]
        replies = []
        for message in self.grid.pull_messages([*message_ids, *self._holds]):
            replied_to = message.metadata.reply_to_message_id
            if self._holds.pop(replied_to, None) is None:
                replies.append(message)
                if self.keep_warm and not lockstep:
                    self._answered_at[message.metadata.src_node_id] = now
        return replies

    def post(self, envelope: Envelope, *, timeout: float | None) -> None:
        """Send one request now; its reply comes from :meth:`replies`."""
        if any(node == envelope.node_id for node, _ in self._posted.values()):
            raise ProtocolError(f"node {envelope.node_id} has a request in flight already")
        message = envelope_to_message(envelope, ttl=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for message_id in self._push([message], timeout):
            self._posted[message_id] = (envelope.node_id, deadline)

    def replies(self) -> list[Envelope | Failure]:
        """The posted requests answered (or timed out) by now; waits for at least one."""
        results: list[Envelope | Failure] = []
        while self._posted and not results:
            for message in self._pull(sorted(self._posted)):
                posted = self._posted.pop(message.metadata.reply_to_message_id, None)
                if posted is not None:
                    results.append(_envelope_or_failure(message, posted[0]))
            now = time.monotonic()
            for message_id, (node, deadline) in list(self._posted.items()):
                if deadline is not None and now >= deadline:
                    del self._posted[message_id]
                    results.append(Failure(node, "no reply before the timeout"))
            if not results:
                time.sleep(self.poll_interval)
        return results

    def send_and_receive(
        self, envelopes: Iterable[Envelope], *, timeout: float | None
    ) -> list[Envelope | Failure]:
        """One round trip: every envelope out, then replies until all came or ``timeout`` s."""
        envelopes = list(envelopes)
        nodes = [envelope.node_id for envelope in envelopes]
        if len(set(nodes)) != len(nodes):
            raise ProtocolError("a round trip carries at most one envelope per node")
        messages = [envelope_to_message(envelope, ttl=timeout) for envelope in envelopes]
        pushed = set(self._push(messages, timeout))
        node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
        waiting = {message_id for message_id in pushed if message_id in node_of}
        replies = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while waiting:
            for message in self._pull(sorted(waiting), lockstep=True):
                waiting.discard(message.metadata.reply_to_message_id)
                replies[node_of[message.metadata.reply_to_message_id]] = message
            if not waiting or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(self.poll_interval)
        if self.keep_warm:
            ended = time.monotonic()
            self._answered_at.update((node, ended) for node in replies)

        return [
            _envelope_or_failure(replies[node], node)
            if node in replies
            else Failure(node, "no reply before the timeout")
            for node in nodes
        ]


def _envelope_or_failure(reply: Message, node: int) -> Envelope | Failure:
    """A reply as an envelope; an error reply or a malformed one as a failure of ``node``."""
    if reply.has_error():
        return Failure(node, f"error reply: {reply.error.reason}")
    try:
        return message_to_envelope(reply, node)
    except ProtocolError as error:
        return Failure(node, str(error))


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
