"""The multi-party runtime: channels, pinning, shared randomness, accounting, Flower apps."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from uuid import uuid4

import numpy as np
import pytest
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
)
from flwr.serverapp import Grid

from fedfm.cli import main as cli_main
from fedfm.errors import ConfigError, ProtocolError
from fedfm.flower.codec import to_array_record
from fedfm.protocols.masked_sum import masked_sum
from fedfm.runtime import (
    PRESETS,
    ChannelError,
    EmulatedTransport,
    Identity,
    IdentityError,
    InProcessFederation,
    KeyBundle,
    NodeRuntime,
    NodeState,
    Protocol,
    RoleContext,
    Step,
    create_identity_file,
    fingerprint,
    format_pins,
    node_settings,
    pack_arrays,
    parse_pins,
    read_header,
    run_in_process,
    server_settings,
    split_run_config,
    unpack_arrays,
)
from fedfm.runtime.messages import (
    STEP,
    bundle_from_config,
    bundle_to_config,
    frames_from_arrays,
    frames_to_arrays,
)
from fedfm.runtime.settings import RUN_CONFIG_DEFAULTS
from fedfm.runtime.transport import Envelope, Failure, Transport
from fedfm.secagg.channel import new_private_key, public_key_of
from fedfm_clients.masked_sum import app as masked_sum_client
from fedfm_clients.runtime import load_state, save_state
from fedfm_strategies.aggregation import task_identity
from fedfm_strategies.runtime import run_on_grid

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "simulations" / "runtime_demo"


def inputs(length: int = 64, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {role: {"x": rng.integers(-(2**40), 2**40, length)} for role in ("alice", "bob")}


class Relay:
    """A transport in the relay's seat: it records every envelope it handles, both ways, and
    may rewrite requests on their way to a node (a relay that tampers)."""

    def __init__(
        self, inner: Transport, rewrite: Callable[[Envelope], Envelope] | None = None
    ) -> None:
        self.inner, self.rewrite = inner, rewrite
        self.handled: list[Envelope] = []

    def send_and_receive(
        self, envelopes: Iterable[Envelope], *, timeout: float | None = None
    ) -> list[Envelope | Failure]:
        envelopes = [self.rewrite(e) if self.rewrite else e for e in envelopes]
        replies = self.inner.send_and_receive(envelopes, timeout=timeout)
        self.handled += envelopes + [r for r in replies if isinstance(r, Envelope)]
        return replies

    def seen(self) -> bytes:
        """Every byte of every array and config value the relay handled."""
        parts = []
        for envelope in self.handled:
            parts += [array.tobytes() for array in envelope.arrays.values()]
            parts += [
                str(v).encode() if not isinstance(v, bytes) else v for v in envelope.config.values()
            ]
        return b"\x00".join(parts)


def rewrite_frames(step: str, node: int, change: Callable[[list[bytes]], list[bytes]]):
    """A relay rewrite that changes the frames of ``step``'s request to ``node``."""

    def rewrite(envelope: Envelope) -> Envelope:
        if envelope.config.get("runtime.step") != step or envelope.node_id != node:
            return envelope
        arrays = {k: v for k, v in envelope.arrays.items() if not k.startswith("frame.")}
        arrays |= frames_to_arrays(change(frames_from_arrays(envelope.arrays)))
        return replace(envelope, arrays=arrays)

    return rewrite


# -- the example protocol in-process ------------------------------------------------------------


def test_masked_sum_publishes_the_exact_sum_and_counts_traffic_per_role_pair() -> None:
    values = inputs()
    federation = InProcessFederation(masked_sum(), values)
    result = federation.run()
    total = result.outputs["alice"]["sum"]
    assert total.dtype == np.int64
    np.testing.assert_array_equal(total, values["alice"]["x"] + values["bob"]["x"])
    assert set(result.outputs) == {"alice"}
    assert result.placement == {"alice": 1, "bob": 2, "carol": 3}
    assert result.fingerprints == federation.pins

    traffic = result.traffic
    assert traffic.round_trips == 4  # hello + mask + sum + reveal
    assert set(traffic.pairs) == {("alice", "carol"), ("bob", "carol"), ("carol", "alice")}
    for pair in traffic.pairs.values():
        # one frame each, sent in one round trip and delivered in the next
        assert (pair.messages, pair.round_trips) == (1, 2)
        assert 64 * 8 < pair.bytes < 64 * 8 + 200  # the vector plus a constant overhead
    assert {node: link.round_trips for node, link in traffic.nodes.items()} == {1: 3, 2: 2, 3: 2}


def test_roles_that_may_share_a_node_do() -> None:
    values = inputs(length=5)
    result = run_in_process(
        masked_sum(), values, placement=[frozenset({"alice", "bob"}), frozenset({"carol"})]
    )
    assert result.placement == {"alice": 1, "bob": 1, "carol": 2}
    np.testing.assert_array_equal(
        result.outputs["alice"]["sum"], values["alice"]["x"] + values["bob"]["x"]
    )


def windows(data: bytes, width: int = 32) -> list[bytes]:
    return [data[i : i + width] for i in range(0, len(data) - width + 1, 8)]


def test_the_relay_sees_no_plaintext_payload_and_no_secret() -> None:
    values = inputs(length=64)
    federation = InProcessFederation(masked_sum(), values)
    relay = Relay(federation.transport())
    result = federation.run(relay)
    seen = relay.seen()

    # what travelled inside the channels, recomputed from alice's and bob's shared randomness
    alice = federation.node_of("alice")
    channels = alice.role.channels(alice.state)
    x_a, x_b = (values[role]["x"].view(np.uint64) for role in ("alice", "bob"))
    pad = channels.shared_mask("alice", "bob", "pad", 64)
    order = channels.shared_generator("alice", "bob", "order").permutation(64)
    travelled = [x_a, x_b, pad, (x_a + pad)[order], (x_b - pad)[order], (x_a + x_b)[order]]
    for plaintext in travelled:
        assert plaintext.tobytes() not in seen
        assert not any(window in seen for window in windows(plaintext.tobytes()))
    for node in federation.nodes.values():  # nor any node's session private key
        assert node.state.private_key not in seen
    # the one thing alice chose to publish does reach the relay
    assert result.outputs["alice"]["sum"].tobytes() in seen


def test_shared_randomness_belongs_to_the_pair_alone() -> None:
    federation = InProcessFederation(masked_sum(), inputs(length=4))
    federation.run()
    ends = {role: federation.node_of(role) for role in ("alice", "bob", "carol")}
    channels = {role: node.role.channels(node.state) for role, node in ends.items()}

    pad = channels["alice"].shared_mask("alice", "bob", "pad", 16)
    np.testing.assert_array_equal(pad, channels["bob"].shared_mask("bob", "alice", "pad", 16))
    assert pad.dtype == np.uint64 and len(set(pad.tolist())) == 16
    assert not np.array_equal(pad, channels["alice"].shared_mask("alice", "bob", "other", 16))
    draw = channels["alice"].shared_generator("alice", "bob", "scramble").standard_normal(8)
    again = channels["bob"].shared_generator("bob", "alice", "scramble").standard_normal(8)
    np.testing.assert_array_equal(draw, again)
    # carol shares other randomness with alice, and none with the alice-bob pair
    carol = channels["carol"].shared_generator("carol", "alice", "scramble").standard_normal(8)
    assert not np.allclose(carol, draw)
    with pytest.raises(ProtocolError, match="does not host role 'alice'"):
        channels["carol"].shared_mask("alice", "bob", "pad", 16)


# -- a relay that misbehaves ----------------------------------------------------------------


def run_with(
    rewrite: Callable[[Envelope], Envelope], federation: InProcessFederation | None = None
):
    federation = federation or InProcessFederation(masked_sum(), inputs(length=8))
    return federation.run(Relay(federation.transport(), rewrite))


def flip_last_byte(frames: list[bytes]) -> list[bytes]:
    return [frames[0][:-1] + bytes([frames[0][-1] ^ 1]), *frames[1:]]


def test_a_tampered_frame_is_rejected() -> None:
    with pytest.raises(
        ProtocolError,
        match=r"node 3 \(carol\): ChannelError: tampered message: "
        r"message 0 from 'alice' to 'carol' \(step 'mask'\) failed authentication",
    ):
        run_with(rewrite_frames("sum", 3, flip_last_byte))
    # the cleartext header is authenticated too: a relay that relabels the step is caught
    relabel = rewrite_frames("sum", 3, lambda f: [f[0].replace(b"mask", b"musk", 1), *f[1:]])
    with pytest.raises(ProtocolError, match="tampered message"):
        run_with(relabel)


def test_a_replayed_frame_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="replayed message: message 0 from 'alice' to 'carol'"):
        run_with(rewrite_frames("sum", 3, lambda frames: [*frames, frames[0]]))


def test_a_misaddressed_frame_is_rejected() -> None:
    """The relay hands alice, in her reveal step, the frame alice sent carol."""
    kept: list[bytes] = []

    def keep(frames: list[bytes]) -> list[bytes]:
        kept.extend(frames)
        return frames

    deliver_to_sum, deliver_to_reveal = (
        rewrite_frames("sum", 3, keep),
        rewrite_frames("reveal", 1, lambda frames: [*frames, kept[0]]),
    )
    with pytest.raises(
        ProtocolError,
        match=r"misaddressed message: message 0 from 'alice' to 'carol' \(step 'mask'\) was "
        r"delivered to a node hosting \['alice'\]",
    ):
        run_with(lambda envelope: deliver_to_reveal(deliver_to_sum(envelope)))


def talk(context: RoleContext) -> None:
    said = context.input("words")
    context.state["said"] = said
    for word in said:
        context.send("listener", {"word": np.array(word)})


def listen(context: RoleContext) -> None:
    heard = np.array([m.arrays["word"] for m in context.inbox if m.sender == "speaker"])
    context.send("speaker", {"heard": heard})


def check(context: RoleContext) -> None:
    heard = context.receive("listener")["heard"]
    context.publish("faithful", np.array(np.array_equal(heard, context.state["said"])))


def chatter(**parameters) -> Protocol:
    """Two roles; several frames on one channel, state kept between a role's steps."""
    return Protocol(
        name="chatter",
        roles=("speaker", "listener"),
        channels=(("speaker", "listener"),),
        steps=(
            Step("talk", ("speaker",), talk),
            Step("listen", ("listener",), listen),
            Step("check", ("speaker",), check),
        ),
        parameters=parameters,
    )


WORDS = {"speaker": {"words": np.arange(3)}}


def test_frames_arrive_in_order_and_role_state_persists() -> None:
    result = run_in_process(chatter(), WORDS)
    assert result.outputs == {"speaker": {"faithful": np.array(True)}}
    assert result.traffic.pairs[("speaker", "listener")].messages == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda frames: [frames[1], frames[0], frames[2]], "message 1 .* while message 0"),
        (lambda frames: frames[1:], "message 1 .* while message 0"),  # dropped
    ],
    ids=["reordered", "dropped"],
)
def test_reordered_and_dropped_frames_are_rejected(change, message) -> None:
    federation = InProcessFederation(chatter(), WORDS)
    with pytest.raises(ProtocolError, match=f"out-of-order message: {message}"):
        run_with(rewrite_frames("listen", 2, change), federation)


def substitute(bundle_index: int, forge: Callable[[KeyBundle, bytes], KeyBundle]):
    """A relay rewrite that replaces one bundle of every roster it hands out by
    ``forge(bundle, session)`` (the session id is in every request: the relay knows it)."""

    def rewrite(envelope: Envelope) -> Envelope:
        prefix = f"roster.{bundle_index}"
        if f"{prefix}.roles" not in envelope.config:
            return envelope
        bundle = bundle_from_config(envelope.config, prefix)
        forged = forge(bundle, envelope.config["runtime.session"])
        return replace(envelope, config=envelope.config | bundle_to_config(forged, prefix))

    return rewrite


def test_a_substituted_public_key_is_detected() -> None:
    relay_identity = Identity.generate()
    relay_key = public_key_of(new_private_key())  # the relay's own X25519 key

    def own_bundle(bundle: KeyBundle, session: bytes) -> KeyBundle:
        return KeyBundle.signed(
            relay_identity, bundle.roles, relay_key, bundle.protocol_digest, session
        )

    def swapped_key(bundle: KeyBundle, session: bytes) -> KeyBundle:  # alice's signature kept
        return replace(bundle, session_key=relay_key)

    # the roster lists the nodes' bundles in node id order; alice is on node 1 (bundle 0), and
    # bob, who shares randomness with her, is the first to check it
    with pytest.raises(
        ProtocolError,
        match=r"node 2 \(bob\): IdentityError: substituted key: "
        r"role 'alice' is pinned to identity",
    ):
        run_with(substitute(0, own_bundle))
    with pytest.raises(ProtocolError, match="offered for role 'alice' is not signed by its pinned"):
        run_with(substitute(0, swapped_key))

    # a node given no pin for a peer refuses to talk to it
    federation = InProcessFederation(masked_sum(), inputs(length=8))
    carol = federation.node_of("carol").role
    carol.pins.pop("bob")
    with pytest.raises(ProtocolError, match="no identity fingerprint is pinned for role 'bob'"):
        federation.run()


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


# -- declarations and placement ---------------------------------------------------------------


def noop(context: RoleContext) -> None:
    del context


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


# -- building blocks ------------------------------------------------------------------------


def test_payloads_round_trip_without_pickles() -> None:
    arrays = {
        "scalar": np.array(2.5),
        "flags": np.array([True, False]),
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "transposed": np.arange(6.0).reshape(2, 3).T,
        "empty": np.zeros((0, 3), dtype=np.complex64),
    }
    back = unpack_arrays(pack_arrays(arrays))
    assert list(back) == list(arrays)
    for name, array in arrays.items():
        assert (back[name].dtype, back[name].shape) == (array.dtype, array.shape)
        np.testing.assert_array_equal(back[name], array)
    with pytest.raises(ProtocolError, match="numeric and bool"):
        pack_arrays({"objects": np.array([{}], dtype=object)})
    packed = pack_arrays({"x": np.arange(3)})
    for damaged in (packed[:-1], packed + b"\x00", b"junk" + packed[4:]):
        with pytest.raises(ProtocolError, match="malformed payload"):
            unpack_arrays(damaged)


def test_channel_errors_are_protocol_errors_naming_the_problem() -> None:
    federation = InProcessFederation(masked_sum(), inputs(length=4))
    federation.run()
    alice, carol = (federation.node_of(role) for role in ("alice", "carol"))
    sender = alice.role.channels(alice.state)
    first, second = (sender.seal("alice", "carol", "extra", bytes([n]) * 8) for n in range(2))
    assert read_header(second)[0].sequence == read_header(first)[0].sequence + 1

    def receiver():  # carol as her node's state stands (every check starts from there)
        return carol.role.channels(carol.state)

    cases = [
        (
            first[:-1] + bytes([first[-1] ^ 1]),
            "tampered message: message 1 from 'alice' to 'carol'",
        ),
        (b"junk", "malformed frame"),
        (second, "out-of-order message: message 2 .* while message 1 was expected"),
        (sender.seal("alice", "bob", "extra", b"x"), "misaddressed message"),
    ]
    for frame, problem in cases:
        with pytest.raises(ChannelError, match=problem):
            receiver().open(frame)
    channels = receiver()
    assert channels.open(first).plaintext == bytes(8)
    with pytest.raises(ChannelError, match="replayed message: message 1"):
        channels.open(first)
    assert issubclass(ChannelError, ProtocolError) and issubclass(IdentityError, ChannelError)


def test_frame_headers_carry_the_routing_and_sequence_numbers() -> None:
    federation = InProcessFederation(chatter(), WORDS)
    relay = Relay(federation.transport())
    federation.run(relay)
    listen_request = next(e for e in relay.handled if e.config.get("runtime.step") == "listen")
    headers = [read_header(frame)[0] for frame in frames_from_arrays(listen_request.arrays)]
    assert [(h.sender, h.receiver, h.step, h.sequence) for h in headers] == [
        ("speaker", "listener", "talk", n) for n in range(3)
    ]


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


def test_node_settings_come_from_node_config_first(tmp_path) -> None:
    pin = create_identity_file(tmp_path / "node-1.key")
    np.savez(tmp_path / "bob.npz", x=np.arange(3))
    run_config = {
        "role-partitions": "alice=0,bob=1,carol=2",
        "identity-dir": str(tmp_path),
        "pins": f"alice={pin}",
        "inputs-dir": str(tmp_path),
    }
    simulated = node_settings({"partition-id": 1, "num-partitions": 3}, run_config)
    assert simulated.roles == {"bob"} and simulated.pins == {"alice": pin}
    assert simulated.identity().fingerprint == pin
    np.testing.assert_array_equal(simulated.load_inputs("bob")["x"], np.arange(3))
    assert simulated.load_inputs("carol") == {}

    deployed = node_settings(
        {"roles": "carol", "identity-key": str(tmp_path / "node-1.key"), "pins": f"bob={pin}"},
        run_config,
    )
    assert deployed.roles == {"carol"} and deployed.pins == {"bob": pin}
    assert node_settings({"partition-id": 7}, run_config).identity() is None  # no role: no key
    with pytest.raises(ConfigError, match="no identity key"):
        node_settings({"roles": "carol"}, {}).identity()

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
    started = time.perf_counter()
    requests = [Envelope(STEP, 1, 0, {"q": np.zeros(1_000_000, np.uint8)}), Envelope(STEP, 2, 0)]
    transport.send_and_receive(requests)
    assert time.perf_counter() - started < 0.08  # well under one simulated WAN round trip
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


def test_bench_runtime_writes_json_and_markdown(tmp_path, capsys) -> None:
    arguments = ["bench-runtime", "--sizes", "256", "4096", "--repeats", "2"]
    arguments += ["--vector-length", "8", "--results-dir", str(tmp_path)]
    assert cli_main(arguments) == 0
    payload = json.loads((tmp_path / "runtime_channel.json").read_text())
    rows = payload["rows"]
    assert [row["payload_bytes"] for row in rows] == [256, 4096]
    for row in rows:
        assert row["plain_bytes"] == row["payload_bytes"]
        # nonce and tag, frame header, array header: constant, not proportional
        assert 28 < row["overhead_bytes"] < 160
        assert row["wan_channel_ms"] > row["wan_plain_ms"] > 80
    assert payload["masked_sum"]["round_trips"] == 4
    assert payload["command"].startswith("fedfm bench-runtime --sizes 256 4096")
    markdown = (tmp_path / "runtime_channel.md").read_text()
    assert "| payload (B) |" in markdown and "Regenerate: `fedfm bench-runtime" in markdown
    assert "regenerate with: fedfm bench-runtime" in capsys.readouterr().out


# -- Flower ---------------------------------------------------------------------------------


def load_demo():
    """``simulations/runtime_demo/run.py`` (its workspace preparation)."""
    spec = importlib.util.spec_from_file_location("runtime_demo_run", DEMO / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_app_declares_the_components_and_every_default() -> None:
    flwr = tomllib.loads((DEMO / "pyproject.toml").read_text())["tool"]["flwr"]
    assert flwr["app"]["components"] == {
        "serverapp": "fedfm_strategies.masked_sum:app",
        "clientapp": "fedfm_clients.masked_sum:app",
    }
    assert flwr["app"]["config"] == RUN_CONFIG_DEFAULTS


def wire(message: Message) -> Message:
    """The message as the receiving end gets it (Flower's protobuf form and back)."""
    return message_from_proto(message_to_proto(message))


class LoopbackGrid(Grid):
    """Delivers every message to its node's ClientApp in this process, in Flower's wire form,
    and keeps the wire bytes of everything it carried (the relay's view)."""

    def __init__(self, contexts: dict[int, Context], rewrite=None) -> None:
        self.contexts, self.rewrite = contexts, rewrite or (lambda message: message)
        self.replies: dict[str, Message] = {}
        self.carried: list[bytes] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid4().hex  # as Flower's InMemoryGrid
            received = wire(self.rewrite(message))
            self.carried.append(message_to_proto(received).SerializeToString())
            try:
                reply = masked_sum_client(received, self.contexts[received.metadata.dst_node_id])
            except Exception as error:  # Flower's runtimes turn these into error replies
                reply = Message(
                    Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(error)), reply_to=received
                )
            reply = wire(reply)
            self.carried.append(message_to_proto(reply).SerializeToString())
            self.replies[received.metadata.message_id] = reply
            ids.append(received.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def _unused(self, *_, **__):
        raise NotImplementedError

    set_run = create_message = send_and_receive = _unused
    run = property(_unused)


@pytest.fixture
def demo_workspace(tmp_path) -> tuple[Path, dict[str, str]]:
    workspace = tmp_path / "workspace"
    return workspace, load_demo().prepare(workspace, length=16, seed=3)


def flower_contexts(run_config: dict[str, str]) -> dict[int, Context]:
    # node ids unrelated to the partitions, as in Flower
    return {
        9000 - 17 * k: Context(
            run_id=1,
            node_id=9000 - 17 * k,
            node_config={"partition-id": k, "num-partitions": 3},
            state=RecordDict(),
            run_config=run_config,
        )
        for k in range(3)
    }


def demo_inputs(workspace: Path) -> dict[str, dict[str, np.ndarray]]:
    return {
        role: {"x": np.load(workspace / "inputs" / f"{role}.npz")["x"]} for role in ("alice", "bob")
    }


def test_flower_apps_over_flower_messages_equal_the_in_process_run(demo_workspace) -> None:
    workspace, run_config = demo_workspace
    grid = LoopbackGrid(flower_contexts(run_config))
    with task_identity():
        result = run_on_grid(grid, masked_sum, run_config, log=lambda _: None)
    expected = run_in_process(masked_sum(), demo_inputs(workspace))
    assert result.to_dict()["outputs"] == expected.to_dict()["outputs"]
    assert result.traffic.to_dict()["pairs"] == expected.traffic.to_dict()["pairs"]
    assert {
        role: grid.contexts[node].node_config["partition-id"]
        for role, node in result.placement.items()
    } == {"alice": 0, "bob": 1, "carol": 2}
    assert json.loads((workspace / "result.json").read_text()) == json.loads(
        json.dumps(result.to_dict())
    )

    carried = b"\x00".join(grid.carried)
    for values in demo_inputs(workspace).values():
        assert values["x"].tobytes() not in carried
    for context in grid.contexts.values():  # the session keys stayed in context.state
        private_key = load_state(context.state).private_key
        assert len(private_key) == 32 and private_key not in carried
        assert private_key in context_to_proto(context).SerializeToString()


def test_flower_client_app_refuses_a_tampered_frame_and_keeps_its_state(demo_workspace) -> None:
    _, run_config = demo_workspace
    contexts = flower_contexts(run_config)
    carol = next(c for c in contexts.values() if c.node_config["partition-id"] == 2)
    states = []

    def tamper(message: Message) -> Message:
        content = message.content
        if message.metadata.dst_node_id == carol.node_id and "fedfm.arrays" in content:
            arrays = {k: v.numpy() for k, v in content["fedfm.arrays"].items()}
            if "frame.0" in arrays:
                states.append(context_to_proto(carol).SerializeToString())
                arrays["frame.0"] = arrays["frame.0"].copy()
                arrays["frame.0"][-1] ^= 1
                content["fedfm.arrays"] = to_array_record(arrays)
        return message

    with task_identity(), pytest.raises(ProtocolError, match="ChannelError: tampered message"):
        run_on_grid(LoopbackGrid(contexts, tamper), masked_sum, run_config, log=lambda _: None)
    assert states == [context_to_proto(carol).SerializeToString()]


def test_node_state_round_trips_through_context_state() -> None:
    state = NodeState(
        session=b"s" * 16,
        private_key=b"k" * 32,
        session_keys={"alice": b"a" * 32, "carol": b"c" * 32},
        sent={("alice", "carol"): 2},
        received={("carol", "alice"): 1},
        next_step={"alice": 3},
        role_state={"alice": {"said": np.arange(3), "scale": np.array(0.5)}},
    )
    record_dict = RecordDict()
    assert load_state(record_dict) == NodeState()
    save_state(state, record_dict)
    context = Context(1, 1, {}, record_dict, {})
    restored = load_state(context_from_proto(context_to_proto(context)).state)
    assert replace(restored, role_state={}) == replace(state, role_state={})
    for name, value in state.role_state["alice"].items():
        np.testing.assert_array_equal(restored.role_state["alice"][name], value)


def processes_with(marker: str) -> list[str]:
    """Live processes whose environment contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
    return found


def test_flwr_run_simulation_equals_the_in_process_run(tmp_path) -> None:
    workspace = tmp_path / "workspace"
    completed = subprocess.run(
        [sys.executable, str(DEMO / "run.py"), "--workspace", str(workspace), "--length", "16"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "flwr run: finished:completed; SuperLink stopped" in output
    assert "the sum of the two vectors" in output
    assert processes_with(f"FLWR_HOME={workspace / 'flwr-home'}") == []

    ours = json.loads((workspace / "result.json").read_text())
    expected = run_in_process(masked_sum(), demo_inputs(workspace)).to_dict()
    assert ours["outputs"] == json.loads(json.dumps(expected["outputs"]))
    assert ours["traffic"]["pairs"] == expected["traffic"]["pairs"]
    assert ours["traffic"]["round_trips"] == 4
