"""A double-blind data owner's SecAgg identity and pins: from its own side, never the server."""

from __future__ import annotations

import numpy as np
import pytest

from fedfm.crypto import SimulateBackend
from fedfm.errors import ConfigError
from fedfm.protocols.double_blind.client import ClientData, ClientState, DoubleBlindClient
from fedfm.protocols.double_blind.config import TRAIN_SECAGG
from fedfm.protocols.double_blind.identities import (
    SECAGG_IDENTITY_DIR,
    create_simulation_identities,
    data_owner_key_authentication,
)
from fedfm.runtime import create_identity_file, format_pins
from fedfm.runtime.identity import Identity
from fedfm.runtime.transport import Envelope


@pytest.fixture()
def site(tmp_path):
    """A data owner's identity file and the fingerprints of two other data owners."""
    own = create_identity_file(tmp_path / "me.key")
    others = {f"owner-{k}": create_identity_file(tmp_path / f"{k}.key") for k in (1, 2)}
    return tmp_path / "me.key", own, others


def test_node_config_gives_the_identity_and_pins(site) -> None:
    key, _, others = site
    config = {"identity-key": str(key), "secagg-pins": format_pins(others)}
    chosen = data_owner_key_authentication(config)
    assert chosen is not None and chosen.mode == "signed"
    assert chosen.signer is not None and Identity.load(key).public_key == chosen.signer.public_key
    assert dict(chosen.pinned) == {pin: name for name, pin in others.items()}
    # semi-honest only when the data owner says so, and then it still signs its own keys
    honest_but = data_owner_key_authentication({**config, "secagg-mode": "semi-honest"})
    assert honest_but is not None and honest_but.mode == "semi-honest"
    assert honest_but.signer is not None
    assert data_owner_key_authentication({"secagg-mode": "semi-honest"}).signer is None
    # nothing configured: no choice (the client then refuses the SecAgg stages)
    assert data_owner_key_authentication({"partition-id": 0}) is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"secagg-pins": "a=" + "ab" * 32}, "'secagg-pins' is set but 'identity-key' is not"),
        ({"identity-key": "KEY"}, "'identity-key' is set but 'secagg-pins' is not"),
        ({"identity-key": "KEY", "secagg-pins": "a=12"}, "node config 'secagg-pins': pin"),
        ({"secagg-mode": "trusting"}, "'secagg-mode' must be 'signed' or 'semi-honest'"),
        ({"identity-key": "/nonexistent", "secagg-pins": "a=" + "ab" * 32}, "cannot read"),
    ],
)
def test_bad_node_config_is_named(site, config, message) -> None:
    key, _, _ = site
    if config.get("identity-key") == "KEY":
        config = {**config, "identity-key": str(key)}
    with pytest.raises(ConfigError, match=message):
        data_owner_key_authentication(config)


def test_simulation_reads_the_folder_its_side_named_and_own_keys_win(tmp_path, site) -> None:
    folder = tmp_path / "owners"
    pins = create_simulation_identities(folder, 3)
    assert sorted(pins) == ["owner-0", "owner-1", "owner-2"]
    assert (folder / "node-1.key").stat().st_mode & 0o077 == 0
    simulated = {SECAGG_IDENTITY_DIR: str(folder)}  # every simulated node's own config
    chosen = data_owner_key_authentication({"partition-id": 1, **simulated})
    assert chosen is not None and chosen.signer is not None
    assert chosen.signer.public_key == Identity.load(folder / "node-1.key").public_key
    assert set(chosen.pinned) == set(pins.values())
    semi = data_owner_key_authentication(
        {"partition-id": 1, **simulated, "secagg-mode": "semi-honest"}
    )
    assert semi is not None and semi.mode == "semi-honest"
    key, _, others = site
    own = {"identity-key": str(key), "secagg-pins": format_pins(others), "partition-id": 1}
    chosen = data_owner_key_authentication({**simulated, **own})
    assert chosen is not None and set(chosen.pinned) == set(others.values())
    with pytest.raises(ConfigError, match="no integer 'partition-id'"):
        data_owner_key_authentication(simulated)


def test_a_client_without_a_choice_refuses_secure_aggregation_naming_the_keys() -> None:
    data = ClientData(
        train_images=np.zeros((2, 3, 4, 4), np.float32),
        train_labels=np.array([0, 1]),
        eval_images=np.zeros((0, 3, 4, 4), np.float32),
        eval_labels=np.zeros(0, np.int64),
        num_classes=2,
    )
    client = DoubleBlindClient(data, SimulateBackend())
    with pytest.raises(ConfigError, match="set node config 'identity-key' and 'secagg-pins'"):
        client.handle(Envelope(TRAIN_SECAGG, 3, 1), ClientState(stage="trained", round=1))
