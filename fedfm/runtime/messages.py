"""The runtime's two message types and the envelope fields they use.

``query.runtime_hello`` (orchestrator -> every node): config ``runtime.protocol`` and
``runtime.session``. The reply carries the node's :class:`~fedfm.runtime.KeyBundle` under
``bundle.*`` (``bundle.roles`` is empty for a node that plays no role).

``query.runtime_step`` (orchestrator -> each node with a role acting in the step): config
``runtime.session``, ``runtime.step`` and ``runtime.roles`` (the roles acting there); on a node's
first step also the roster, every node's bundle under ``roster.<i>.*``; arrays ``frame.<i>``, the
sealed frames for those roles in relay order. The reply: arrays ``frame.<i>`` (frames the roles
sent) and ``output.<role>.<name>`` (values they published).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from fedfm.errors import ProtocolError
from fedfm.runtime.identity import KeyBundle
from fedfm.runtime.transport import ConfigValue

HELLO = "query.runtime_hello"
STEP = "query.runtime_step"

PROTOCOL = "runtime.protocol"
SESSION = "runtime.session"
STEP_NAME = "runtime.step"
ROLES = "runtime.roles"
BUNDLE = "bundle"
ROSTER = "roster"
FRAME = "frame."
OUTPUT = "output."

_BUNDLE_FIELDS = ("identity", "session_key", "protocol_digest", "signature")


def join_roles(roles: Iterable[str]) -> str:
    return ",".join(roles)


def split_roles(text: str) -> tuple[str, ...]:
    return tuple(role for role in text.split(",") if role)


def bundle_to_config(bundle: KeyBundle, prefix: str) -> dict[str, ConfigValue]:
    config: dict[str, ConfigValue] = {f"{prefix}.roles": join_roles(bundle.roles)}
    config.update({f"{prefix}.{name}": getattr(bundle, name) for name in _BUNDLE_FIELDS})
    return config


def bundle_from_config(config: Mapping[str, ConfigValue], prefix: str) -> KeyBundle:
    """The bundle under ``prefix``; :class:`ProtocolError` if a field is missing or mistyped."""
    values = [config.get(f"{prefix}.{name}") for name in _BUNDLE_FIELDS]
    roles = config.get(f"{prefix}.roles")
    if not isinstance(roles, str) or not all(isinstance(value, bytes) for value in values):
        raise ProtocolError(f"the key bundle under {prefix!r} is incomplete")
    return KeyBundle(split_roles(roles), *values)  # type: ignore[arg-type]  # bytes, checked


def roster_to_config(bundles: Sequence[KeyBundle]) -> dict[str, ConfigValue]:
    config: dict[str, ConfigValue] = {}
    for index, bundle in enumerate(bundles):
        config.update(bundle_to_config(bundle, f"{ROSTER}.{index}"))
    return config


def roster_from_config(config: Mapping[str, ConfigValue]) -> list[KeyBundle] | None:
    """The roster in a step request, or ``None`` if the request carries none."""
    bundles: list[KeyBundle] = []
    while f"{ROSTER}.{len(bundles)}.roles" in config:
        bundles.append(bundle_from_config(config, f"{ROSTER}.{len(bundles)}"))
    return bundles or None


def frames_to_arrays(frames: Sequence[bytes]) -> dict[str, np.ndarray]:
    return {f"{FRAME}{i}": np.frombuffer(frame, dtype=np.uint8) for i, frame in enumerate(frames)}


def frames_from_arrays(arrays: Mapping[str, np.ndarray]) -> list[bytes]:
    """The frames of an envelope, in the order they were sent."""
    indexed = []
    for name, array in arrays.items():
        if name.startswith(FRAME):
            index = name[len(FRAME) :]
            if not index.isdigit() or array.dtype != np.uint8 or array.ndim != 1:
                raise ProtocolError(f"{name!r} is not a frame (uint8 vector 'frame.<index>')")
            indexed.append((int(index), array.tobytes()))
    return [frame for _, frame in sorted(indexed)]


def outputs_to_arrays(role: str, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{OUTPUT}{role}.{name}": value for name, value in outputs.items()}


def outputs_from_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """``output.<role>.<name>`` arrays as ``{role: {name: value}}``."""
    outputs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        if key.startswith(OUTPUT):
            role, _, name = key[len(OUTPUT) :].partition(".")
            outputs.setdefault(role, {})[name] = value
    return outputs
