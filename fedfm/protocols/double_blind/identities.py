"""Where a data owner's SecAgg identity and pins come from: its own side, never the server.

A double-blind data owner signs its SecAgg+ public keys with a long-term Ed25519 identity and
accepts a neighbour's keys only if an identity it pinned signed them
(:mod:`fedfm.secagg.authentication`). Both come from the data owner's own configuration:

==================  =========================================================================
node config         meaning
==================  =========================================================================
``identity-key``    its identity key file (PKCS#8 PEM, as
                    :func:`fedfm.runtime.create_identity_file` writes it; the runtime's key)
``secagg-pins``     ``"<name>=<fingerprint>,..."``: the other data owners it accepts as SecAgg
                    neighbours (fingerprint: SHA-256 of the raw Ed25519 public key, hex; the
                    names only label errors)
``secagg-mode``     ``"signed"`` (default) or ``"semi-honest"``: take the keys the server
                    relays as they are (secure only if the server follows the protocol)
``secagg-identity-  simulation: a folder of ``node-<partition-id>.key`` files and a ``pins``
dir``               file (:func:`create_simulation_identities`)
==================  =========================================================================

Why a set of fingerprints and not a map from node id to fingerprint: the SuperLink assigns Flower
node ids and SecAgg numbers the clients of a round itself, so the server controls every id. What
it cannot forge is a signature: each neighbour's keys must be signed by a pinned identity (one
of the data owners this one agreed to aggregate with), for the node id the server claims for it
in this round, and no identity may stand for two neighbours. The server still chooses *which*
pinned data owners are a client's neighbours; it cannot slip in keys of its own.

Simulation (``flwr run`` with virtual SuperNodes) has no per-node config beyond the partition.
There the data owners' side (whoever starts the simulation, not the run config the ServerApp
reads) gives every simulated node the same node config in ``$FEDFM_NODE_CONFIG``
(:func:`fedfm.flower.apps.node_config`), with ``secagg-identity-dir`` naming a folder that holds
``node-<partition-id>.key`` per data owner and a file ``pins`` with every data owner's
fingerprint, as :func:`create_simulation_identities` writes it. ``identity-key`` and
``secagg-pins`` win over the folder. The run config is never read: it comes from the server.

:func:`data_owner_key_authentication` is the one function that decides; the ClientApp calls it
with its node config.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fedfm.errors import ConfigError
from fedfm.runtime.identity import Identity, create_identity_file, format_pins, parse_pins
from fedfm.runtime.settings import identity_file
from fedfm.secagg import KeyAuthentication

IDENTITY_KEY = "identity-key"
SECAGG_PINS = "secagg-pins"
SECAGG_MODE = "secagg-mode"
SIGNED, SEMI_HONEST = "signed", "semi-honest"
SECAGG_IDENTITY_DIR = "secagg-identity-dir"
PINS_FILE = "pins"

ConfigValue = int | float | str | bool


def data_owner_key_authentication(
    node_config: Mapping[str, ConfigValue],
) -> KeyAuthentication | None:
    """The data owner's SecAgg key authentication from its node config; ``None`` if it
    configures none.

    Raises
    ------
    ConfigError
        Naming the node-config key that is missing or malformed.
    """
    mode = str(node_config.get(SECAGG_MODE, SIGNED))
    if mode not in (SIGNED, SEMI_HONEST):
        raise ConfigError(f"node config {SECAGG_MODE!r} must be {SIGNED!r} or {SEMI_HONEST!r}")
    key_file, pins_text = _identity_and_pins(node_config)
    if mode == SEMI_HONEST:
        return KeyAuthentication.semi_honest(Identity.load(key_file) if key_file else None)
    if key_file is None and pins_text is None:
        return None
    if key_file is None:
        raise ConfigError(
            f"node config {SECAGG_PINS!r} is set but {IDENTITY_KEY!r} is not: SecAgg keys are "
            "signed with the data owner's identity key"
        )
    if not pins_text:
        raise ConfigError(
            f"node config {IDENTITY_KEY!r} is set but {SECAGG_PINS!r} is not: give the "
            "fingerprints of the data owners whose SecAgg keys this one accepts"
        )
    try:
        pins = parse_pins(pins_text)
    except ConfigError as error:
        raise ConfigError(f"node config {SECAGG_PINS!r}: {error}") from error
    return KeyAuthentication.signed(Identity.load(key_file), pins)


def _identity_and_pins(
    node_config: Mapping[str, ConfigValue],
) -> tuple[Path | None, str | None]:
    """The identity key file and pins text from node config, else the simulation folder."""
    key_file = Path(str(node_config[IDENTITY_KEY])) if IDENTITY_KEY in node_config else None
    pins = str(node_config[SECAGG_PINS]) if SECAGG_PINS in node_config else None
    folder = str(node_config.get(SECAGG_IDENTITY_DIR, ""))
    if (key_file is not None or pins is not None) or not folder:
        return key_file, pins
    partition = node_config.get("partition-id")
    if isinstance(partition, bool) or not isinstance(partition, int):
        raise ConfigError(
            f"node config {SECAGG_IDENTITY_DIR!r} names a folder of identities by partition, but "
            "the node config has no integer 'partition-id'"
        )
    try:
        pins = (Path(folder) / PINS_FILE).read_text().strip()
    except OSError as error:
        raise ConfigError(
            f"node config {SECAGG_IDENTITY_DIR!r}: cannot read the pins: {error}"
        ) from error
    return identity_file(Path(folder), partition), pins


def create_simulation_identities(folder: Path, count: int) -> dict[str, str]:
    """A fresh identity per data owner ``0..count-1`` in ``folder``, and the pins of all.

    Writes ``node-<k>.key`` (readable by its owner only) and ``pins``
    (``owner-<k>=<fingerprint>,...``); returns the pins. For simulation, where every data owner
    runs on this machine: the folder is the data owners' side's, named in their node config
    ``secagg-identity-dir`` by whoever starts the simulation.
    """
    if count < 1:
        raise ConfigError(f"count must be >= 1, got {count}")
    folder.mkdir(parents=True, exist_ok=True)
    pins = {f"owner-{k}": create_identity_file(identity_file(folder, k)) for k in range(count)}
    (folder / PINS_FILE).write_text(format_pins(pins) + "\n")
    return pins
