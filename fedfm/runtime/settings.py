"""The runtime's settings in Flower's node config and run config (parsed without Flower).

Node config (set by each site's operator when starting its SuperNode, out of the relay's reach)
wins over run config (submitted with ``flwr run`` and handed out by the SuperLink):

============== ========================= ==================================================
node config    run config                meaning
============== ========================= ==================================================
``roles``      ``role-partitions``       the roles this node plays: ``"carol"``, or for
                                         simulation ``"alice=0,bob=1,carol=2"`` (role =
                                         partition id)
``identity-key`` ``identity-dir``        the identity key file; for simulation a folder of
                                         ``node-<partition-id>.key`` files
``pins``       ``pins``                  ``"alice=<fingerprint>,..."``: the identity expected
                                         for each peer role
``inputs-dir`` ``inputs-dir``            a folder of ``<role>.npz`` private inputs
============== ========================= ==================================================

The ServerApp reads ``num-nodes``, ``timeout``, ``connect-timeout`` and ``results-file``. Every
other run config key belongs to the protocol.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedfm.errors import ConfigError
from fedfm.runtime.identity import Identity, parse_pins
from fedfm.runtime.protocol import Protocol
from fedfm.runtime.transport import ConfigValue

ProtocolFactory = Callable[[Mapping[str, ConfigValue]], Protocol]

RUN_CONFIG_DEFAULTS: dict[str, ConfigValue] = {
    "role-partitions": "",
    "identity-dir": "",
    "pins": "",
    "inputs-dir": "",
    "num-nodes": 0,  # nodes to wait for; 0: one per role
    "timeout": 60.0,  # seconds per round trip; 0: no limit
    "connect-timeout": 60.0,  # seconds to wait for the nodes
    "results-file": "",  # the ServerApp writes the run's result there as JSON
}


def identity_file(directory: Path, partition_id: int) -> Path:
    """Where simulation keeps the identity of partition ``partition_id``."""
    return directory / f"node-{partition_id}.key"


def split_run_config(
    run_config: Mapping[str, ConfigValue],
) -> tuple[dict[str, ConfigValue], dict[str, ConfigValue]]:
    """The runtime's keys (defaults filled in, types checked) and the protocol's keys."""
    runtime = dict(RUN_CONFIG_DEFAULTS)
    protocol = {}
    for key, value in run_config.items():
        if key not in RUN_CONFIG_DEFAULTS:
            protocol[key] = value
            continue
        expected = type(RUN_CONFIG_DEFAULTS[key])
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not expected:
            raise ConfigError(f"run config {key!r} must be {expected.__name__}, got {value!r}")
        runtime[key] = value
    return runtime, protocol


def _role_partitions(text: str) -> dict[str, int]:
    mapping = {}
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        role, _, partition = item.partition("=")
        if not role or not partition.isdigit():
            raise ConfigError(f"role-partitions item {item!r} is not '<role>=<partition id>'")
        mapping[role] = int(partition)
    return mapping


@dataclass(frozen=True)
class NodeSettings:
    """What a node needs to take part: its roles, identity, pins and private inputs."""

    roles: frozenset[str]
    identity_key: Path | None
    pins: dict[str, str]
    inputs_dir: Path | None

    def identity(self) -> Identity | None:
        """The node's identity, or ``None`` if it plays no role."""
        if not self.roles:
            return None
        if self.identity_key is None:
            raise ConfigError(
                "no identity key: set node config 'identity-key' (or run config 'identity-dir' "
                "in simulation)"
            )
        return Identity.load(self.identity_key)

    def load_inputs(self, role: str) -> dict[str, np.ndarray]:
        """``<inputs-dir>/<role>.npz`` (no pickles), or nothing if there is no such file."""
        if self.inputs_dir is None or not (self.inputs_dir / f"{role}.npz").is_file():
            return {}
        with np.load(self.inputs_dir / f"{role}.npz", allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}


def node_settings(
    node_config: Mapping[str, ConfigValue], run_config: Mapping[str, ConfigValue]
) -> NodeSettings:
    """A node's settings from its node config and the run config; see the module docstring."""
    runtime, _ = split_run_config(run_config)
    partition = node_config.get("partition-id")
    if "roles" in node_config:
        roles = frozenset(r for r in re.split(r"[,\s]+", str(node_config["roles"])) if r)
    else:
        assigned = _role_partitions(str(runtime["role-partitions"]))
        roles = frozenset(role for role, part in assigned.items() if part == partition)
    if "identity-key" in node_config:
        identity_key: Path | None = Path(str(node_config["identity-key"]))
    elif runtime["identity-dir"] and isinstance(partition, int):
        identity_key = identity_file(Path(str(runtime["identity-dir"])), partition)
    else:
        identity_key = None
    inputs = str(node_config.get("inputs-dir", runtime["inputs-dir"]))
    return NodeSettings(
        roles=roles,
        identity_key=identity_key,
        pins=parse_pins(str(node_config.get("pins", runtime["pins"]))),
        inputs_dir=Path(inputs) if inputs else None,
    )


@dataclass(frozen=True)
class ServerSettings:
    """What the ServerApp needs: how many nodes to wait for, time limits, where to write."""

    num_nodes: int
    timeout: float | None
    connect_timeout: float
    results_file: Path | None


def server_settings(run_config: Mapping[str, ConfigValue], protocol: Protocol) -> ServerSettings:
    """The ServerApp's settings; ``num-nodes`` 0 means one node per role of ``protocol``."""
    runtime, _ = split_run_config(run_config)
    timeout = float(runtime["timeout"])
    return ServerSettings(
        num_nodes=int(runtime["num-nodes"]) or len(protocol.roles),
        timeout=timeout if timeout > 0 else None,
        connect_timeout=float(runtime["connect-timeout"]),
        results_file=Path(str(runtime["results-file"])) if runtime["results-file"] else None,
    )
