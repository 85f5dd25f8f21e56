"""CENTAUR's steps without the runtime: the same step functions, messages handed over in memory.

:func:`run_locally` drives :class:`~fedfm.protocols.centaur.protocol.CentaurRun`'s steps in this
process with plain dictionaries for the roles' state and inboxes, and pairwise keyed streams
from fresh OS-CSPRNG keys (HKDF-SHA256 per purpose, ChaCha20 keystream), in place of the
runtime's sealed channels and key agreement. The shares, dealing and arithmetic are the
protocol's own, so the result equals a runtime run's up to the fixed-point rounding of fresh
shares (a test compares them); it is what Table 2's accuracy sweep runs, many inputs at a time,
without the sealing and relay cost.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from fedfm.protocols.centaur.engine import Observer
from fedfm.protocols.centaur.protocol import CentaurRun, settings_from_config
from fedfm.runtime.channel import Channels
from fedfm.runtime.protocol import Incoming, RoleContext
from fedfm.runtime.transport import ConfigValue
from fedfm.secagg.channel import hkdf_sha256
from fedfm.secagg.masking import expand_mask


class LocalChannels:
    """Pairwise keys from the OS CSPRNG and the two derivations a step uses."""

    def __init__(self) -> None:
        self._keys: dict[frozenset[str], bytes] = {}

    def _key(self, role: str, peer: str, kind: bytes, purpose: str) -> bytes:
        pair = frozenset((role, peer))
        if pair not in self._keys:
            self._keys[pair] = os.urandom(32)
        return hkdf_sha256(self._keys[pair], kind + b"|" + purpose.encode())

    def shared_mask(self, role: str, peer: str, purpose: str, count: int) -> np.ndarray:
        return expand_mask(self._key(role, peer, b"mask", purpose), count)

    def shared_generator(self, role: str, peer: str, purpose: str) -> np.random.Generator:
        seed = self._key(role, peer, b"generator", purpose)
        return np.random.default_rng(int.from_bytes(seed, "big"))


@dataclass
class LocalRun:
    """A finished local run: the client's state, and what crossed each directed pair."""

    client: dict[str, np.ndarray]
    bytes_by_pair: dict[str, int] = field(default_factory=dict)
    round_trips: int = 0


def run_locally(
    config: Mapping[str, ConfigValue],
    inputs: Mapping[str, Mapping[str, np.ndarray]],
    *,
    observer: Observer | None = None,
    run: CentaurRun | None = None,
) -> LocalRun:
    """Run every step of CENTAUR in memory (module docstring); ``run`` reuses a run's caches
    (encoded weights, programs) across inputs."""
    settings = settings_from_config(config)
    if run is None:
        run = CentaurRun(settings) if observer is None else CentaurRun(settings, observer)
    channels = cast(Channels, LocalChannels())
    states: dict[str, dict[str, np.ndarray]] = {
        role: {} for role in ("developer", "cloud", "client")
    }
    queues: dict[str, list[Incoming]] = {role: [] for role in states}
    result = LocalRun(states["client"])
    parameters: dict[str, Any] = settings.parameters()
    for step in run.steps():
        contexts = []
        for role in step.roles:
            context = RoleContext(
                role=role,
                step=step.name,
                parameters=parameters,
                inputs=inputs.get(role, {}),
                state=states[role],
                inbox=tuple(queues[role]),
                channels=channels,
            )
            queues[role] = []
            step.action(context)
            contexts.append(context)
        for context in contexts:
            for receiver, arrays in context.outbox:
                queues[receiver].append(Incoming(context.role, step.name, arrays))
                key = f"{context.role}->{receiver}"
                result.bytes_by_pair[key] = result.bytes_by_pair.get(key, 0) + sum(
                    np.asarray(a).nbytes for a in arrays.values()
                )
        result.round_trips += 1
    return result
