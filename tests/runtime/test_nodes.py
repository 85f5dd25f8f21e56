"""The runtime's nodes and declarations: pins and identities, parameters, step order, placement,
node settings, and the emulated network."""

from __future__ import annotations

import stat
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.masked_sum import masked_sum
from fedfm.runtime import (
    PRESETS,
    EmulatedTransport,
    Identity,
    InProcessFederation,
    NodeRuntime,
    Protocol,
    RoleContext,
    Step,
    create_identity_file,
    fingerprint,
    format_pins,
    node_settings,
    parse_pins,
    run_in_process,
    server_settings,
    split_run_config,
)
from fedfm.runtime.messages import (
    STEP,
)
from fedfm.runtime.transport import Envelope
from tests.runtime.support import (
    WORDS,
    Relay,
    chatter,
    inputs,
    noop,
)


def test_a_site_pins_only_its_peers_and_a_pin_for_its_own_role_must_be_its_identity() -> None:
    """As on the Deployment Engine, where each site's node config pins the other roles only."""
    values = inputs(length=8)
    federation = InProcessFederation(masked_sum(), values)
    for number, node in federation.nodes.items():
        own = node.role.roles
        node.role = NodeRuntime(
            masked_sum(),
            roles=own,
            identity=federation.identities[number],
            pins={role: pin for role, pin in federation.pins.items() if role not in own},
            inputs=node.role.inputs,
        )
    result = federation.run()
    np.testing.assert_array_equal(
        result.outputs["alice"]["sum"], values["alice"]["x"] + values["bob"]["x"]
    )
    with pytest.raises(ConfigError, match=r"role 'alice' is pinned to identity .* wrong identity"):
        NodeRuntime(
            masked_sum(),
            roles=frozenset({"alice"}),
            identity=federation.identities[2],  # bob's key with alice's settings
            pins=federation.pins,
        )


def test_peers_given_different_parameters_find_out_before_sending() -> None:
    federation = InProcessFederation(chatter(words=3), WORDS)
    listener = federation.node_of("listener").role
    other = NodeRuntime(
        chatter(words=4),
        roles=listener.roles,
        identity=federation.identities[2],
        pins=listener.pins,
    )
    federation.nodes[2].role = other
    with pytest.raises(ProtocolError, match="runs another protocol description"):
        federation.run()


def test_a_node_takes_each_step_once_in_order_and_refusals_leave_its_state() -> None:
    federation = InProcessFederation(masked_sum(), inputs(length=8))
    relay = Relay(federation.transport())
    federation.run(relay)
    alice = federation.node_of("alice")
    before = alice.records

    def request(step: str) -> Envelope:
        return next(
            e for e in relay.handled if e.node_id == 1 and e.config.get("runtime.step") == step
        )

    with pytest.raises(
        ProtocolError,
        match="replayed or out-of-order step: role 'alice' was "
        "asked for step 'reveal', but its next step is 'none'",
    ):
        alice(request("reveal"))
    with pytest.raises(ProtocolError, match="a second roster in one session"):
        alice(request("mask"))  # her first step request carried the roster
    hello = next(e for e in relay.handled if e.message_type == "query.runtime_hello")
    with pytest.raises(ProtocolError, match="second hello"):
        alice(replace(hello, node_id=1))
    assert alice.records is before


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"roles": ("a", "a")}, "lists a role twice"),
        ({"roles": ("a", "b-c")}, "role name 'b-c' is not an identifier"),
        ({"channels": (("a", "a"),)}, "needs two different roles"),
        ({"channels": (("a", "z"),)}, "needs two different roles"),
        ({"steps": (Step("s", ("a",), noop), Step("s", ("b",), noop))}, "repeats a step"),
        ({"steps": (Step("s", ("z",), noop),)}, "must be taken by roles"),
    ],
)
def test_protocol_declarations_are_checked(changes, message) -> None:
    declaration = {
        "name": "p",
        "roles": ("a", "b"),
        "channels": (("a", "b"),),
        "steps": (Step("s", ("a",), noop),),
    }
    with pytest.raises(ConfigError, match=message):
        Protocol(**(declaration | changes))


def test_placement_and_routing_are_checked() -> None:
    with pytest.raises(ConfigError, match="may not play both roles of"):
        InProcessFederation(
            masked_sum(), placement=[frozenset({"alice", "carol"}), frozenset({"bob"})]
        )
    with pytest.raises(ProtocolError, match=r"no node plays the roles \['carol'\]"):
        run_in_process(masked_sum(), inputs(), placement=[frozenset({"alice"}), frozenset({"bob"})])

    def stray(context: RoleContext) -> None:
        context.send("c", {"x": np.zeros(1)})

    three = {"name": "p", "roles": ("a", "b", "c"), "channels": (("a", "b"),)}
    with pytest.raises(ProtocolError, match="declares no channel between 'a' and 'c'"):
        run_in_process(Protocol(**three, steps=(Step("s", ("a",), stray),)))
    late = Protocol(
        **(three | {"channels": (("a", "c"),)}),
        steps=(Step("s", ("a", "b"), noop), Step("t", ("a",), stray)),
    )
    with pytest.raises(ProtocolError, match=r"frames for roles \{'c': 1\} were never delivered"):
        run_in_process(late)


def test_identity_files_fingerprints_and_pins(tmp_path) -> None:
    path = tmp_path / "node.key"
    pin = create_identity_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    identity = Identity.load(path)
    assert identity.fingerprint == pin == fingerprint(identity.public_key)
    with pytest.raises(FileExistsError):
        create_identity_file(path)  # never overwrites a key
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(ConfigError, match="cannot read the identity key"):
        Identity.load(tmp_path / "junk.key")

    pins = {"alice": pin, "bob": "ab" * 32}
    assert parse_pins(format_pins(pins)) == pins
    assert parse_pins(f" alice={pin.upper()}  bob={'ab' * 32} ") == pins
    for bad, message in [("alice=12", "64 hex"), (f"alice={pin},alice={pin}", "pinned twice")]:
        with pytest.raises(ConfigError, match=message):
            parse_pins(bad)


def test_node_settings_come_from_the_node_config_alone(tmp_path) -> None:
    pin = create_identity_file(tmp_path / "node-1.key")
    np.savez(tmp_path / "bob.npz", x=np.arange(3))
    simulation = {
        "role-partitions": "alice=0,bob=1,carol=2",
        "identity-dir": str(tmp_path),
        "pins": f"alice={pin}",
        "inputs-dir": str(tmp_path),
    }
    simulated = node_settings({"partition-id": 1, "num-partitions": 3, **simulation})
    assert simulated.roles == {"bob"} and simulated.pins == {"alice": pin}
    assert simulated.identity().fingerprint == pin
    np.testing.assert_array_equal(simulated.load_inputs("bob")["x"], np.arange(3))
    assert simulated.load_inputs("carol") == {}

    deployed = node_settings(
        {"roles": "carol", "identity-key": str(tmp_path / "node-1.key"), "pins": f"bob={pin}"}
    )
    assert deployed.roles == {"carol"} and deployed.pins == {"bob": pin}
    assert node_settings({"partition-id": 7, **simulation}).identity() is None  # no role: no key
    with pytest.raises(ConfigError, match="no identity key"):
        node_settings({"roles": "carol"}).identity()
    with pytest.raises(ConfigError, match="no integer 'partition-id'"):
        node_settings({"role-partitions": "carol=2"})
    # a node without pins has none: it can verify nobody (see the red-team test of the relay)
    assert node_settings({"roles": "carol"}).pins == {}
    for key in ("roles", "pins", "identity-dir", "inputs-dir"):  # the relay's run config cannot
        with pytest.raises(ConfigError, match=f"'{key}'.*refused.*node config"):
            split_run_config({key: "x", "timeout": 5})

    runtime, protocol = split_run_config({"timeout": 5, "layers": 4})
    assert runtime["timeout"] == 5.0 and protocol == {"layers": 4}
    with pytest.raises(ConfigError, match="'num-nodes' must be int"):
        split_run_config({"num-nodes": "3"})
    settings = server_settings({"timeout": 0.0, "results-file": "r.json"}, masked_sum())
    assert (settings.num_nodes, settings.timeout, settings.results_file) == (
        3,
        None,
        Path("r.json"),
    )


def test_emulated_network_accounts_time_without_sleeping() -> None:
    assert (PRESETS["lan"].rtt_seconds, PRESETS["lan"].bandwidth_bits_per_second) == (0.8e-3, 3e9)
    assert (PRESETS["wan"].rtt_seconds, PRESETS["wan"].bandwidth_bits_per_second) == (80e-3, 1e8)
    assert PRESETS["rtt-1ms"].rtt_seconds == 1e-3 and PRESETS["rtt-10ms"].rtt_seconds == 10e-3

    def answer(size: int):
        return lambda e: Envelope(STEP, e.node_id, 0, {"r": np.zeros(size, np.uint8)})

    transport = EmulatedTransport({1: answer(500_000), 2: answer(10)})
    requests = [Envelope(STEP, 1, 0, {"q": np.zeros(1_000_000, np.uint8)}), Envelope(STEP, 2, 0)]
    slept: list[float] = []
    with pytest.MonkeyPatch.context() as patch:  # simulated time, never slept
        patch.setattr(time, "sleep", slept.append)
        transport.send_and_receive(requests)
    assert slept == []
    # the slower of the two nodes: 1.5 MB through its link
    assert transport.network_seconds["wan"] == pytest.approx(0.08 + 8 * 1.5e6 / 1e8)
    assert transport.network_seconds["lan"] == pytest.approx(0.8e-3 + 8 * 1.5e6 / 3e9)
    assert transport.network_seconds["rtt-10ms"] == pytest.approx(0.01)
    for name, seconds in transport.network_seconds.items():
        assert seconds < transport.projected_seconds[name] < seconds + 0.08

    federation = InProcessFederation(masked_sum(), inputs(length=8))
    emulated = EmulatedTransport(federation.nodes)
    federation.run(emulated)
    assert emulated.network_seconds["rtt-10ms"] == pytest.approx(4 * 0.01)  # 4 round trips
