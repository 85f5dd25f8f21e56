"""The relay's side: set up a session, then run the steps and route the sealed frames.

:func:`run_protocol` is what the ServerApp runs over Flower and what tests run in-process:

1. *hello* (one round trip to every node): each node answers with the roles it plays (from its
   own configuration) and a session key signed by its identity. Every role must be claimed by
   exactly one node, and separated roles by different nodes.
2. one round trip per step, to the nodes of the roles acting in it. A node's first request
   carries the roster (every node's signed key bundle); it verifies the keys of its peers against
   its pins. Requests carry the frames queued for the acting roles; replies carry frames to
   queue (routed by their cleartext header) and published outputs.

The orchestrator never holds a key that opens a frame. It checks what it can see: a reply may
only carry frames from roles that acted on that node, on channels the protocol declares, and
every frame must have been delivered when the last step ends.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from fedfm.errors import ProtocolError
from fedfm.runtime.channel import SESSION_BYTES, ChannelError, Pair, read_header
from fedfm.runtime.identity import KeyBundle, fingerprint
from fedfm.runtime.messages import (
    BUNDLE,
    HELLO,
    PROTOCOL,
    ROLES,
    SESSION,
    STEP,
    STEP_NAME,
    bundle_from_config,
    frames_from_arrays,
    frames_to_arrays,
    join_roles,
    outputs_from_arrays,
    roster_to_config,
)
from fedfm.runtime.protocol import Protocol
from fedfm.runtime.transport import ConfigValue, Envelope, Failure, Transport


@dataclass
class PairTraffic:
    """Frames from one role to another: how many, their bytes, and the relay round trips they
    used (the sender's upload and the receiver's download; one round trip may serve both)."""

    messages: int = 0
    bytes: int = 0
    trips: set[int] = field(default_factory=set)

    @property
    def round_trips(self) -> int:
        return len(self.trips)


@dataclass
class NodeTraffic:
    """One node's link to the relay: round trips it took part in and bytes each way."""

    round_trips: int = 0
    bytes_down: int = 0
    bytes_up: int = 0


@dataclass
class Traffic:
    """What the relay carried in a run: per directed role pair, per node, and round trips."""

    round_trips: int = 0
    pairs: dict[Pair, PairTraffic] = field(default_factory=dict)
    nodes: dict[int, NodeTraffic] = field(default_factory=dict)

    @property
    def node_bytes(self) -> int:
        """Bytes carried to and from every node (requests and replies)."""
        return sum(node.bytes_down + node.bytes_up for node in self.nodes.values())

    def record_round_trip(self, requests: list[Envelope], replies: list[Envelope]) -> None:
        self.round_trips += 1
        for request, reply in zip(requests, replies, strict=True):
            node = self.nodes.setdefault(request.node_id, NodeTraffic())
            node.round_trips += 1
            node.bytes_down += request.nbytes
            node.bytes_up += reply.nbytes

    def record_frame(self, sender: str, receiver: str, size: int, trip: int) -> None:
        pair = self.pairs.setdefault((sender, receiver), PairTraffic())
        pair.messages += 1
        pair.bytes += size
        pair.trips.add(trip)

    def record_delivery(self, sender: str, receiver: str, trip: int) -> None:
        self.pairs[(sender, receiver)].trips.add(trip)

    def to_dict(self) -> dict[str, object]:
        return {
            "round_trips": self.round_trips,
            "pairs": {
                f"{sender}->{receiver}": {
                    "messages": pair.messages,
                    "bytes": pair.bytes,
                    "round_trips": pair.round_trips,
                }
                for (sender, receiver), pair in sorted(self.pairs.items())
            },
            "nodes": {str(node): asdict(link) for node, link in sorted(self.nodes.items())},
        }


@dataclass(frozen=True)
class RunResult:
    """A finished run: who played which role, what the roles published, what was carried."""

    protocol: str
    placement: dict[str, int]  # role -> node id
    fingerprints: dict[str, str]  # role -> identity fingerprint its node signed with
    outputs: dict[str, dict[str, np.ndarray]]  # role -> name -> published value
    traffic: Traffic

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready summary (outputs as dtype, shape and values)."""
        return {
            "protocol": self.protocol,
            "placement": dict(sorted(self.placement.items())),
            "fingerprints": dict(sorted(self.fingerprints.items())),
            "outputs": {
                role: {
                    name: {
                        "dtype": value.dtype.str,
                        "shape": list(value.shape),
                        "values": value.tolist(),
                    }
                    for name, value in sorted(values.items())
                }
                for role, values in sorted(self.outputs.items())
            },
            "traffic": self.traffic.to_dict(),
        }

    def save(self, path: Path) -> None:
        """Write :meth:`to_dict` as JSON to ``path`` (its folder is created)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))


def _exchange(
    transport: Transport,
    envelopes: list[Envelope],
    traffic: Traffic,
    what: str,
    roles_of: dict[int, list[str]],
    *,
    timeout: float | None,
) -> list[Envelope]:
    """One round trip in which every node must answer."""
    answers = transport.send_and_receive(envelopes, timeout=timeout)
    failed = [answer for answer in answers if isinstance(answer, Failure)]
    if failed:
        raise ProtocolError(
            f"{what} failed: "
            + "; ".join(
                f"node {f.node_id} ({join_roles(roles_of.get(f.node_id, [])) or 'no role'}): "
                f"{f.reason}"
                for f in failed
            )
        )
    replies = [answer for answer in answers if isinstance(answer, Envelope)]
    traffic.record_round_trip(envelopes, replies)
    return replies


def _roster(protocol: Protocol, replies: list[Envelope]) -> tuple[dict[str, int], list[KeyBundle]]:
    """Role -> node from the hello replies, and the bundles of the nodes that play a role."""
    placement: dict[str, int] = {}
    bundles = []
    for reply in replies:
        if not reply.config.get(f"{BUNDLE}.roles"):
            continue  # a node with no role in this protocol
        bundle = bundle_from_config(reply.config, BUNDLE)
        bundles.append(bundle)
        for role in bundle.roles:
            if role not in protocol.roles:
                raise ProtocolError(f"node {reply.node_id} claims the unknown role {role!r}")
            if role in placement:
                raise ProtocolError(
                    f"role {role!r} is claimed by nodes {placement[role]} and {reply.node_id}"
                )
            placement[role] = reply.node_id
        clashes = protocol.must_separate(frozenset(bundle.roles))
        if clashes:
            raise ProtocolError(
                f"node {reply.node_id} plays roles that must be separated: {clashes}"
            )
    missing = [role for role in protocol.roles if role not in placement]
    if missing:
        raise ProtocolError(
            f"no node plays the roles {missing} of {protocol.name!r} (assign them with node "
            "config 'roles', or 'role-partitions' for simulated nodes)"
        )
    return placement, bundles


def run_protocol(
    protocol: Protocol,
    transport: Transport,
    node_ids: Collection[int],
    *,
    timeout: float | None = None,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Run ``protocol`` with the nodes ``node_ids`` over ``transport``; see the module docstring.

    Raises
    ------
    ProtocolError
        If a node refuses a request (the reason names the node, its roles and the problem, e.g.
        a tampered frame or a substituted key), a role is unclaimed, or a reply breaks routing.
    """
    session = os.urandom(SESSION_BYTES)
    traffic = Traffic()
    hello: dict[str, ConfigValue] = {PROTOCOL: protocol.name, SESSION: session}
    replies = _exchange(
        transport,
        [Envelope(HELLO, node, 0, config=hello) for node in sorted(node_ids)],
        traffic,
        "hello",
        {},
        timeout=timeout,
    )
    placement, bundles = _roster(protocol, replies)
    roles_of: dict[int, list[str]] = {}
    for role, node in placement.items():
        roles_of.setdefault(node, []).append(role)
    log(
        f"[fedfm] {protocol.name}: session {session.hex()[:8]}, roles "
        + ", ".join(f"{role} on node {placement[role]}" for role in protocol.roles)
    )

    queues: dict[str, list[bytes]] = {role: [] for role in protocol.roles}
    introduced: set[int] = set()
    outputs: dict[str, dict[str, np.ndarray]] = {}
    for index, step in enumerate(protocol.steps, start=1):
        acting: dict[int, list[str]] = {}
        for role in step.roles:
            acting.setdefault(placement[role], []).append(role)
        envelopes = []
        for node, roles in sorted(acting.items()):
            config: dict[str, ConfigValue] = {
                SESSION: session,
                STEP_NAME: step.name,
                ROLES: join_roles(roles),
            }
            if node not in introduced:  # a node checks its peers' keys before its first step
                config.update(roster_to_config(bundles))
                introduced.add(node)
            frames = _take_frames(queues, roles, traffic)
            envelopes.append(Envelope(STEP, node, index, frames_to_arrays(frames), config))
        replies = _exchange(
            transport, envelopes, traffic, f"step {step.name!r}", roles_of, timeout=timeout
        )
        for reply in replies:
            _route(protocol, reply, acting[reply.node_id], queues, traffic)
            for role, values in outputs_from_arrays(reply.arrays).items():
                if role not in acting[reply.node_id]:
                    raise ProtocolError(f"node {reply.node_id} published for role {role!r}")
                outputs.setdefault(role, {}).update(values)
        log(f"[fedfm] {protocol.name}: step {step.name} ({index}/{len(protocol.steps)}) done")

    undelivered = {role: len(frames) for role, frames in queues.items() if frames}
    if undelivered:
        raise ProtocolError(
            f"frames for roles {undelivered} were never delivered: no later step of theirs"
        )
    fingerprints = {
        role: fingerprint(bundle.identity) for bundle in bundles for role in bundle.roles
    }
    return RunResult(protocol.name, placement, fingerprints, outputs, traffic)


def _take_frames(queues: dict[str, list[bytes]], roles: list[str], traffic: Traffic) -> list[bytes]:
    """Empty the queues of ``roles`` for the coming round trip, in the order frames came."""
    frames = [frame for role in roles for frame in queues[role]]
    for frame in frames:
        header, _ = read_header(frame)
        traffic.record_delivery(header.sender, header.receiver, traffic.round_trips + 1)
    for role in roles:
        queues[role] = []
    return frames


def _route(
    protocol: Protocol,
    reply: Envelope,
    acting: list[str],
    queues: dict[str, list[bytes]],
    traffic: Traffic,
) -> None:
    """Queue a reply's frames for their receivers, checking what the relay can check."""
    for frame in frames_from_arrays(reply.arrays):
        try:
            header, _ = read_header(frame)
        except ChannelError as error:
            raise ProtocolError(f"node {reply.node_id} sent a malformed frame: {error}") from None
        if header.sender not in acting:
            raise ProtocolError(
                f"node {reply.node_id} sent a frame as {header.sender!r}, which did not act there"
            )
        if frozenset((header.sender, header.receiver)) not in protocol.pairs:
            raise ProtocolError(f"{header.describe()} is on no channel of {protocol.name!r}")
        queues[header.receiver].append(frame)
        traffic.record_frame(header.sender, header.receiver, len(frame), traffic.round_trips)
