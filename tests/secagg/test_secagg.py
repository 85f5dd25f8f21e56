"""Secure aggregation (SecAgg+): correctness, dropouts, what the server sees, refusals, encoding."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.secure_aggregation import run_in_process
from fedfm.secagg import (
    ADVERTISE_KEYS,
    COLLECT_MASKED_INPUT,
    SHARE_KEYS,
    UNMASK,
    AdvertiseKeysReply,
    AdvertiseKeysRequest,
    ArrayLayout,
    ClientSecAggState,
    ClientUpdate,
    MaskedInputReply,
    MaskedInputRequest,
    Quantizer,
    SecAggServer,
    ShareKeysReply,
    ShareKeysRequest,
    UnmaskReply,
    UnmaskRequest,
    collect_masked_input,
    decode_reply,
    decode_request,
    expand_mask,
    handle,
    harary_graph,
    neighbour_degree,
    random_neighbour_graph,
    share_keys,
    unmask,
)
from fedfm.secagg.messages import CIPHERTEXT_BYTES
from fedfm.secagg.sharing import SHARE_BYTES
from tests.secagg.support import (
    CLIP,
    SHAPES,
    InProcessRound,
    assert_is_average_of,
    bound,
    config,
    make_updates,
)


# -- the aggregate ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("count", "num_neighbours", "shapes"),
    [
        (3, None, SHAPES),
        (10, 4, SHAPES),
        (50, None, {"adapter.down": (5,), "head.weight": (2, 3)}),
        (50, 6, {"adapter.down": (5,), "head.weight": (2, 3)}),
    ],
)
def test_aggregate_is_the_weighted_average(count, num_neighbours, shapes):
    settings = config(num_neighbours=num_neighbours)
    updates = make_updates(count, shapes=shapes, seed=count)
    result = run_in_process(settings, updates, round_id=7)
    assert_is_average_of(result, updates, updates, settings)
    assert result.dropouts == {}
    # The check can fail: the unweighted mean is further away than the bound.
    unweighted = np.mean([u.arrays["head.weight"] for u in updates.values()], axis=0)
    assert np.max(np.abs(result.arrays["head.weight"] - unweighted)) > bound(settings)


def test_sparse_graph_gives_each_client_k_neighbours_not_everyone():
    updates = make_updates(10)
    run = InProcessRound(config(num_neighbours=4), updates)
    run.run_stage()  # advertise_keys: the graph is drawn over the clients that answered
    assert run.server.threshold == 3
    assert {len(peers) for peers in run.server.graph.values()} == {4}
    for request in run.pending.values():
        assert len(request.neighbours) == 4
    run.run()


# -- dropouts -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("stage", "included_after_drop"),
    [
        (ADVERTISE_KEYS, False),  # never answers
        (SHARE_KEYS, False),  # answered advertise_keys, then gone
        (COLLECT_MASKED_INPUT, False),  # shared its keys, sent no masked input
        (UNMASK, True),  # sent its masked input, gone before unmask: still in the sum
    ],
)
@pytest.mark.parametrize("num_neighbours", [None, 4])
def test_a_dropout_at_any_stage_leaves_a_correct_aggregate(
    stage, included_after_drop, num_neighbours
):
    settings = config(num_neighbours=num_neighbours)
    updates = make_updates(10, seed=3)
    dropped = sorted(updates)[4]
    result = run_in_process(settings, updates, dropouts={stage: [dropped]})
    included = [n for n in updates if n != dropped or included_after_drop]
    assert_is_average_of(result, updates, included, settings)
    assert result.dropouts == {dropped: f"{stage}: no reply before the timeout"}


def test_dropouts_at_every_stage_in_one_round():
    settings = config()  # complete graph on 10: t = 5
    updates = make_updates(10, seed=4)
    ids = sorted(updates)
    dropouts = {ADVERTISE_KEYS: [ids[0]], SHARE_KEYS: [ids[1]], COLLECT_MASKED_INPUT: [ids[2]]}
    dropouts[UNMASK] = [ids[3]]  # 6 answer unmask: each survivor's seed has 5 holders left
    result = run_in_process(settings, updates, dropouts=dropouts)
    assert_is_average_of(result, updates, ids[3:], settings)
    assert set(result.dropouts) == set(ids[:4])


def test_too_many_dropouts_before_masking_fail_with_min_clients():
    updates = make_updates(4)
    with pytest.raises(
        ProtocolError, match=r"only 1 clients remain after advertise_keys, fewer than min_clients=2"
    ):
        run_in_process(config(), updates, dropouts={ADVERTISE_KEYS: sorted(updates)[:3]})


def test_too_many_dropouts_after_masking_name_the_node_and_share_counts():
    updates = make_updates(5)  # complete graph: 4 neighbours each, t = 3
    ids = sorted(updates)
    with pytest.raises(
        ProtocolError, match=r"node \d+: needs 3 shares, but only 2 of its neighbours"
    ):
        run_in_process(config(), updates, dropouts={COLLECT_MASKED_INPUT: ids[:2]})


def test_too_many_dropouts_during_unmask_name_the_node_and_share_counts():
    updates = make_updates(5)
    ids = sorted(updates)
    run = InProcessRound(config(), updates, dropouts={UNMASK: ids[:2]})
    with pytest.raises(
        ProtocolError, match=r"self-mask seed of node \d+ .*: needs 3 shares, received 2"
    ):
        run.run()
    assert run.server.stage == "failed"
    with pytest.raises(ProtocolError, match="no result"):
        run.server.result()


def test_share_keys_dropouts_prune_clients_left_below_the_threshold():
    # A ring (k = 2, t = 2): once one node is gone its neighbours have one neighbour left, so
    # nobody's secrets could be rebuilt; the server drops them all before anyone masks.
    updates = make_updates(8)
    run = InProcessRound(config(num_neighbours=2), updates, dropouts={SHARE_KEYS: [min(updates)]})
    with pytest.raises(ProtocolError, match="only 0 clients remain after share_keys"):
        run.run()
    pruned = {n: why for n, why in run.server.dropouts.items() if n != min(updates)}
    assert len(pruned) == 7
    assert all("fewer than the threshold 2" in why for why in pruned.values())
    assert COLLECT_MASKED_INPUT not in run.sent  # nobody was asked to mask


# -- what the server sees -----------------------------------------------------------------------
def _masked_input_of(node, updates, settings):
    run = InProcessRound(settings, updates)
    result = run.run()
    assert_is_average_of(result, updates, updates, settings)
    arrays, _ = run.received[COLLECT_MASKED_INPUT][node]
    return arrays["secagg.masked_input"]


def test_a_masked_input_looks_uniform_and_uncorrelated_with_the_input():
    settings = config()
    size = 8000
    ramp = np.linspace(-CLIP, CLIP, size, dtype=np.float32)
    updates = make_updates(3, shapes={"adapter": (size,)})
    node = min(updates)
    with_ramp = {**updates, node: ClientUpdate({"adapter": ramp}, 100)}
    with_constant = {
        **updates,
        node: ClientUpdate({"adapter": np.full(size, -CLIP, np.float32)}, 1),
    }
    seen_ramp = _masked_input_of(node, with_ramp, settings)
    seen_constant = _masked_input_of(node, with_constant, settings)
    as_unit = [seen.astype(np.float64)[:-1] / 2.0**64 for seen in (seen_ramp, seen_constant)]
    # Uniform on [0, 1), the same distribution for both inputs, no visible trace of the input
    # (each check fails by chance with probability about 1e-6).
    for sample in as_unit:
        assert stats.kstest(sample, "uniform").pvalue > 1e-6
    assert stats.ks_2samp(*as_unit).pvalue > 1e-6
    assert abs(np.corrcoef(as_unit[0], ramp)[0, 1]) < 0.06  # 5 standard deviations at n = 8000
    # The same statistics flag the input without masks.
    levels, _ = settings.quantizer.quantize(ramp, np.random.default_rng(0))
    unmasked = (levels * np.uint64(100)).astype(np.float64) / 2.0**64
    assert stats.kstest(unmasked, "uniform").pvalue < 1e-10
    assert np.corrcoef(unmasked, ramp)[0, 1] > 0.99


def test_the_server_never_gets_both_shares_of_one_node():
    settings = config(num_neighbours=6)
    updates = make_updates(12, seed=5)
    ids = sorted(updates)
    run = InProcessRound(
        settings, updates, dropouts={COLLECT_MASKED_INPUT: ids[:1], UNMASK: ids[1:2]}
    )
    result = run.run()
    assert_is_average_of(result, updates, ids[1:], settings)
    seed_owners, key_owners = set(), set()
    for arrays, config_ in run.received[UNMASK].values():
        reply = decode_reply(arrays, config_)
        seed_owners |= set(reply.self_mask_shares)
        key_owners |= set(reply.key_shares)
    assert seed_owners <= result.included
    assert key_owners == {ids[0]}
    assert not seed_owners & key_owners


# -- client refusals ----------------------------------------------------------------------------
@pytest.fixture()
def at_unmask():
    """A round whose clients have all sent their masked inputs; the unmask requests pending."""
    updates = make_updates(6, seed=6)
    ids = sorted(updates)
    run = InProcessRound(config(), updates, dropouts={COLLECT_MASKED_INPUT: [ids[0]]})
    for _ in range(3):
        run.run_stage()
    assert run.server.stage == UNMASK
    return run


def test_client_refuses_to_reveal_both_shares_of_a_node(at_unmask):
    node, request = next(iter(at_unmask.pending.items()))
    state = at_unmask.client_state(node)
    survivor = request.survivors[0]
    both = replace(request, dropped=(*request.dropped, survivor))
    with pytest.raises(ProtocolError, match=r"both survived and dropped"):
        unmask(state, both)
    reply, after = unmask(state, request)  # the refused request lost nothing
    assert set(reply.self_mask_shares) == set(request.survivors)
    assert set(reply.key_shares) == set(request.dropped)
    # Asked again, consistently: fine. Asked for the other kind afterwards: refused.
    assert unmask(after, request)[0].self_mask_shares.keys() == reply.self_mask_shares.keys()
    switched = replace(
        request,
        survivors=tuple(s for s in request.survivors if s != survivor),
        dropped=(*request.dropped, survivor),
    )
    with pytest.raises(ProtocolError, match=r"other kind of share"):
        unmask(after, switched)


def test_client_refuses_unmask_for_strangers_and_below_threshold(at_unmask):
    node, request = next(iter(at_unmask.pending.items()))
    state = at_unmask.client_state(node)
    with pytest.raises(ProtocolError, match="not neighbours"):
        unmask(state, replace(request, survivors=(*request.survivors, 12345)))
    with pytest.raises(ProtocolError, match="about itself"):
        unmask(state, replace(request, dropped=(*request.dropped, node)))
    short = replace(request, survivors=request.survivors[: state.threshold - 1])
    with pytest.raises(ProtocolError, match=r"fewer than the threshold 3"):
        unmask(state, short)
    with pytest.raises(ProtocolError, match="round"):
        unmask(state, replace(request, round_id=request.round_id + 1))
    assert unmask(state, request)[1].stage == "unmasked"


def _at_masked_input(count=6, num_neighbours=None):
    updates = make_updates(count, seed=8)
    run = InProcessRound(config(num_neighbours=num_neighbours), updates)
    run.run_stage()
    run.run_stage()
    assert run.server.stage == COLLECT_MASKED_INPUT
    return run, updates


def test_a_tampered_share_ciphertext_is_rejected_and_the_round_goes_on():
    run, updates = _at_masked_input()
    victim, request = sorted(run.pending.items())[0]
    sender = next(iter(request.ciphertexts))
    tampered = bytearray(request.ciphertexts[sender])
    tampered[-1] ^= 1
    run.pending[victim] = replace(
        request, ciphertexts={**request.ciphertexts, sender: bytes(tampered)}
    )
    result = run.run()
    expected = f"share ciphertext from node {sender} to node {victim} failed authentication"
    assert expected in run.client_errors[victim]
    assert_is_average_of(result, updates, [n for n in updates if n != victim], config())


def test_a_misaddressed_or_misattributed_ciphertext_is_rejected():
    run, _ = _at_masked_input()
    (first, first_request), (_, second_request) = sorted(run.pending.items())[:2]
    state = run.client_state(first)
    # the ciphertext some sender addressed to `second`, handed to `first` under that sender
    sender = next(s for s in second_request.ciphertexts if s in first_request.ciphertexts)
    misaddressed = {**first_request.ciphertexts, sender: second_request.ciphertexts[sender]}
    update = run.updates[first]
    with pytest.raises(ProtocolError, match="failed authentication"):
        collect_masked_input(state, replace(first_request, ciphertexts=misaddressed), update)
    # a real ciphertext to `first` claimed to come from another of its neighbours
    a, b = sorted(first_request.ciphertexts)[:2]
    swapped = {**first_request.ciphertexts, a: first_request.ciphertexts[b]}
    with pytest.raises(ProtocolError, match=f"from node {a} to node {first} failed"):
        collect_masked_input(state, replace(first_request, ciphertexts=swapped), update)
    # replayed in another round
    with pytest.raises(ProtocolError, match="round"):
        collect_masked_input(state, replace(first_request, round_id=1), update)
    reply, _ = collect_masked_input(state, first_request, update)  # state still usable
    assert reply.masked_input.shape == (run.layout.size + 1,)


def test_client_refuses_masking_with_too_few_neighbours_or_a_bad_update():
    run, _ = _at_masked_input(count=10, num_neighbours=4)
    node, request = sorted(run.pending.items())[0]
    state = run.client_state(node)
    update = run.updates[node]
    too_few = dict(list(request.ciphertexts.items())[:2])
    with pytest.raises(ProtocolError, match="fewer than the threshold 3"):
        collect_masked_input(state, replace(request, ciphertexts=too_few), update)
    with pytest.raises(ConfigError, match="max_weight"):
        collect_masked_input(state, request, replace(update, num_examples=(1 << 20) + 1))
    with pytest.raises(ProtocolError, match="missing"):
        collect_masked_input(
            state, request, replace(update, arrays={"adapter.up": np.zeros((4, 6))})
        )
    nan = {**update.arrays, "head.bias": np.array([0.0, np.nan, 1.0], np.float32)}
    with pytest.raises(ProtocolError, match="1 non-finite"):
        collect_masked_input(state, request, replace(update, arrays=nan))


def test_client_refuses_bad_share_keys_requests():
    updates = make_updates(4)
    run = InProcessRound(config(), updates)
    run.run_stage()
    node, request = sorted(run.pending.items())[0]
    state = run.client_state(node)
    with pytest.raises(ProtocolError, match="not more than half"):
        share_keys(state, replace(request, threshold=1), run.authentication[node])
    duplicate = replace(
        request.neighbours[1], encryption_public_key=request.neighbours[0].encryption_public_key
    )
    with pytest.raises(ProtocolError, match="not all distinct"):
        share_keys(
            state,
            replace(
                request, neighbours=(request.neighbours[0], duplicate, *request.neighbours[2:])
            ),
            run.authentication[node],
        )
    with pytest.raises(ProtocolError, match="cannot answer unmask"):
        unmask(state, UnmaskRequest(0, (), ()))
    reply, new_state = share_keys(state, request, run.authentication[node])
    assert new_state.stage == "shared" and len(reply.ciphertexts) == 3


# -- encodings ----------------------------------------------------------------------------------
def _assert_record_types(arrays, config_) -> None:
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    assert all(isinstance(v, int | float | str | bool | bytes) for v in config_.values())


def test_client_state_round_trips_at_every_stage():
    updates = make_updates(5, seed=9)
    run = InProcessRound(config(), updates, dropouts={COLLECT_MASKED_INPUT: [min(updates)]})
    node = max(updates)
    states = [ClientSecAggState()]
    while run.server.stage in (ADVERTISE_KEYS, SHARE_KEYS, COLLECT_MASKED_INPUT, UNMASK):
        run.run_stage()
        states.append(run.client_state(node))
    assert [s.stage for s in states] == ["new", "advertised", "shared", "masked", "unmasked"]
    for state in states:
        arrays, config_ = state.to_records()
        _assert_record_types(arrays, config_)
        assert ClientSecAggState.from_records(arrays, config_) == state
    assert states[3].masking_private_key == b"" and states[3].self_mask_seed == b""
    assert states[2].masking_private_key != b""
    arrays, config_ = states[2].to_records()
    with pytest.raises(ProtocolError, match="neighbour_ids must be a 1-d uint64"):
        ClientSecAggState.from_records(
            {**arrays, "secagg.neighbour_ids": arrays["secagg.neighbour_ids"].astype(np.int64)},
            config_,
        )
    with pytest.raises(ProtocolError, match="stage 'bogus'"):
        ClientSecAggState.from_records(arrays, {**config_, "secagg.stage": "bogus"})


def test_every_message_round_trips_through_records():
    updates = make_updates(6, seed=10)
    run = InProcessRound(
        config(num_neighbours=4), updates, dropouts={COLLECT_MASKED_INPUT: [min(updates)]}
    )
    run.run()
    kinds = set()
    for direction, decode in (("sent", decode_request), ("received", decode_reply)):
        for stage, by_node in getattr(run, direction).items():
            for arrays, config_ in by_node.values():
                _assert_record_types(arrays, config_)
                message = decode(arrays, config_)
                again = decode(*message.to_records())
                if isinstance(message, MaskedInputReply):
                    np.testing.assert_array_equal(again.masked_input, message.masked_input)
                else:
                    assert again == message
                kinds.add((stage, type(message)))
    assert {k for _, k in kinds} == {
        AdvertiseKeysRequest,
        AdvertiseKeysReply,
        ShareKeysRequest,
        ShareKeysReply,
        MaskedInputRequest,
        MaskedInputReply,
        UnmaskRequest,
        UnmaskReply,
    }


def test_malformed_messages_are_rejected_with_the_problem_named():
    reply = ShareKeysReply(3, {5: bytes(CIPHERTEXT_BYTES), 9: bytes(CIPHERTEXT_BYTES)})
    arrays, config_ = reply.to_records()
    cases = [
        ({**config_, "secagg.stage": "gossip"}, arrays, "'gossip' is not one of"),
        ({**config_, "secagg.round": "3"}, arrays, "round must be an int"),
        (
            config_,
            {**arrays, "secagg.extra": np.zeros(1)},
            r"unexpected array entries \['secagg.extra'\]",
        ),
        (
            config_,
            {k: v for k, v in arrays.items() if "receiver" not in k},
            "missing array entries",
        ),
        (
            config_,
            {**arrays, "secagg.receiver_ids": np.array([9, 5], np.uint64)},
            "strictly increasing",
        ),
        (config_, {**arrays, "secagg.ciphertexts": arrays["secagg.ciphertexts"][:, :-1]}, "shape"),
    ]
    for bad_config, bad_arrays, message in cases:
        with pytest.raises(ProtocolError, match=message):
            decode_reply(bad_arrays, bad_config)
    with pytest.raises(ProtocolError, match="expected a unmask reply, got a share_keys"):
        UnmaskReply.from_records(arrays, config_)
    assert decode_reply({**arrays, "model.weight": np.zeros(2)}, {**config_, "lr": 0.1}) == reply
    request = AdvertiseKeysRequest(
        0, 7, config().client_settings(ArrayLayout.of({"a": np.zeros(2)}))
    )
    arrays, config_ = request.to_records()
    with pytest.raises(ProtocolError, match=r"quantization_bits must be in 1\.\.52"):
        decode_request(arrays, {**config_, "secagg.quantization_bits": 60})
    with pytest.raises(ProtocolError, match="malformed array layout"):
        decode_request(arrays, {**config_, "secagg.layout": "{"})


def test_per_client_traffic_matches_the_documented_formula():
    updates = make_updates(10, seed=11)
    run = InProcessRound(config(num_neighbours=4), updates)
    run.run()
    length = run.layout.size + 1
    degree = 4

    def array_bytes(records):
        return sum(a.nbytes for a in records[0].values())

    expected = {  # identity key and signature: 32 + 64 bytes per client
        ADVERTISE_KEYS: (8, 64 + 96),
        SHARE_KEYS: ((8 + 64 + 96) * degree, (8 + CIPHERTEXT_BYTES) * degree),
        COLLECT_MASKED_INPUT: ((8 + CIPHERTEXT_BYTES) * degree, 8 * length),
        UNMASK: (8 * degree, (8 + SHARE_BYTES) * degree),
    }
    for stage, (down, up) in expected.items():
        for node in updates:
            assert array_bytes(run.sent[stage][node]) == down, stage
            assert array_bytes(run.received[stage][node]) == up, stage
    assert CIPHERTEXT_BYTES == 132 and SHARE_BYTES == 52


# -- server robustness --------------------------------------------------------------------------
def test_server_treats_a_malformed_reply_as_a_dropout_and_rejects_strangers():
    updates = make_updates(4, seed=12)
    run = InProcessRound(config(), updates)
    for _ in range(2):
        run.run_stage()
    server = run.server
    replies = {}
    for node, request in run.pending.items():
        reply, _ = handle(
            run.client_state(node),
            request,
            update=updates[node],
            authentication=run.authentication[node],
        )
        replies[node] = reply
    short = min(replies)
    replies[short] = MaskedInputReply(0, replies[short].masked_input[:-1])
    with pytest.raises(ProtocolError, match="not asked"):
        server.on_replies({**replies, 99: replies[short]})
    server.on_replies(replies)
    assert "invalid collect_masked_input reply: masked input is uint64" in server.dropouts[short]


# -- primitives ---------------------------------------------------------------------------------
def test_masks_depend_on_all_32_bytes_of_the_secret():
    seed = bytes(range(32))
    last_byte_changed = seed[:-1] + bytes([seed[-1] ^ 1])
    a, b = expand_mask(seed, 4096), expand_mask(last_byte_changed, 4096)
    assert a.dtype == np.uint64
    assert not np.any(a == b)
    differing_bits = np.unpackbits((a ^ b).view(np.uint8)).mean()
    assert 0.48 < differing_bits < 0.52
    # Flower's pseudo_rand_gen XOR-folds the seed to 32 bits: swapping two 4-byte words gives the
    # same numpy seed there, and unrelated streams here.
    swapped = seed[4:8] + seed[:4] + seed[8:]

    def fold(s):
        return np.bitwise_xor.reduce(np.frombuffer(s, "<u4"))

    assert fold(seed) == fold(swapped)
    assert not np.any(expand_mask(seed, 4096) == expand_mask(swapped, 4096))
    assert np.array_equal(expand_mask(seed, 100), a[:100])  # deterministic in the secret


def test_quantization_error_is_within_one_step_unbiased_and_clipping_is_counted():
    quantizer = Quantizer(clipping_range=2.0, bits=8)
    rng = np.random.default_rng(1)
    values = rng.uniform(-3.0, 3.0, 200_000)
    levels, clipped = quantizer.quantize(values, np.random.default_rng(2))
    assert levels.dtype == np.uint64 and levels.max() <= quantizer.max_level
    assert clipped == np.count_nonzero(np.abs(values) > 2.0)
    error = quantizer.dequantize(levels) - np.clip(values, -2.0, 2.0)
    assert np.max(np.abs(error)) < quantizer.step
    inside = np.abs(values) < 2.0
    # unbiased: the mean error is far below a step (std of the mean <= step / 2 / sqrt(n))
    assert abs(error[inside].mean()) < 5 * quantizer.step / 2 / np.sqrt(inside.sum())
    # edges are exact
    edges, _ = quantizer.quantize(np.array([-2.0, 2.0]), rng)
    assert edges.tolist() == [0, quantizer.max_level]


def test_clients_count_their_clipped_values_locally():
    settings = config()
    updates = make_updates(3, seed=13, spread=2.0 * CLIP)
    run = InProcessRound(settings, updates)
    result = run.run()
    assert_is_average_of(result, updates, updates, settings)  # the average of clipped inputs
    for node, update in updates.items():
        flat = np.concatenate([a.reshape(-1) for a in update.arrays.values()])
        assert run.client_state(node).clipped_values == np.count_nonzero(np.abs(flat) > CLIP) > 0
    for arrays, _ in run.received[COLLECT_MASKED_INPUT].values():
        assert set(arrays) == {"secagg.masked_input"}  # the count is never sent


# -- configuration and graph ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_neighbours": 4, "reconstruction_threshold": 5}, "exceeds the 4 neighbours"),
        ({"num_neighbours": 4, "reconstruction_threshold": 2}, "not more than half"),
        ({"quantization_bits": 0}, "quantization_bits must be in 1..52"),
        ({"quantization_bits": 53}, "quantization_bits must be in 1..52"),
        ({"clipping_range": 0.0}, "clipping_range must be a positive"),
        ({"max_weight": 0}, "max_weight must be a positive int"),
        ({"quantization_bits": 40, "max_weight": 1 << 24}, "room in uint64 for 1 clients"),
        ({"num_neighbours": 1}, "num_neighbours must be None or an int >= 2"),
        ({"min_clients": 1}, "min_clients must be >= 2"),
    ],
)
def test_bad_config_is_a_config_error_naming_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(**overrides)


def test_server_start_checks_overflow_and_the_threshold_for_the_actual_clients():
    layout = ArrayLayout.of({"a": np.zeros(3)})
    tight = config(quantization_bits=32, max_weight=1 << 30)  # 2**64 / 2**62: 4 clients fit
    assert tight.max_clients == 4
    with pytest.raises(ConfigError, match=r"5 clients .* could overflow"):
        SecAggServer(tight, layout).start(range(1, 6))
    with pytest.raises(ConfigError, match="not more than half of the 49 neighbours with 50"):
        SecAggServer(config(reconstruction_threshold=10), layout).start(range(1, 51))
    with pytest.raises(ConfigError, match="fewer than min_clients=3"):
        SecAggServer(config(min_clients=3), layout).start([1, 2])
    with pytest.raises(ConfigError, match=r"outside 1\.\.2"):
        SecAggServer(config(), layout).start([0, 1, 2])
    assert len(SecAggServer(tight, layout).start([1, 2, 2**64 - 1])) == 3


@pytest.mark.parametrize("count", range(3, 14))
def test_harary_graph_is_regular_symmetric_and_complete_when_asked(count):
    for asked in (2, 3, 4, 5, None):
        degree = neighbour_degree(count, asked)
        expected = count - 1 if asked is None or asked >= count - 1 else asked
        if expected < count - 1 and expected % 2 == 1 and count % 2 == 1:
            expected += 1  # no odd-regular graph on an odd number of nodes
        assert degree == expected
        ids = [1000 + 3 * i for i in range(count)]
        graph = random_neighbour_graph(ids, degree)
        assert set(graph) == set(ids)
        for node, peers in graph.items():
            assert len(peers) == degree and node not in peers and list(peers) == sorted(peers)
            assert all(node in graph[peer] for peer in peers)
    assert harary_graph([5, 6, 7, 8], 2) == {5: (6, 8), 6: (5, 7), 7: (6, 8), 8: (5, 7)}
