"""The runtime's end-to-end channels: what the relay sees, shared randomness, tampered, replayed,
misaddressed, reordered and dropped frames, substituted keys, payloads and frame headers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fedfm.errors import ProtocolError
from fedfm.protocols.masked_sum import masked_sum
from fedfm.runtime import (
    ChannelError,
    Identity,
    IdentityError,
    InProcessFederation,
    KeyBundle,
    pack_arrays,
    read_header,
    run_in_process,
    unpack_arrays,
)
from fedfm.runtime.messages import (
    frames_from_arrays,
)
from fedfm.secagg.channel import new_private_key, public_key_of
from tests.runtime.support import (
    WORDS,
    Relay,
    chatter,
    flip_last_byte,
    inputs,
    rewrite_frames,
    run_with,
    substitute,
    windows,
)


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
