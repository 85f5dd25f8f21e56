"""A node's side of the runtime: the roles it hosts, its keys, its channels, its state.

:meth:`NodeRuntime.handle` answers one request from the state the previous request left and
returns the reply with the new state; nothing is kept in the object, so the Flower ClientApp can
keep the state in ``context.state`` (every message may run in a fresh process) and the
in-process transport in memory. A request the node refuses raises and leaves the state as it
was.

What a node checks, besides the channel checks of :class:`~fedfm.runtime.Channels`: one hello per
session; the roster's key for every peer role is signed by the identity pinned for that role and
for the same protocol digest; each role takes its steps in protocol order, each once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from fedfm.errors import ConfigError, InvariantError, ProtocolError
from fedfm.runtime.channel import SESSION_BYTES, ChannelError, Channels, Pair
from fedfm.runtime.identity import Identity, IdentityError, KeyBundle
from fedfm.runtime.messages import (
    BUNDLE,
    HELLO,
    PROTOCOL,
    ROLES,
    SESSION,
    STEP,
    STEP_NAME,
    bundle_to_config,
    frames_from_arrays,
    frames_to_arrays,
    outputs_to_arrays,
    roster_from_config,
    split_roles,
)
from fedfm.runtime.payload import pack_arrays, unpack_arrays
from fedfm.runtime.protocol import Incoming, Protocol, RoleContext
from fedfm.runtime.transport import ConfigValue, Envelope
from fedfm.secagg.channel import new_private_key, public_key_of

InputLoader = Callable[[str], Mapping[str, np.ndarray]]


def no_inputs(role: str) -> Mapping[str, np.ndarray]:
    """The input loader of a node whose roles have no private inputs."""
    return {}


def _bytes(config: Mapping[str, ConfigValue], key: str) -> bytes:
    """A bytes value of a stored state; a damaged state is named."""
    value = config.get(key)
    if not isinstance(value, bytes):
        raise ProtocolError(f"a damaged node state: {key!r} is not bytes")
    return value


@dataclass(frozen=True)
class NodeState:
    """Everything a node keeps between requests (secrets included; it never leaves the node)."""

    session: bytes = b""
    private_key: bytes = b""
    session_keys: dict[str, bytes] = field(default_factory=dict)  # verified, per role
    sent: dict[Pair, int] = field(default_factory=dict)
    received: dict[Pair, int] = field(default_factory=dict)
    next_step: dict[str, int] = field(default_factory=dict)  # per role: first step it may take
    role_state: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    def to_records(self) -> tuple[dict[str, np.ndarray], dict[str, ConfigValue]]:
        """The state as ``(arrays, config)`` records, e.g. for Flower's ``context.state``."""
        config: dict[str, ConfigValue] = {"session": self.session, "private_key": self.private_key}
        config.update({f"key.{role}": key for role, key in self.session_keys.items()})
        config.update({f"sent.{s}.{r}": n for (s, r), n in self.sent.items()})
        config.update({f"received.{s}.{r}": n for (s, r), n in self.received.items()})
        config.update({f"next.{role}": n for role, n in self.next_step.items()})
        arrays = {
            f"{role}.{name}": value
            for role, values in self.role_state.items()
            for name, value in values.items()
        }
        return arrays, config

    @classmethod
    def from_records(
        cls, arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]
    ) -> NodeState:
        """The inverse of :meth:`to_records`."""
        state = cls(session=_bytes(config, "session"), private_key=_bytes(config, "private_key"))
        for key, value in config.items():
            kind, _, rest = key.partition(".")
            if kind == "key":
                state.session_keys[rest] = _bytes(config, key)
            elif kind in ("sent", "received"):
                sender, _, receiver = rest.partition(".")
                getattr(state, kind)[(sender, receiver)] = int(value)
            elif kind == "next":
                state.next_step[rest] = int(value)
        for key, array in arrays.items():
            role, _, name = key.partition(".")
            state.role_state.setdefault(role, {})[name] = array
        return state


def _with_own_roles(
    pins: Mapping[str, str], roles: frozenset[str], identity: Identity | None
) -> dict[str, str]:
    """``pins`` with the node's own roles pinned to its own identity.

    A site's pins name its peers; its own roles need no pin (it knows its identity), but a pin
    given for one of them must be its identity, or the node was handed another site's settings.
    """
    if identity is None:
        return dict(pins)
    own = identity.fingerprint
    for role in sorted(roles):
        if pins.get(role, own) != own:
            raise ConfigError(
                f"role {role!r} is pinned to identity {pins[role][:16]}..., but this node's "
                f"identity is {own[:16]}...: wrong identity key or pins for this site"
            )
    return {**pins, **dict.fromkeys(roles, own)}


class NodeRuntime:
    """The roles ``roles`` of ``protocol`` on one node.

    Parameters
    ----------
    identity:
        The node's long-term identity (needed if it hosts a role).
    pins:
        Role -> identity fingerprint for every role the hosted roles share a channel with.
    inputs:
        Loads a hosted role's private inputs when it acts.

    Raises
    ------
    ConfigError
        If a role is unknown, two hosted roles must be separated, or the identity is missing.
    """

    def __init__(
        self,
        protocol: Protocol,
        *,
        roles: frozenset[str],
        identity: Identity | None,
        pins: Mapping[str, str],
        inputs: InputLoader = no_inputs,
    ) -> None:
        unknown = roles - set(protocol.roles)
        if unknown:
            raise ConfigError(
                f"roles {sorted(unknown)} are not roles of {protocol.name!r} {protocol.roles}"
            )
        clashes = protocol.must_separate(roles)
        if clashes:
            raise ConfigError(f"one node may not play both roles of {clashes} in {protocol.name!r}")
        if roles and identity is None:
            raise ConfigError("a node that plays a role needs an identity key")
        self.protocol, self.roles, self.identity = protocol, roles, identity
        self.pins, self.inputs = _with_own_roles(pins, roles, identity), inputs
        self.digest = protocol.digest()

    def handle(self, envelope: Envelope, state: NodeState) -> tuple[Envelope, NodeState]:
        """The reply to one request, and the state to keep; raises if the request is refused."""
        if envelope.message_type == HELLO:
            return self._hello(envelope, state)
        if envelope.message_type == STEP:
            return self._step(envelope, state)
        raise ProtocolError(f"the runtime does not handle {envelope.message_type!r} messages")

    # -- hello ----------------------------------------------------------------------------------

    def _hello(self, envelope: Envelope, state: NodeState) -> tuple[Envelope, NodeState]:
        asked = envelope.config.get(PROTOCOL)
        if asked != self.protocol.name:
            raise ProtocolError(
                f"asked to run protocol {asked!r}; this node runs {self.protocol.name!r}"
            )
        session = envelope.config.get(SESSION)
        if not isinstance(session, bytes) or len(session) != SESSION_BYTES:
            raise ProtocolError(f"the hello carries no {SESSION_BYTES}-byte session id")
        if state.session:
            raise ProtocolError("a second hello in one run: this node's session is already set up")
        reply = Envelope(HELLO, envelope.node_id, envelope.round, config={f"{BUNDLE}.roles": ""})
        if not self.roles:
            return reply, NodeState(session=session)
        if self.identity is None:
            raise InvariantError("a node runtime without an identity (checked in __init__)")
        private_key = new_private_key()
        bundle = KeyBundle.signed(
            self.identity,
            tuple(sorted(self.roles)),
            public_key_of(private_key),
            self.digest,
            session,
        )
        reply = replace(reply, config=bundle_to_config(bundle, BUNDLE))
        return reply, NodeState(session=session, private_key=private_key)

    # -- steps ----------------------------------------------------------------------------------

    def _verified_keys(self, roster: list[KeyBundle], state: NodeState) -> dict[str, bytes]:
        """Role -> session key for the hosted roles and their peers, checked against the pins."""
        by_role: dict[str, KeyBundle] = {}
        for bundle in roster:
            for role in bundle.roles:
                if role in by_role:
                    raise IdentityError(f"two key bundles in the roster claim role {role!r}")
                by_role[role] = bundle
        own_key = public_key_of(state.private_key)
        keys = {}
        for role in sorted(self.roles | self.protocol.peers(self.roles)):
            found = by_role.get(role)
            if found is None:
                raise IdentityError(f"the roster has no session key for role {role!r}")
            if role in self.roles and found.session_key != own_key:
                raise IdentityError(
                    f"the roster gives this node's role {role!r} a session key that is not "
                    "this node's"
                )
            found.verify(role, self.pins, self.digest, state.session)
            keys[role] = found.session_key
        return keys

    def _step(self, envelope: Envelope, state: NodeState) -> tuple[Envelope, NodeState]:
        if not self.roles:
            raise ProtocolError("this node plays no role, yet was asked to take a step")
        if not state.private_key or envelope.config.get(SESSION) != state.session:
            raise ChannelError("the step request belongs to no session this node set up")
        roster = roster_from_config(envelope.config)
        if roster is not None and state.session_keys:
            raise ProtocolError("a second roster in one session: keys are fixed at the first step")
        if roster is None and not state.session_keys:
            raise ProtocolError("the node's first step request carries no roster")
        session_keys = (
            self._verified_keys(roster, state) if roster is not None else state.session_keys
        )
        step_name = str(envelope.config.get(STEP_NAME, ""))
        acting = split_roles(str(envelope.config.get(ROLES, "")))
        next_step = self._advance(step_name, acting, state.next_step)

        channels = self.channels(replace(state, session_keys=session_keys))
        inbox: dict[str, list[Incoming]] = {role: [] for role in acting}
        for frame in frames_from_arrays(envelope.arrays):
            opened = channels.open(frame)
            header = opened.header
            if header.receiver not in inbox:
                raise ChannelError(
                    f"{header.describe()} was delivered in step {step_name!r}, in which "
                    f"{header.receiver!r} does not act"
                )
            inbox[header.receiver].append(
                Incoming(header.sender, header.step, unpack_arrays(opened.plaintext))
            )

        step = self.protocol.steps[self.protocol.step_index(step_name)]
        frames, arrays = [], {}
        role_state = dict(state.role_state)
        for role in acting:
            # a copy: a step that fails halfway must leave the state it started from
            own = {name: value.copy() for name, value in role_state.get(role, {}).items()}
            context = RoleContext(
                role=role,
                step=step_name,
                parameters=self.protocol.parameters,
                inputs=self.inputs(role),
                state=own,
                inbox=tuple(inbox[role]),
                channels=channels,
            )
            step.action(context)
            role_state[role] = own
            for receiver, payload in context.outbox:
                frames.append(channels.seal(role, receiver, step_name, pack_arrays(payload)))
            arrays.update(outputs_to_arrays(role, context.outputs))
        arrays.update(frames_to_arrays(frames))
        new_state = replace(
            state,
            session_keys=session_keys,
            sent=channels.sent,
            received=channels.received,
            next_step=next_step,
            role_state=role_state,
        )
        return Envelope(STEP, envelope.node_id, envelope.round, arrays), new_state

    def _advance(
        self, step_name: str, acting: tuple[str, ...], next_step: Mapping[str, int]
    ) -> dict[str, int]:
        """Check that each acting role is hosted here and due to take this step; the roles'
        next steps afterwards."""
        index = self.protocol.step_index(step_name)
        step = self.protocol.steps[index]
        if not acting:
            raise ProtocolError(f"the request for step {step_name!r} names no acting role")
        advanced = dict(next_step)
        for role in acting:
            if role not in self.roles or role not in step.roles:
                raise ProtocolError(
                    f"asked to act as {role!r} in step {step_name!r}; this node hosts "
                    f"{sorted(self.roles)} and the step is taken by {list(step.roles)}"
                )
            due = self._next_step_of(role, advanced.get(role, 0))
            if index != due:
                raise ProtocolError(
                    f"replayed or out-of-order step: role {role!r} was asked for step "
                    f"{step_name!r}, but its next step is "
                    f"{'none' if due is None else self.protocol.steps[due].name!r}"
                )
            advanced[role] = index + 1
        return advanced

    def channels(self, state: NodeState) -> Channels:
        """This node's channels in the session of ``state`` (keys verified at its first step)."""
        return Channels(
            digest=self.digest,
            session=state.session,
            private_key=state.private_key,
            session_keys=state.session_keys,
            pairs=self.protocol.pairs,
            hosted=self.roles,
            sent=state.sent,
            received=state.received,
        )

    def _next_step_of(self, role: str, start: int) -> int | None:
        """The index of the first step from ``start`` on that ``role`` takes."""
        for index in range(start, len(self.protocol.steps)):
            if role in self.protocol.steps[index].roles:
                return index
        return None
