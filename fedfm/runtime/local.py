"""A protocol's nodes in this process: for tests, benchmarks and reference results.

:class:`InProcessFederation` gives every node a fresh identity and pins every role to the
identity of the node that plays it, as the operators of a real deployment would out of band.
Each node keeps its state as ``(arrays, config)`` records between requests, as Flower's
``context.state`` does, so the in-process run exercises the same state round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Generic, cast

import numpy as np

from fedfm.errors import ProtocolAbort
from fedfm.runtime.identity import Identity
from fedfm.runtime.node import NodeRuntime, NodeState
from fedfm.runtime.orchestrator import RunResult, run_protocol
from fedfm.runtime.protocol import Protocol
from fedfm.runtime.transport import (
    Envelope,
    InProcessTransport,
    NodeRole,
    Records,
    StateT,
    Transport,
)

RoleInputs = Mapping[str, Mapping[str, np.ndarray]]


class LocalNode(Generic[StateT]):
    """A node's role and its state, callable as an in-process transport handler.

    The one in-process driver of every protocol's nodes (runtime protocols through
    :class:`InProcessFederation`, double-blind clients through its runner): between two requests
    the node keeps only its state's ``(arrays, config)`` records, as Flower's ``context.state``
    does, so an in-process run exercises the same state round trip as a deployment.
    """

    def __init__(self, role: NodeRole[StateT], state_type: type[StateT]) -> None:
        self.role = role
        self.state_type = state_type
        self.records: Records | None = None

    @property
    def state(self) -> StateT:
        """The state the node would load for its next request."""
        if self.records is None:
            return self.state_type()
        return self.state_type.from_records(*self.records)

    def __call__(self, envelope: Envelope) -> Envelope:
        try:
            reply, state = self.role.handle(envelope, self.state)
        except ProtocolAbort as abort:  # the role leaves: keep the state it left in
            self.records = cast(StateT, abort.state).to_records()
            raise
        self.records = state.to_records()
        return reply


class InProcessFederation:
    """The nodes of one run of ``protocol``, with node ids ``1..K``.

    Parameters
    ----------
    inputs:
        Each role's private inputs.
    placement:
        The roles of each node (default: one node per role, in the protocol's order).
    """

    def __init__(
        self,
        protocol: Protocol,
        inputs: RoleInputs | None = None,
        *,
        placement: Sequence[frozenset[str]] | None = None,
    ) -> None:
        inputs = inputs or {}
        placement = placement or [frozenset({role}) for role in protocol.roles]
        self.protocol = protocol
        self.identities = {node: Identity.generate() for node in range(1, len(placement) + 1)}
        self.roles = dict(zip(self.identities, placement, strict=True))
        self.pins = {
            role: self.identities[node].fingerprint
            for node, roles in self.roles.items()
            for role in roles
        }
        self.nodes = {
            node: LocalNode(
                NodeRuntime(
                    protocol,
                    roles=roles,
                    identity=self.identities[node],
                    pins=self.pins,
                    inputs=lambda role: inputs.get(role, {}),
                ),
                NodeState,
            )
            for node, roles in self.roles.items()
        }

    def node_of(self, role: str) -> LocalNode[NodeState]:
        """The node that plays ``role``."""
        return next(self.nodes[node] for node, roles in self.roles.items() if role in roles)

    def transport(self) -> InProcessTransport:
        return InProcessTransport(dict(self.nodes))

    def run(
        self, transport: Transport | None = None, *, log: Callable[[str], None] = lambda _: None
    ) -> RunResult:
        """Run the protocol over ``transport`` (default: a plain in-process transport)."""
        return run_protocol(
            self.protocol, transport or self.transport(), sorted(self.nodes), log=log
        )


def run_in_process(
    protocol: Protocol,
    inputs: RoleInputs | None = None,
    *,
    placement: Sequence[frozenset[str]] | None = None,
) -> RunResult:
    """One run of ``protocol`` in this process; see :class:`InProcessFederation`."""
    return InProcessFederation(protocol, inputs, placement=placement).run()
