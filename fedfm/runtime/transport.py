"""Messages between roles and the transports that carry them.

An :class:`Envelope` is what a protocol step sends: a message type in Flower's form
(``train|evaluate|query`` plus ``.action``), a destination node, a round, arrays and plain config
values. The Flower adapters turn an envelope into a Flower ``Message`` (arrays into an
``ArrayRecord``, config into a ``ConfigRecord``) and back; :class:`InProcessTransport` hands it to
a local handler directly, so that tests and benchmarks run the protocol without Flower or Ray.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, Self, TypeVar

import numpy as np

from fedfm.errors import ProtocolError

ConfigValue = int | float | str | bytes | bool
MESSAGE_CATEGORIES = ("train", "evaluate", "query")


def check_message_type(message_type: str) -> None:
    """Flower accepts ``<category>`` or ``<category>.<identifier>`` with the three categories."""
    category, _, action = message_type.partition(".")
    if category not in MESSAGE_CATEGORIES or (action and not action.isidentifier()):
        raise ProtocolError(
            f"message type {message_type!r} is not '<train|evaluate|query>.<identifier>'"
        )


@dataclass(frozen=True)
class Envelope:
    """One protocol message. ``node_id`` is the client it goes to or comes from."""

    message_type: str
    node_id: int
    round: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    config: dict[str, ConfigValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_message_type(self.message_type)

    @property
    def nbytes(self) -> int:
        """Payload size: array bytes plus the size of bytes/str config values."""
        size = sum(array.nbytes for array in self.arrays.values())
        for value in self.config.values():
            size += len(value) if isinstance(value, bytes | str) else 8
        return size


@dataclass(frozen=True)
class Failure:
    """A message that got no reply: the node timed out, dropped out or answered with an error."""

    node_id: int
    reason: str


class Transport(Protocol):
    """Sends a batch of envelopes (at most one per node) and returns the replies that came back."""

    def send_and_receive(
        self, envelopes: Iterable[Envelope], *, timeout: float | None
    ) -> list[Envelope | Failure]: ...


class PipelinedTransport(Transport, Protocol):
    """A transport that also keeps requests in flight node by node: :meth:`post` sends one
    request (at most one in flight per node) and returns at once; :meth:`replies` waits until at
    least one request in flight was answered or timed out and returns those, each once."""

    def post(self, envelope: Envelope, *, timeout: float | None) -> None: ...

    def replies(self) -> list[Envelope | Failure]: ...


ClientHandler = Callable[[Envelope], Envelope]
Records = tuple[dict[str, np.ndarray], dict[str, ConfigValue]]


class RoleState(Protocol):
    """What a node keeps between two requests, as the two records Flower's ``context.state``
    holds: arrays and plain config values. ``cls()`` is a fresh node's state."""

    def to_records(self) -> Records: ...

    @classmethod
    def from_records(
        cls, arrays: dict[str, np.ndarray], config: dict[str, ConfigValue]
    ) -> Self: ...


StateT = TypeVar("StateT", bound=RoleState)


class NodeRole(Protocol[StateT]):
    """The one shape every protocol's node takes: answer a request from the state the node kept,
    return the reply and the new state. Raise :class:`~fedfm.errors.FedfmError` to refuse (the
    state is then kept as it was). The Flower ClientApp factory
    (:func:`fedfm.flower.apps.make_client_app`) and the in-process driver
    (:class:`fedfm.runtime.local.LocalNode`) both serve roles of this shape."""

    def handle(self, envelope: Envelope, state: StateT) -> tuple[Envelope, StateT]: ...


@dataclass
class TrafficStats:
    """Bytes and round trips, per message type and in total."""

    round_trips: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    by_type: dict[str, dict[str, int]] = field(default_factory=dict)

    def record(self, request: Envelope, reply: Envelope | None) -> None:
        entry = self.by_type.setdefault(request.message_type, {"messages": 0, "down": 0, "up": 0})
        entry["messages"] += 1
        entry["down"] += request.nbytes
        self.bytes_down += request.nbytes
        if reply is not None:
            entry["up"] += reply.nbytes
            self.bytes_up += reply.nbytes


class InProcessTransport:
    """Delivers envelopes to in-process client handlers, one per node id.

    ``drop`` simulates failures: a callable that, given a request, says whether that node fails
    to answer it (a dropout or a timeout); the exceptions a handler raises become failures too,
    as a Flower reply with an error would.
    """

    def __init__(
        self,
        handlers: dict[int, ClientHandler],
        *,
        drop: Callable[[Envelope], bool] | None = None,
    ) -> None:
        self.handlers = handlers
        self.drop = drop
        self.stats = TrafficStats()
        self.seconds_in_clients = 0.0

    def node_ids(self) -> list[int]:
        return sorted(self.handlers)

    def send_and_receive(
        self, envelopes: Iterable[Envelope], *, timeout: float | None = None
    ) -> list[Envelope | Failure]:
        envelopes = list(envelopes)
        if envelopes:
            self.stats.round_trips += 1
        replies: list[Envelope | Failure] = []
        for envelope in envelopes:
            handler = self.handlers.get(envelope.node_id)
            if handler is None:
                replies.append(Failure(envelope.node_id, "unknown node"))
                continue
            if self.drop is not None and self.drop(envelope):
                self.stats.record(envelope, None)
                replies.append(Failure(envelope.node_id, "no reply before the timeout"))
                continue
            started = time.perf_counter()
            try:
                reply = handler(envelope)
            except Exception as error:  # a client's failure must not stop the others
                self.stats.record(envelope, None)
                replies.append(Failure(envelope.node_id, f"{type(error).__name__}: {error}"))
                continue
            finally:
                self.seconds_in_clients += time.perf_counter() - started
            self.stats.record(envelope, reply)
            replies.append(reply)
        return replies
