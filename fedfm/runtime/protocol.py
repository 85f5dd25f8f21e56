"""How a protocol is written: roles, the channels between them, and steps.

A :class:`Protocol` is a declaration. Its *roles* are the parties (``"inquirer"``,
``"context_owner"``, ``"compute_node"``); its *channels* are the pairs of roles that exchange
messages or share randomness; its *steps* run in order, and in each step some roles act, all in
one round trip through the relay. A role acts by a function of a :class:`RoleContext`: it reads
the messages delivered to it since its last step, its private inputs and its own state, sends
messages to other roles (sealed end to end; delivered when the receiver next acts), draws
randomness it shares with a peer, and may *publish* values to the orchestrator (the only
plaintext the relay sees besides routing metadata and keys).

The declaration, parameters included, has a digest that every party signs with its session
key, so parties given different steps or parameters find out before anything is sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.runtime.channel import Channels
from fedfm.runtime.transport import ConfigValue


@dataclass(frozen=True)
class Incoming:
    """A message delivered to a role: who sent it, in which step, and its arrays."""

    sender: str
    step: str
    arrays: dict[str, np.ndarray]


class RoleContext:
    """What a role's step function sees and does; see the module docstring."""

    def __init__(
        self,
        *,
        role: str,
        step: str,
        parameters: Mapping[str, ConfigValue],
        inputs: Mapping[str, np.ndarray],
        state: dict[str, np.ndarray],
        inbox: tuple[Incoming, ...],
        channels: Channels,
    ) -> None:
        self.role, self.step = role, step
        self.parameters = parameters
        self.inputs = inputs
        self.state = state  # kept on this node between the role's steps, never sent
        self.inbox = inbox
        self.outbox: list[tuple[str, dict[str, np.ndarray]]] = []
        self.outputs: dict[str, np.ndarray] = {}
        self._channels = channels

    def receive(self, sender: str) -> dict[str, np.ndarray]:
        """The arrays of the one message ``sender`` sent this role since its last step."""
        found = [message for message in self.inbox if message.sender == sender]
        if len(found) != 1:
            raise ProtocolError(
                f"role {self.role!r} expected one message from {sender!r} in step "
                f"{self.step!r}, got {len(found)}"
            )
        return found[0].arrays

    def input(self, name: str) -> np.ndarray:
        """The private input ``name`` of this role."""
        if name not in self.inputs:
            raise ConfigError(
                f"role {self.role!r} has no input {name!r} (it has {sorted(self.inputs)})"
            )
        return self.inputs[name]

    def send(self, receiver: str, arrays: Mapping[str, np.ndarray]) -> None:
        """Seal ``arrays`` for ``receiver``; the relay delivers them when it next acts."""
        self.outbox.append((receiver, dict(arrays)))

    def publish(self, name: str, value: np.ndarray) -> None:
        """Hand ``value`` to the orchestrator in the clear (a result the relay may see)."""
        if name in self.outputs:
            raise ProtocolError(f"role {self.role!r} published {name!r} twice in one step")
        self.outputs[name] = np.asarray(value)

    def shared_generator(self, peer: str, purpose: str) -> np.random.Generator:
        """A numpy generator this role and ``peer`` both derive for ``purpose``; see
        :meth:`fedfm.runtime.Channels.shared_generator`."""
        return self._channels.shared_generator(self.role, peer, purpose)

    def shared_mask(self, peer: str, purpose: str, count: int) -> np.ndarray:
        """``count`` uint64 words of keystream this role and ``peer`` both derive for
        ``purpose`` (one purpose per mask); see :meth:`fedfm.runtime.Channels.shared_mask`."""
        return self._channels.shared_mask(self.role, peer, purpose, count)


StepAction = Callable[[RoleContext], None]


@dataclass(frozen=True)
class Step:
    """One round trip: ``roles`` act in parallel, each by ``action``."""

    name: str
    roles: tuple[str, ...]
    action: StepAction = field(compare=False)


def config_choice(
    protocol: str, config: Mapping[str, ConfigValue], key: str, choices: tuple[str, ...]
) -> str:
    """``config[key]`` as a string, which must be one of ``choices`` (``protocol`` names the
    protocol in the error)."""
    value = str(config[key])
    if value not in choices:
        raise ConfigError(f"{protocol} {key} must be one of {choices}, got {value!r}")
    return value


def _check_name(kind: str, name: str) -> None:
    if not name.isidentifier():
        raise ConfigError(f"{kind} name {name!r} is not an identifier")


@dataclass(frozen=True)
class Protocol:
    """A protocol's roles, channels, steps and public parameters.

    ``separated`` lists role pairs that must run on different nodes (e.g. a compute node and
    the parties whose shared keys it must not hold). Raises :class:`ConfigError` if the
    declaration refers to unknown roles, repeats a name, or has a role talk to itself.
    """

    name: str
    roles: tuple[str, ...]
    channels: tuple[tuple[str, str], ...]
    steps: tuple[Step, ...]
    separated: tuple[tuple[str, str], ...] = ()
    parameters: Mapping[str, ConfigValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for role in self.roles:
            _check_name("role", role)
        if len(set(self.roles)) != len(self.roles):
            raise ConfigError(f"protocol {self.name!r} lists a role twice: {self.roles}")
        for kind, pairs in (("channel", self.channels), ("separation", self.separated)):
            for first, second in pairs:
                if {first, second} - set(self.roles) or first == second:
                    raise ConfigError(
                        f"{kind} ({first!r}, {second!r}) needs two different roles of {self.roles}"
                    )
        names = [step.name for step in self.steps]
        if len(set(names)) != len(names):
            raise ConfigError(f"protocol {self.name!r} repeats a step name: {names}")
        for step in self.steps:
            _check_name("step", step.name)
            if not step.roles or set(step.roles) - set(self.roles):
                raise ConfigError(
                    f"step {step.name!r} must be taken by roles of {self.roles}, not {step.roles}"
                )

    @property
    def pairs(self) -> frozenset[frozenset[str]]:
        """The channels as unordered pairs."""
        return frozenset(frozenset(pair) for pair in self.channels)

    def peers(self, roles: frozenset[str]) -> set[str]:
        """The roles that share a channel with any of ``roles``."""
        return {peer for pair in self.pairs if pair & roles for peer in pair}

    def must_separate(self, roles: frozenset[str]) -> list[tuple[str, str]]:
        """The separated pairs that ``roles``, hosted together, would violate."""
        return [(a, b) for a, b in self.separated if {a, b} <= roles]

    def step_index(self, name: str) -> int:
        for index, step in enumerate(self.steps):
            if step.name == name:
                return index
        raise ProtocolError(f"protocol {self.name!r} has no step {name!r}")

    def digest(self) -> bytes:
        """SHA-256 of the declaration: name, roles, channels, separations, steps, parameters."""
        description = {
            "name": self.name,
            "roles": list(self.roles),
            "channels": sorted(sorted(pair) for pair in self.pairs),
            "separated": sorted(sorted(pair) for pair in self.separated),
            "steps": [[step.name, list(step.roles)] for step in self.steps],
            "parameters": {
                key: value.hex() if isinstance(value, bytes) else value
                for key, value in sorted(self.parameters.items())
            },
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).digest()
