"""Multi-party protocols as roles on Flower nodes, with end-to-end encrypted messages.

A protocol declares roles, the channels between them and steps (:class:`Protocol`); a run
places roles on nodes (each node says which roles it plays); the orchestrator, on the relay
(Flower's ServerApp, or this process), runs the steps as round trips and routes the messages
roles send each other. Those messages are sealed end to end (X25519, HKDF-SHA256,
ChaCha20-Poly1305) under session keys that every node signs with a long-term identity key and
that its peers check against pinned fingerprints, so the relay sees routing metadata, keys and
ciphertext, plus only what roles deliberately publish. Two roles can also draw randomness
nobody else can reproduce (permutations, scrambling matrices, masks).

The same protocol code runs in-process (:func:`run_in_process`, :class:`InProcessFederation`,
:class:`EmulatedTransport` for simulated network time) and on Flower (``fedfm_strategies.runtime``
and ``fedfm_clients.runtime``). See ``docs/runtime.md``.
"""

from fedfm.runtime.channel import ChannelError, Channels, FrameHeader, read_header
from fedfm.runtime.identity import (
    Identity,
    IdentityError,
    KeyBundle,
    create_identity_file,
    fingerprint,
    format_pins,
    parse_pins,
)
from fedfm.runtime.local import InProcessFederation, LocalNode, run_in_process
from fedfm.runtime.network import PRESETS, EmulatedTransport, NetworkProfile
from fedfm.runtime.node import NodeRuntime, NodeState
from fedfm.runtime.orchestrator import RunResult, Traffic, run_protocol
from fedfm.runtime.payload import pack_arrays, unpack_arrays
from fedfm.runtime.protocol import Incoming, Protocol, RoleContext, Step
from fedfm.runtime.settings import (
    ProtocolFactory,
    node_settings,
    server_settings,
    split_run_config,
)

__all__ = [
    "PRESETS",
    "ChannelError",
    "Channels",
    "EmulatedTransport",
    "FrameHeader",
    "Identity",
    "IdentityError",
    "InProcessFederation",
    "Incoming",
    "KeyBundle",
    "LocalNode",
    "NetworkProfile",
    "NodeRuntime",
    "NodeState",
    "Protocol",
    "ProtocolFactory",
    "RoleContext",
    "RunResult",
    "Step",
    "Traffic",
    "create_identity_file",
    "fingerprint",
    "format_pins",
    "node_settings",
    "pack_arrays",
    "parse_pins",
    "read_header",
    "run_in_process",
    "run_protocol",
    "server_settings",
    "split_run_config",
    "unpack_arrays",
]
