"""The runtime's settings: a node's own in its node config, the run's in the run config.

Everything that decides whom a node trusts and what it reveals comes only from its node config,
set by each site's operator (``flower-supernode --node-config``; for simulated nodes, which
Flower starts without one, ``$FEDFM_NODE_CONFIG`` in the operator's environment: see
:func:`fedfm.flower.apps.node_config`). The run config is submitted with ``flwr run`` and handed
out by the SuperLink, i.e. by the relay: a node never takes its roles, identity, pins or inputs
from it, and a run config that names one of these keys is refused (:data:`NODE_ONLY_KEYS`).

=================== ===================================================================
node config         meaning
=================== ===================================================================
``roles``           the roles this node plays: ``"carol"``
``role-partitions`` simulation: ``"alice=0,bob=1,carol=2"`` (role = partition id)
``identity-key``    the identity key file
``identity-dir``    simulation: a folder of ``node-<partition-id>.key`` files
``pins``            ``"alice=<fingerprint>,..."``: the identity expected for each peer role
``inputs-dir``      a folder of ``<role>.npz`` private inputs
=================== ===================================================================

The ServerApp reads ``num-nodes``, ``timeout``, ``connect-timeout``, ``results-file`` and
``keep-warm`` (a hold message after each request, for sites with warm executors:
:class:`fedfm.flower.transport.FlowerTransport`) from the run config. Every other run config
key belongs to the protocol.
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
    "num-nodes": 0,  # nodes to wait for; 0: one per role
    "timeout": 60.0,  # seconds per round trip; 0: no limit
    "connect-timeout": 60.0,  # seconds to wait for the nodes
    "results-file": "",  # the ServerApp writes the run's result there as JSON
    "keep-warm": False,  # a hold after each request keeps a SuperNode from its idle sleep
}


# A node's trust and secrets: set by its operator, never by the relay's run config.
NODE_ONLY_KEYS = ("roles", "role-partitions", "identity-key", "identity-dir", "pins", "inputs-dir")


def identity_file(directory: Path, partition_id: int) -> Path:
    """Where simulation keeps the identity of partition ``partition_id``."""
    return directory / f"node-{partition_id}.key"


def split_run_config(
    run_config: Mapping[str, ConfigValue],
) -> tuple[dict[str, ConfigValue], dict[str, ConfigValue]]:
    """The runtime's keys (defaults filled in, types checked) and the protocol's keys.

    Raises
    ------
    ConfigError
        If a key belongs to a node's own config (:data:`NODE_ONLY_KEYS`): the relay hands the
        run config out, so pins, roles, identities and inputs never come from it.
    """
    relayed = sorted(set(run_config) & set(NODE_ONLY_KEYS))
    if relayed:
        raise ConfigError(
            f"run config keys {relayed} are refused: roles, identities, pins and inputs come "
            "only from each node's own node config (flower-supernode --node-config, or "
            "$FEDFM_NODE_CONFIG for simulated nodes), never from the run config the relay hands out"
        )
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
                "no identity key: set node config 'identity-key' (or 'identity-dir' for "
                "simulated nodes)"
            )
        return Identity.load(self.identity_key)

    def load_inputs(self, role: str) -> dict[str, np.ndarray]:
        """``<inputs-dir>/<role>.npz`` (no pickles), or nothing if there is no such file."""
        if self.inputs_dir is None or not (self.inputs_dir / f"{role}.npz").is_file():
            return {}
        with np.load(self.inputs_dir / f"{role}.npz", allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}


def node_settings(node_config: Mapping[str, ConfigValue]) -> NodeSettings:
    """A node's settings from its own node config alone; see the module docstring.

    Raises
    ------
    ConfigError
        If ``role-partitions`` or ``identity-dir`` (the simulation forms) are given to a node
        without an integer ``partition-id``.
    """
    partition = node_config.get("partition-id")
    simulated = [key for key in ("role-partitions", "identity-dir") if key in node_config]
    if simulated and not isinstance(partition, int):
        raise ConfigError(
            f"node config {simulated} name settings by partition, but this node has no integer "
            "'partition-id'"
        )
    if "roles" in node_config:
        roles = frozenset(r for r in re.split(r"[,\s]+", str(node_config["roles"])) if r)
    else:
        assigned = _role_partitions(str(node_config.get("role-partitions", "")))
        roles = frozenset(role for role, part in assigned.items() if part == partition)
    if "identity-key" in node_config:
        identity_key: Path | None = Path(str(node_config["identity-key"]))
    elif "identity-dir" in node_config and isinstance(partition, int):
        identity_key = identity_file(Path(str(node_config["identity-dir"])), partition)
    else:
        identity_key = None
    inputs = str(node_config.get("inputs-dir", ""))
    return NodeSettings(
        roles=roles,
        identity_key=identity_key,
        pins=parse_pins(str(node_config.get("pins", ""))),
        inputs_dir=Path(inputs) if inputs else None,
    )


@dataclass(frozen=True)
class ServerSettings:
    """What the ServerApp needs: how many nodes to wait for, time limits, where to write,
    whether to keep the nodes' SuperNodes warm with holds."""

    num_nodes: int
    timeout: float | None
    connect_timeout: float
    results_file: Path | None
    keep_warm: bool = False


def server_settings(run_config: Mapping[str, ConfigValue], protocol: Protocol) -> ServerSettings:
    """The ServerApp's settings; ``num-nodes`` 0 means one node per role of ``protocol``."""
    runtime, _ = split_run_config(run_config)
    timeout = float(runtime["timeout"])
    return ServerSettings(
        num_nodes=int(runtime["num-nodes"]) or len(protocol.roles),
        timeout=timeout if timeout > 0 else None,
        connect_timeout=float(runtime["connect-timeout"]),
        results_file=Path(str(runtime["results-file"])) if runtime["results-file"] else None,
        keep_warm=bool(runtime["keep-warm"]),
    )
