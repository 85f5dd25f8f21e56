"""The double-blind protocol's logic: backend seam, permutations, roles, driver and bad input."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfm.approx import ApproxConfig, calibrate
from fedfm.crypto import CKKS_8192, SimulateBackend, get_backend
from fedfm.crypto.randomness import ResearchStream
from fedfm.crypto.simulate import SimulatedEvaluator, SimulatedKeyOwner
from fedfm.data import load_splits
from fedfm.distillation.training import PretrainConfig, pretrain
from fedfm.errors import (
    CheckpointError,
    ConfigError,
    CryptoParameterError,
    DataError,
    ProtocolAbort,
    ProtocolError,
)
from fedfm.experiments.observed import run_observed
from fedfm.models import ModelSpec, to_fhe_friendly
from fedfm.protocols.double_blind import (
    ClientData,
    ClientState,
    DoubleBlindClient,
    DoubleBlindConfig,
    DoubleBlindServer,
    SideAdapterHead,
    WeightedAverage,
    runner,
)
from fedfm.protocols.double_blind.client import KEPT
from fedfm.protocols.double_blind.config import (
    EVALUATE_BLOCK,
    EVALUATE_CACHED,
    SETUP,
    TRAIN_BLOCK,
    TRAIN_LOSS,
    TRAIN_SECAGG,
    revealed_blocks,
)
from fedfm.protocols.double_blind.messages import SIZE_ARRAYS, pack_arrays
from fedfm.protocols.double_blind.permutation import draw_round_permutations, relative
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.runner import Federation, federation_data
from fedfm.protocols.secure_aggregation import signed_federation
from fedfm.runtime.transport import Envelope
from fedfm.secagg import (
    ADVERTISE_KEYS,
    COLLECT_MASKED_INPUT,
    SHARE_KEYS,
    STAGES,
    UNMASK,
    ClientSecAggState,
    SecAggServer,
    decode_reply,
)
from fedfm.secagg.layout import ArrayLayout

IMAGE = 16
BACKEND = SimulateBackend()


@pytest.fixture(scope="module")
def splits():
    return load_splits("digits", image_size=IMAGE, max_samples=240, seed=0)


@pytest.fixture(scope="module")
def model(splits):
    torch.manual_seed(0)
    teacher = ModelSpec("vit_fedfm_tiny", 10, IMAGE).build()
    pretrain(
        teacher, splits.aux.images, splits.aux.labels, PretrainConfig(epochs=5), progress=False
    )
    student = to_fhe_friendly(teacher, ApproxConfig())
    calibrate(student, [splits.aux.images[:64]])
    return student.eval()


def small_config(**changes) -> DoubleBlindConfig:
    return replace(DoubleBlindConfig(rounds=2, batches_per_round=2, reveal="all"), **changes)


# One researcher plays every party here: data owners that accept the plaintext backend and a
# server whose draws are reproducible (so that two runs with the same settings are the same run).
PLAIN = DataOwnerPolicy(allow_plaintext=True, require_secure_aggregation=False)


def run_research(*args, **kwargs):
    """``run_in_process`` with PLAIN data owners and ``ResearchStream(3)`` server draws."""
    kwargs.setdefault("policy", PLAIN)
    kwargs.setdefault("randomness", ResearchStream(3))
    return runner.run_in_process(*args, **kwargs)


def research_server(model, config, **kwargs) -> DoubleBlindServer:
    kwargs.setdefault("log", lambda _: None)
    return DoubleBlindServer(
        model, config, BACKEND, num_classes=10, randomness=ResearchStream(3), **kwargs
    )


def make_data(splits, count: int = 80) -> ClientData:
    images, labels = splits.pool.images.numpy(), splits.pool.labels.numpy()
    return ClientData(
        train_images=images[:count],
        train_labels=labels[:count],
        eval_images=images[count : count + 20],
        eval_labels=labels[count : count + 20],
        num_classes=10,
    )


def trained_params(outcome, state, initial) -> dict[str, np.ndarray]:
    """A client's new adapter and head: in its reply, or kept as an update under secure
    aggregation (the server then got none)."""
    if not state.config.get("secure_aggregation", True):
        return outcome.arrays
    assert outcome.arrays == {} and state.stage == "trained"
    return {name: initial[name] + delta for name, delta in state.group("update").items()}


def setup_pair(model, splits, config=None):
    config = config or small_config()
    server = research_server(model, config)
    client = DoubleBlindClient(make_data(splits), BACKEND, policy=PLAIN, partition_id=0)
    reply, state = client.handle(server.setup_request(7), ClientState())
    server.on_setup(reply)
    return server, client, state


# -- backend ----------------------------------------------------------------------------------


def test_simulated_batches_are_bound_to_their_owner() -> None:
    alice, bob = BACKEND.create_key_owner(), BACKEND.create_key_owner()
    batch = alice.encrypt(np.ones((4, 3), dtype=np.float32))
    np.testing.assert_array_equal(alice.decrypt(batch), np.ones((4, 3)))
    with pytest.raises(CryptoParameterError):
        bob.decrypt(batch)
    with pytest.raises(CryptoParameterError):
        bob.load(batch.to_payload())
    evaluator = BACKEND.create_evaluator(alice.public_context())
    assert not hasattr(evaluator, "decrypt")
    with pytest.raises(CryptoParameterError):
        BACKEND.create_evaluator(bob.public_context()).take(batch, np.arange(2))
    restored = BACKEND.restore_key_owner(alice.secret_state())
    np.testing.assert_array_equal(restored.decrypt(batch), alice.decrypt(batch))
    with pytest.raises(ConfigError, match="unknown crypto backend"):
        get_backend("paillier")


def test_simulated_sizes_are_counted_as_ckks_ciphertexts() -> None:
    owner = BACKEND.create_key_owner()
    batch = owner.encrypt(np.zeros((16, 65, 96), dtype=np.float32))
    # one ciphertext per feature, 16 x 65 = 1040 values per feature fit in one 4096-slot ciphertext
    assert batch.nbytes == 96 * CKKS_8192.ciphertext_bytes
    assert CKKS_8192.secure_128 and CKKS_8192.ciphertext_bytes == 2 * 8192 * 8 * 3


# -- permutations and the adapter ---------------------------------------------------------------


def test_relative_permutations_reorder_and_hide_the_absolute_ones() -> None:
    rng = np.random.default_rng(0)
    perms = draw_round_permutations(4, 16, rng)
    data = rng.normal(size=16)
    for block in range(1, 5):
        a, b = perms.after_block(block), perms.after_block(block + 1)
        np.testing.assert_array_equal(data[a][relative(a, b)], data[b])
    # Proposition 1: left-composing every pi with any S gives the same client view
    shift = rng.permutation(16)
    shifted = type(perms)(tuple(shift[order] for order in perms.orders))
    for key, value in perms.client_view().items():
        np.testing.assert_array_equal(shifted.client_view()[key], value)


def test_adapter_on_permuted_blocks_equals_unpermuted_computation() -> None:
    torch.manual_seed(0)
    adapter = SideAdapterHead(num_blocks=3, dim=8, num_classes=4, rank=2)
    for up in adapter.up:  # non-zero so that the adapter path matters
        torch.nn.init.normal_(up.weight)
    blocks = [torch.randn(16, 5, 8) for _ in range(3)]
    identity = torch.arange(16)
    plain = adapter(blocks, identity, torch.stack([identity] * 3))
    perms = draw_round_permutations(3, 16, np.random.default_rng(1))
    view = perms.client_view()
    permuted = [blocks[b - 1][perms.after_block(b)] for b in range(1, 4)]
    logits = adapter(permuted, torch.from_numpy(view["wrap"]), torch.from_numpy(view["steps"]))
    torch.testing.assert_close(logits, plain[perms.after_block(4)])


# -- roles --------------------------------------------------------------------------------------


def test_a_clients_data_is_loaded_once_and_only_when_a_message_needs_it(model, splits) -> None:
    """The ClientApp hands the client a loader: nothing is loaded to build the role (a refresh
    never needs the data), the first message that does loads it, later ones reuse it."""
    calls: list[int] = []

    def load() -> ClientData:
        calls.append(1)
        return make_data(splits)

    client = DoubleBlindClient(load, BACKEND, policy=PLAIN, partition_id=0)
    assert calls == []
    server = research_server(model, small_config())
    reply, _ = client.handle(server.setup_request(7), ClientState())
    server.on_setup(reply)
    assert calls == [1]
    client.handle(server.setup_request(7), ClientState())
    assert calls == [1] and client.data.num_classes == 10


def test_setup_keeps_secrets_on_the_client(model, splits) -> None:
    server, _, state = setup_pair(model, splits)
    secret = bytes(state.group("key")["secret"])
    session = server.sessions[7]
    assert isinstance(session.evaluator, SimulatedEvaluator)
    held = [value for value in vars(session).values()] + [value for value in vars(server).values()]
    assert not any(isinstance(value, SimulatedKeyOwner) for value in held)
    assert secret not in session.evaluator.key_id
    assert "rng" not in server.setup_request(7).config  # the server's randomness stays home
    channels = model.vit.patch_embed.proj.in_channels
    assert session.train_images.shape == (80, channels, IMAGE, IMAGE)  # embedded per batch
    assert server.hidden_size == 96


def test_one_round_between_roles_and_what_the_client_receives(model, splits) -> None:
    server, client, state = setup_pair(model, splits)
    arrays = server.initial_arrays(96)
    request = server.start("train", 7, 1, arrays)
    drawn = [p for perms in server.sessions[7].in_flight.permutations for p in perms.orders]
    received_ints = []
    while True:
        received_ints += [
            v
            for k, v in request.arrays.items()
            if v.dtype == np.int64 and k not in SIZE_ARRAYS  # the batches' public sizes
        ]
        reply, state = client.handle(request, state)
        outcome = server.on_reply(reply)
        if not isinstance(outcome, Envelope):
            break
        request = outcome
    assert outcome.num_examples == 32 and np.isfinite(outcome.train_loss)
    assert set(trained_params(outcome, state, arrays)) == set(arrays)
    # the client got relative permutations only, never one of the server's pi_l
    assert received_ints
    for array in received_ints:
        for row in array.reshape(-1, 16):
            assert not any(np.array_equal(row, pi) for pi in drawn)


def test_messages_out_of_order_are_refused_without_losing_state(model, splits) -> None:
    server, client, state = setup_pair(model, splits)
    request = server.start("train", 7, 1, server.initial_arrays(96))
    _, after_block1 = client.handle(request, state)
    block2 = server.on_reply(client.handle(request, state)[0])
    wrong_round = replace(block2, round=5)
    with pytest.raises(ProtocolError, match="does not follow"):
        client.handle(wrong_round, after_block1)
    with pytest.raises(ProtocolError, match="cannot accept"):
        client.handle(Envelope(TRAIN_LOSS, 7, 1, {}, {}), state)
    with pytest.raises(ProtocolError, match="cannot accept"):
        client.handle(Envelope("train.nope", 7, 1, {}, {}), state)
    with pytest.raises(ProtocolError, match="identifier"):
        Envelope("train.no-pe", 7, 1)
    with pytest.raises(ProtocolError, match="'fit' is not"):
        Envelope("fit", 7, 1)
    # the refused messages changed nothing: the right block 2 still goes through
    reply, _ = client.handle(block2, after_block1)
    assert reply.message_type == TRAIN_BLOCK


def _evaluate(server, client, state, server_round, arrays):
    """One evaluation between the roles: the requests the client saw, its result and state."""
    request = server.start("evaluate", 7, server_round, arrays)
    seen = []
    while isinstance(request, Envelope):
        seen.append(request.message_type)
        reply, state = client.handle(request, state)
        request = server.on_reply(reply)
    return seen, request, state


def test_later_evaluations_use_the_outputs_the_client_kept(model, splits) -> None:
    """The frozen blocks' outputs on the held-out set are sent once: a later evaluation is one
    ``evaluate.cached`` message with the new head, and scores it as a full evaluation would."""
    config = small_config(rounds=4)
    server, client, state = setup_pair(model, splits, config)
    first = server.initial_arrays(96)
    noise = np.random.default_rng(0)  # another head: the initial one predicts a single class
    second = {k: v + noise.normal(0, 0.5, v.shape).astype(v.dtype) for k, v in first.items()}
    shown = server.num_blocks
    seen, full, state = _evaluate(server, client, state, 1, first)
    assert seen == [EVALUATE_BLOCK] * shown and full.confusion.sum() == 20
    assert server.sessions[7].evaluation_kept and state.group(KEPT)
    seen, kept, kept_state = _evaluate(server, client, state, 2, second)
    assert seen == [EVALUATE_CACHED]
    # the same scores as a full evaluation of the second head (a fresh client and server)
    server_b, client_b, state_b = setup_pair(model, splits, config)
    _, reference, _ = _evaluate(server_b, client_b, state_b, 1, second)
    np.testing.assert_array_equal(kept.confusion, reference.confusion)
    assert not np.array_equal(full.confusion, kept.confusion)  # the head did change the scores
    # rounds only move forward: the kept evaluation of round 2 is not answered twice
    request = Envelope(EVALUATE_CACHED, 7, 2, pack_arrays("global", second), {"num_blocks": shown})
    with pytest.raises(ProtocolAbort, match="already evaluated round 2"):
        client.handle(request, kept_state)
    # its policy bounds the evaluations a server may ask for (each costs the server nothing)
    bounded = DoubleBlindClient(make_data(splits), BACKEND, policy=replace(PLAIN, max_rounds=2))
    later = replace(request, round=3)
    with pytest.raises(ProtocolAbort, match="round 3 is past the policy's max-rounds=2"):
        bounded.handle(later, kept_state)
    # and the run's rounds, announced at setup, bound them by default
    with pytest.raises(ProtocolAbort, match="round 5 is past the 4 rounds the server announced"):
        client.handle(replace(request, round=5), kept_state)
    # a client that lost its copy (a new key: setup again) says so, and the server evaluates in
    # full in the same round
    reply, fresh = client.handle(server.setup_request(7), kept_state)
    server.on_setup(reply)
    server.sessions[7].evaluation_kept = True  # the server still thinks the client kept them
    seen, again, _ = _evaluate(server, client, fresh, 3, second)
    assert seen == [EVALUATE_CACHED] + [EVALUATE_BLOCK] * shown
    np.testing.assert_array_equal(again.confusion, reference.confusion)
    # a reply to a kept evaluation that counts other samples is refused by the server
    server.start("evaluate", 7, 4, second)
    counts = {"confusion": np.eye(10, dtype=np.int64)}
    forged = Envelope(EVALUATE_CACHED, 7, 4, counts, {"kept": True})
    with pytest.raises(ProtocolError, match="counts 10 samples"):
        server.on_reply(forged)


def test_the_held_out_set_rides_along_the_first_training_round(model, splits) -> None:
    """With ``with_evaluation`` the held-out batches travel in the training round's sets of
    ciphertexts: the client keeps their outputs and trains on its training batches only (the
    plaintext SGD step: :func:`test_protocol_update_equals_plaintext_sgd_step`), and the
    round's evaluation is one ``evaluate.cached`` message that scores as a full evaluation
    does."""
    config = small_config(momentum=0.0, lr=0.5, secure_aggregation=False)
    server, client, state = setup_pair(model, splits, config)
    initial = server.initial_arrays(96)
    request = server.start("train", 7, 1, initial, with_evaluation=True)
    flight = server.sessions[7].in_flight
    assert request.config["evaluation_batches"] == 1 and len(flight.indices) == 3
    assert request.arrays["set_sizes"].tolist() == [3]  # 16 + 16 + 20 samples: one set
    outcome = request
    while isinstance(outcome, Envelope):
        reply, state = client.handle(outcome, state)
        outcome = server.on_reply(reply)
    assert outcome.num_examples == 32 and server.sessions[7].evaluation_kept
    assert {k for k in state.arrays if k.startswith(f"{KEPT}.labels")} == {f"{KEPT}.labels.0"}
    # the evaluation is one message on the kept outputs, scored as a full evaluation
    seen, kept, _ = _evaluate(server, client, state, 1, outcome.arrays)
    assert seen == [EVALUATE_CACHED] and kept.confusion.sum() == 20
    server_b, client_b, state_b = setup_pair(model, splits, config)
    _, reference, _ = _evaluate(server_b, client_b, state_b, 1, outcome.arrays)
    np.testing.assert_array_equal(kept.confusion, reference.confusion)


def test_held_out_batches_riding_along_are_checked(model, splits) -> None:
    """The client refuses held-out batches that are not all its held-out samples once, or whose
    count changes after block 1; the server refuses a client that did not keep them."""
    server, client, state = setup_pair(model, splits)
    arrays = server.initial_arrays(96)
    request = server.start("train", 7, 1, arrays, with_evaluation=True)
    for riding, message in (
        (2, "held-out batches of \\[16, 20\\]"),
        (0, "batches of \\[16, 16, 20\\]"),
    ):
        forged = replace(request, config={**request.config, "evaluation_batches": riding})
        with pytest.raises(ProtocolAbort, match=message):
            client.handle(forged, state)
    with pytest.raises(ProtocolError, match="evaluation_batches 3 is not a count below its 3"):
        client.handle(replace(request, config={**request.config, "evaluation_batches": 3}), state)
    reply, after_block1 = client.handle(request, state)
    block2 = server.on_reply(reply)
    forged = replace(block2, config={**block2.config, "evaluation_batches": 0})
    with pytest.raises(ProtocolAbort, match="0 held-out batches ride along, block 1 said 1"):
        client.handle(forged, after_block1)
    outcome, current = block2, after_block1
    while outcome.config.get("block") != outcome.config.get("num_blocks"):
        reply, current = client.handle(outcome, current)
        outcome = server.on_reply(reply)
    reply, _ = client.handle(outcome, current)
    assert reply.config["kept"] is True
    dropped = replace(reply, config={k: v for k, v in reply.config.items() if k != "kept"})
    with pytest.raises(ProtocolError, match="did not keep the held-out outputs of round 1"):
        server.on_reply(dropped)


def test_wrong_shapes_are_refused_by_the_server(model, splits) -> None:
    server, client, state = setup_pair(model, splits)
    request = server.start("train", 7, 1, server.initial_arrays(96))
    reply, _ = client.handle(request, state)
    truncated = dict(reply.arrays)
    truncated["batch.0.values"] = truncated["batch.0.values"][:-1]
    with pytest.raises(ProtocolError, match="shape"):
        server.on_reply(replace(reply, arrays=truncated))
    with pytest.raises(ProtocolError, match="has not completed setup"):
        server.on_reply(replace(reply, node_id=99))


def test_bad_client_data_and_settings_are_named(splits) -> None:
    data = make_data(splits)
    with pytest.raises(DataError, match=r"outside 0\.\.9"):
        replace(data, train_labels=data.train_labels + 10)
    with pytest.raises(DataError, match="no training samples"):
        replace(data, train_images=data.train_images[:0], train_labels=data.train_labels[:0])
    with pytest.raises(ConfigError, match="below the minimum 16"):
        DoubleBlindConfig(batch_size=8)
    assert DoubleBlindConfig(batch_size=8, min_batch_size=8).batch_size == 8
    with pytest.raises(ConfigError, match="rank"):
        DoubleBlindConfig(rank=-1)


def test_setup_reply_with_wrong_class_count_is_refused(model, splits) -> None:
    server = research_server(model, small_config(), log=print)
    client = DoubleBlindClient(replace(make_data(splits), num_classes=12), BACKEND, policy=PLAIN)
    reply, _ = client.handle(server.setup_request(1), ClientState())
    with pytest.raises(ProtocolError, match="12 classes"):
        server.on_setup(reply)


def test_setup_reply_with_images_the_model_cannot_read_is_refused(model, splits) -> None:
    server = research_server(model, small_config(), log=print)
    data = make_data(splits)
    small = replace(
        data,
        train_images=data.train_images[..., :8, :8],
        eval_images=data.eval_images[..., :8, :8],
    )
    client = DoubleBlindClient(small, BACKEND, policy=PLAIN)
    reply, _ = client.handle(server.setup_request(1), ClientState())
    with pytest.raises(ProtocolError, match=r"shape \(3, 8, 8\); the model reads \(3, 16, 16\)"):
        server.on_setup(reply)
    assert 1 not in server.sessions  # nothing registered


# -- driver ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("secure", "riding"), [(True, False), (False, False), (True, True)])
def test_protocol_update_equals_plaintext_sgd_step(model, splits, secure, riding) -> None:
    """Permutations, encryption and the split of work change nothing in the mathematics; with
    secure aggregation the client keeps the same step as its update instead of sending it; a
    held-out set riding along (``riding``) leaves the step on the training batches as it is."""
    config = small_config(momentum=0.0, lr=0.5, secure_aggregation=secure)
    server, client, state = setup_pair(model, splits, config)
    initial = server.initial_arrays(96)
    request = server.start("train", 7, 1, initial, with_evaluation=riding)
    flight = server.sessions[7].in_flight
    assert flight.evaluation_batches == (1 if riding else 0)  # 20 held-out samples: one batch
    # the training batches come first (the held-out ones follow, as rows of the joined upload)
    batches = [b.copy() for b in flight.indices[: config.batches_per_round]]
    outcome = request
    while isinstance(outcome, Envelope):
        reply, state = client.handle(outcome, state)
        outcome = server.on_reply(reply)

    adapter = SideAdapterHead(num_blocks=4, dim=96, num_classes=10, rank=8)
    adapter.set_arrays(initial)
    images = torch.from_numpy(make_data(splits).train_images)
    labels = torch.from_numpy(make_data(splits).train_labels)
    identity = torch.arange(16)
    losses = []
    with torch.no_grad():
        hidden = [model.embed(images[torch.from_numpy(b)]) for b in batches]
        outputs: list[list[torch.Tensor]] = [[] for _ in batches]
        for index in range(4):
            hidden = [model.block(index, h) for h in hidden]
            for out, h in zip(outputs, hidden, strict=True):
                out.append(h)
    for out, batch in zip(outputs, batches, strict=True):
        logits = adapter(out, identity, torch.stack([identity] * 4))
        losses.append(torch.nn.functional.cross_entropy(logits, labels[torch.from_numpy(batch)]))
    torch.stack(losses).mean().backward()
    params = trained_params(outcome, state, initial)
    for name, parameter in adapter.named_parameters():
        expected = (parameter - 0.5 * parameter.grad).detach().numpy()
        np.testing.assert_allclose(params[name], expected, rtol=1e-4, atol=1e-5)
    assert outcome.train_loss == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)


def test_an_honest_loss_on_confident_wrong_predictions_is_accepted(model, splits) -> None:
    """A diverging model predicts its wrong classes with probabilities below 1e-12: the
    server's cross-entropy (from the client's exact log-softmax) is then far above a loss
    computed from clamped probabilities. The client must check against the same exact value,
    or honest clients refuse honest rounds and leave (seen at lr 0.1 with hidden text lengths:
    every client left in round 6)."""
    config = small_config(momentum=0.0, lr=0.01, secure_aggregation=False)
    server, client, state = setup_pair(model, splits, config)
    initial = server.initial_arrays(96)
    initial["head.weight"] = initial["head.weight"] * 1e4  # logits in the thousands
    outcome = server.start("train", 7, 1, initial)
    while isinstance(outcome, Envelope):
        reply, state = client.handle(outcome, state)
        outcome = server.on_reply(reply)
    assert outcome.train_loss > 28.0  # above -log(1e-12) = 27.6: clamping would have differed
    assert np.isfinite(outcome.train_loss)


@pytest.mark.parametrize(("reveal", "shown"), [("last-two", [3, 4]), ("every-other", [2, 4])])
def test_tap_sets_reveal_only_their_blocks_and_train_on_them(model, splits, reveal, shown) -> None:
    """With hidden blocks the client receives only the chosen outputs (the server chains the
    others), its adapter taps only those, and its update is still the plaintext SGD step."""
    assert revealed_blocks(reveal, 4) == shown
    config = small_config(momentum=0.0, lr=0.5, reveal=reveal, permute=False)
    server, client, state = setup_pair(model, splits, config)
    initial = server.initial_arrays(96)
    outcome = server.start("train", 7, 1, initial)
    batches = [b.copy() for b in server.sessions[7].in_flight.indices]
    seen = []
    while isinstance(outcome, Envelope):
        if outcome.message_type == TRAIN_BLOCK:
            seen.append((outcome.config["block"], outcome.config["num_blocks"]))
        reply, state = client.handle(outcome, state)
        outcome = server.on_reply(reply)
    assert seen == [(m, len(shown)) for m in range(1, len(shown) + 1)]

    adapter = SideAdapterHead(num_blocks=len(shown), dim=96, num_classes=10, rank=8)
    adapter.set_arrays(initial)
    data = make_data(splits)
    images, labels = torch.from_numpy(data.train_images), torch.from_numpy(data.train_labels)
    identity = torch.arange(16)
    losses = []
    with torch.no_grad():
        outputs = []
        for batch in batches:
            hidden, taps = model.embed(images[torch.from_numpy(batch)]), []
            for index in range(4):
                hidden = model.block(index, hidden)
                if index + 1 in shown:
                    taps.append(hidden)
            outputs.append(taps)
    for taps, batch in zip(outputs, batches, strict=True):
        logits = adapter(taps, identity, torch.stack([identity] * len(shown)))
        losses.append(torch.nn.functional.cross_entropy(logits, labels[torch.from_numpy(batch)]))
    torch.stack(losses).mean().backward()
    params = trained_params(outcome, state, initial)
    for name, parameter in adapter.named_parameters():
        expected = (parameter - 0.5 * parameter.grad).detach().numpy()
        np.testing.assert_allclose(params[name], expected, rtol=1e-4, atol=1e-5)


def test_reveal_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="block numbers like"):
        DoubleBlindConfig(reveal="some")
    with pytest.raises(ConfigError, match="include the last block"):
        revealed_blocks("1,2", 4)
    assert revealed_blocks("all", 3) == [1, 2, 3] and revealed_blocks("last", 3) == [3]


def test_in_process_run_accounts_round_trips(model, splits) -> None:
    config = small_config(rounds=3)
    history, transport = run_research(
        model, splits, config, Federation(num_clients=2), log=lambda _: None
    )
    assert [record.round for record in history] == [1, 2, 3]
    assert all(np.isfinite(record.train_loss) for record in history)
    assert all(0.0 <= record.balanced_accuracy <= 1.0 for record in history)
    # R + 1 round trips to train and 4 SecAgg stages per round (R revealed blocks); one to
    # evaluate (the held-out sets rode along round 1's training and the clients kept the
    # frozen blocks' outputs); plus setup
    shown = len(revealed_blocks(config.reveal, model.num_blocks))
    assert [record.round_trips for record in history] == [shown + 6] * 3
    assert transport.stats.round_trips == 1 + 3 * (shown + 6)


def test_progress_lines_say_where_each_client_stands(model, splits) -> None:
    """With ``progress_every=0`` a line goes out before every round trip after the first of a
    phase: it counts the trips and names each client's block; the default (10 s) stays quiet
    in a fast run. Under CKKS the same line counts the refreshes of the block in work."""
    config = small_config(rounds=1, secure_aggregation=False)
    shown = len(revealed_blocks(config.reveal, model.num_blocks))
    lines: list[str] = []
    run_research(
        model, splits, config, Federation(num_clients=2), log=lines.append, progress_every=0.0
    )
    progress = [line for line in lines if "round trips, 2 in flight" in line]
    train = [line for line in progress if "[simulate] train:" in line]
    evaluate = [line for line in progress if "[simulate] evaluate:" in line]
    # trips 1.. of the training's L + 1; the evaluation is one trip (the held-out sets rode
    # along the training), so no line comes between its trips
    assert len(train) == shown and evaluate == []
    assert train[0].startswith("[fedfm] round 1/1 [simulate] train: 1 round trips")
    # after trip k the server has sent block k + 1 (after the last block: the loss message)
    assert f"node 0 train block 2/{shown} at the client; node 1 train block 2/{shown}" in train[0]
    assert "node 0 train loss at the client; node 1 train loss at the client" in train[-1]
    quiet: list[str] = []
    run_research(model, splits, config, Federation(num_clients=2), log=quiet.append)
    assert not [line for line in quiet if "in flight" in line]


def test_the_position_counts_a_blocks_refreshes(model, splits) -> None:
    """Mid-block (waiting for a refresh answer) the position names the block being evaluated
    and the refreshes asked for it so far. (``simulate`` asks for none; the CKKS count is
    what ``ask`` increments in ``_refreshing``.)"""
    server, _, _ = setup_pair(model, splits, small_config())
    node = next(iter(server.sessions))
    assert server.position(node) == "done"
    server.start("train", node, 1, server.initial_arrays(server.hidden_size))
    flight = server.sessions[node].in_flight
    assert flight is not None and flight.refreshes == 0
    assert server.position(node) == f"train block 1/{server.num_blocks} at the client"
    flight.stage, flight.refreshes = iter(()), 7  # as if a refresh of block 2 were out
    assert server.position(node) == f"train block 2/{server.num_blocks}, refresh 7"


def test_evaluate_every_skips_evaluations_but_not_the_last(model, splits) -> None:
    """``evaluate_every=2`` over 3 rounds: round 2 and the last round are evaluated; round 1
    trains only (R fewer round trips, NaN accuracies, no client evaluated)."""
    config = small_config(rounds=3, evaluate_every=2)
    history, _ = run_research(model, splits, config, Federation(num_clients=2), log=lambda _: None)
    shown = len(revealed_blocks(config.reveal, model.num_blocks))
    assert [record.clients_evaluated for record in history] == [0, 2, 2]
    assert np.isnan(history[0].balanced_accuracy) and np.isnan(history[0].accuracy)
    assert all(0.0 <= record.balanced_accuracy <= 1.0 for record in history[1:])
    # round 2 is the first evaluation (its held-out sets ride along its training), round 3
    # evaluates on the kept outputs too: one round trip each
    assert [record.round_trips for record in history] == [shown + 5, shown + 6, shown + 6]
    # where a round's time went: inside the round trips (clients and messages) and the rest
    for record in history:
        assert 0.0 < record.median_round_trip_seconds <= record.transport_seconds
        assert record.transport_seconds < record.seconds
    with pytest.raises(ConfigError, match="evaluate_every must be >= 1"):
        small_config(evaluate_every=0)
    assert "evaluate_every" not in config.client_settings()  # the server's schedule


def test_a_client_dropping_mid_round_leaves_the_round_to_the_others(model, splits) -> None:
    def drop(envelope: Envelope) -> bool:
        return (
            envelope.node_id == 1
            and envelope.message_type == TRAIN_BLOCK
            and (envelope.config.get("block") == 2)
        )

    lines: list[str] = []
    history, _ = run_research(
        model,
        splits,
        small_config(rounds=1),
        Federation(num_clients=3),  # secure aggregation needs two updates
        drop=drop,
        log=lines.append,
    )
    assert history[0].clients_trained == 2
    assert any("node 1" in failure for failure in history[0].failures)
    assert any("left the round" in line for line in lines)


def test_too_few_clients_stops_with_a_clear_error(model, splits) -> None:
    def drop_all(envelope: Envelope) -> bool:
        return envelope.message_type != SETUP

    with pytest.raises(ProtocolError, match=r"0 clients finished training, need 2 \(secure"):
        run_research(
            model,
            splits,
            small_config(rounds=1),
            Federation(num_clients=2),
            drop=drop_all,
            log=lambda _: None,
        )


def test_a_data_owner_refuses_an_aggregate_smaller_than_its_policy(model, splits) -> None:
    """min-aggregate is the data owner's own rule: with two clients and a policy of three, no
    client reveals its unmasking shares, so the server learns no aggregate at all."""
    policy = DataOwnerPolicy(allow_plaintext=True, min_aggregate=3)
    with pytest.raises(ProtocolError, match="fewer than the policy's min-aggregate=3"):
        run_research(
            model, splits, small_config(rounds=1), Federation(num_clients=2), policy=policy
        )


def test_runs_resume_after_the_last_saved_round(model, splits, tmp_path: Path) -> None:
    federation = Federation(num_clients=2)
    quiet = {"log": lambda _: None}
    first, _ = run_research(
        model, splits, small_config(rounds=1), federation, checkpoint_dir=tmp_path, **quiet
    )
    with pytest.raises(CheckpointError, match="other settings"):
        run_research(
            model, splits, small_config(rounds=2), federation, checkpoint_dir=tmp_path, **quiet
        )
    # the same settings with more rounds is a different identity; resume uses the identical one
    resumed, transport = run_research(
        model, splits, small_config(rounds=1), federation, checkpoint_dir=tmp_path, **quiet
    )
    assert resumed == first
    assert transport.stats.round_trips == 1  # setup only: nothing left to run


# -- secure aggregation ----------------------------------------------------------------------------
# Four clients (Dirichlet partition of the small pool) with 3 batches per round: weights N_k of
# 48, 32, 32 and 48 examples, so the averages below are really weighted (Eq. 7).
SECURE_FEDERATION = Federation(num_clients=4)


def secure_config(**changes) -> DoubleBlindConfig:
    return small_config(rounds=1, batches_per_round=3, **changes)


class RecordingAverage(WeightedAverage):
    """The default aggregation, keeping what it was given and what it returned."""

    def __init__(self) -> None:
        self.inputs: list[tuple[dict[str, np.ndarray], object]] = []
        self.results: list[dict[str, np.ndarray]] = []

    def aggregate(self, server_round, global_arrays, updates):
        self.inputs.append((global_arrays, updates))
        self.results.append(super().aggregate(server_round, global_arrays, updates))
        return self.results[-1]

    def aggregate_secure(self, server_round, global_arrays, aggregate):
        self.inputs.append((global_arrays, aggregate))
        self.results.append(super().aggregate_secure(server_round, global_arrays, aggregate))
        return self.results[-1]


def one_round(model, splits, config, *, drop=None, lines=None):
    """Round 1 of a run with SECURE_FEDERATION: its record, new global arrays and transport."""
    aggregator = RecordingAverage()
    history, transport = run_research(
        model,
        splits,
        config,
        SECURE_FEDERATION,
        aggregator=aggregator,
        drop=drop,
        log=lines.append if lines is not None else (lambda _: None),
    )
    return history[0], aggregator.results[0], transport


@pytest.fixture(scope="module")
def plain_round(model, splits):
    """The same round with secure aggregation off: the global arrays before it, each client's
    update (the server sees them all), and the record."""
    aggregator = RecordingAverage()
    history, _ = run_research(
        model,
        splits,
        secure_config(secure_aggregation=False),
        SECURE_FEDERATION,
        aggregator=aggregator,
        log=lambda _: None,
    )
    global_arrays, updates = aggregator.inputs[0]
    return global_arrays, updates, history[0]


def assert_within_quantization(secure, plain, config) -> None:
    """The documented bound: one quantization step ``2c / (2**bits - 1)`` per value, plus the
    float32 rounding of parameters and sums (a few units in the last place: 2**-20 |w|)."""
    step = config.secagg_config(2).quantizer.step
    assert set(secure) == set(plain)
    for name, value in plain.items():
        bound = step + 2.0**-20 * float(np.abs(value).max())
        np.testing.assert_allclose(secure[name], value, rtol=0, atol=bound, err_msg=name)


def test_secure_aggregation_gives_the_plain_weighted_average(model, splits, plain_round) -> None:
    """Same seed, same batches and steps: the securely aggregated global arrays equal FedAvg's
    weighted average of the clients' parameters (Eq. 7) within the quantization bound."""
    global_arrays, updates, plain_record = plain_round
    weights = [update.num_examples for update in updates]
    assert len(set(weights)) > 1  # unequal N_k: the weighting matters
    lines: list[str] = []
    config = secure_config()
    record, secure, transport = one_round(model, splits, config, lines=lines)
    expected = WeightedAverage().aggregate(1, global_arrays, updates)
    assert_within_quantization(secure, expected, config)
    assert not all(np.array_equal(secure[k], expected[k]) for k in expected)  # really quantized
    assert record.train_loss == plain_record.train_loss  # the same training, before aggregation
    assert record.clients_trained == 4 and record.failures == []
    assert record.round_trips == plain_record.round_trips + len(STAGES)
    assert transport.stats.by_type[TRAIN_SECAGG]["messages"] == 4 * len(STAGES)
    for stage in STAGES:
        assert f"stage {stage}, 4 replies of 4" in "\n".join(lines)


def test_the_server_receives_masked_updates_only(model, splits) -> None:
    """Everything a client sends after training: no parameters with the loss, and a masked input
    uncorrelated with its true update (which stayed unclipped on the client)."""
    config = secure_config()
    seen: dict[int, dict[str, object]] = {}

    def observe(node: int, request: Envelope, reply: Envelope, state: ClientState) -> None:
        mine = seen.setdefault(node, {})
        if request.message_type == TRAIN_LOSS:
            mine["loss_reply"] = reply.arrays
        if request.message_type == TRAIN_SECAGG:
            for array in reply.arrays.values():  # ids, keys, ciphertexts, masked input, shares
                assert array.dtype in (np.uint8, np.uint64)
            if request.config["secagg.stage"] == COLLECT_MASKED_INPUT:
                mine["masked"] = decode_reply(reply.arrays, reply.config).masked_input
                mine["update"] = state.group("update")
                mine["weight"] = state.config["update.num_examples"]
                secagg = {k: v for k, v in state.arrays.items() if k.startswith("secagg.")}
                settings = {k: v for k, v in state.config.items() if k.startswith("secagg.")}
                mine["clipped"] = ClientSecAggState.from_records(secagg, settings).clipped_values

    datasets = federation_data(splits, SECURE_FEDERATION, config)
    run_observed(model, datasets, config, observers=[observe], log=lambda _: None)
    assert sorted(seen) == [0, 1, 2, 3]
    for node, mine in seen.items():
        assert mine["loss_reply"] == {}, f"node {node} sent parameters with its loss"
        assert mine["clipped"] == 0
        layout = ArrayLayout.of(mine["update"])
        delta = layout.flatten(mine["update"])
        assert 0 < np.abs(delta).max() < config.secagg_clipping_range / 4
        masked = mine["masked"]
        assert masked.shape == (layout.size + 1,)
        # unmasked, every value would be below N * (2**bits - 1); masked, they are uniform
        largest_plain = mine["weight"] * config.secagg_config(2).quantizer.max_level
        assert np.mean(masked < np.uint64(largest_plain)) < 1e-3
        uniform = masked.astype(np.float64) / 2.0**64
        assert abs(uniform.mean() - 0.5) < 0.02
        assert abs(np.corrcoef(uniform[:-1], delta)[0, 1]) < 0.06


@pytest.mark.parametrize(
    ("dropped_at", "included"),
    [
        ((TRAIN_BLOCK, None), False),  # before training
        ((TRAIN_LOSS, None), False),  # after training, before its update is announced
        ((TRAIN_SECAGG, ADVERTISE_KEYS), False),
        ((TRAIN_SECAGG, SHARE_KEYS), False),
        ((TRAIN_SECAGG, COLLECT_MASKED_INPUT), False),
        ((TRAIN_SECAGG, UNMASK), True),  # its masked input is in: neighbours' shares unmask it
    ],
)
def test_a_client_dropping_at_any_stage_leaves_the_others_aggregate(
    model, splits, plain_round, dropped_at, included
) -> None:
    global_arrays, updates, plain_record = plain_round
    message_type, stage = dropped_at

    def drop(envelope: Envelope) -> bool:
        return (
            envelope.node_id == 1
            and envelope.message_type == message_type
            and envelope.config.get("secagg.stage") == stage
        )

    config = secure_config()
    record, secure, _ = one_round(model, splits, config, drop=drop)
    kept = [u for u in updates if included or u.node_id != 1]
    assert_within_quantization(secure, WeightedAverage().aggregate(1, global_arrays, kept), config)
    assert record.clients_trained == len(kept)
    assert any(failure.startswith("node 1:") for failure in record.failures), record.failures
    assert record.round_trips == plain_record.round_trips + len(STAGES)


@pytest.mark.parametrize(
    ("dropped", "stage", "message"),
    [
        ({1, 2, 3}, ADVERTISE_KEYS, "only 1 clients remain after advertise_keys, fewer than min"),
        # 4 clients, 3 neighbours each, threshold 2: two survivors hold 1 share of each other
        ({1, 2}, COLLECT_MASKED_INPUT, "cannot reconstruct the self-mask seed of node"),
    ],
)
def test_too_many_secure_aggregation_dropouts_fail_the_round_clearly(
    model, splits, dropped, stage, message
) -> None:
    def drop(envelope: Envelope) -> bool:
        return envelope.node_id in dropped and envelope.config.get("secagg.stage") == stage

    with pytest.raises(ProtocolError, match=f"round 1: secure aggregation failed: {message}"):
        one_round(model, splits, secure_config(), drop=drop)


def test_client_answers_secure_aggregation_only_after_training_and_in_order(model, splits) -> None:
    """Two clients through the SecAgg stages by hand: refused messages change nothing, the
    stages end in ``ready`` with the update gone, an update is never masked twice, and the
    result is the weighted average of the two updates."""
    config = secure_config()
    server = research_server(model, config)
    clients, states, deltas, weights = {}, {}, {}, {}
    keys = signed_federation((7, 8))
    for node, count in ((7, 80), (8, 40)):  # 3 and 2 batches of 16: weights 48 and 32
        clients[node] = DoubleBlindClient(
            make_data(splits, count), BACKEND, policy=PLAIN, authentication=keys[node]
        )
        reply, states[node] = clients[node].handle(server.setup_request(node), ClientState())
        server.on_setup(reply)
    initial = server.initial_arrays(96)
    secagg = SecAggServer(config.secagg_config(2), ArrayLayout.of(initial), round_id=1)
    requests = secagg.start([7, 8])

    round_entries = ("update.", "secagg.")  # what the state holds only during a round

    def ask(node: int, request, state: ClientState, round_id: int = 1):
        answer, new_state = clients[node].handle(
            Envelope(TRAIN_SECAGG, node, round_id, *request.to_records()), state
        )
        return decode_reply(answer.arrays, answer.config), new_state

    with pytest.raises(ProtocolError, match=r"'ready' cannot accept 'train\.secagg'"):
        ask(7, requests[7], states[7])  # before training
    for node in (7, 8):
        outcome = server.start("train", node, 1, initial)
        while isinstance(outcome, Envelope):
            reply, states[node] = clients[node].handle(outcome, states[node])
            outcome = server.on_reply(reply)
        assert states[node].stage == "trained" and outcome.arrays == {}
        deltas[node], weights[node] = states[node].group("update"), outcome.num_examples
    trained = dict(states)
    with pytest.raises(ProtocolError, match=r"for round 2 \(secagg round 1\), but the client"):
        ask(7, requests[7], trained[7], round_id=2)

    for stage in STAGES:
        assert secagg.stage == stage
        replies = {}
        for node, request in requests.items():
            replies[node], states[node] = ask(node, request, states[node])
        if stage == ADVERTISE_KEYS:  # an update is masked once: no second advertise_keys
            with pytest.raises(ProtocolError, match=r"advertise_keys .* round 1 \(secagg\)"):
                ask(7, requests[7], states[7])
        if stage == SHARE_KEYS:  # and not without advertise_keys first
            with pytest.raises(ProtocolError, match=r"share_keys .* round 1 \(trained\)"):
                ask(7, requests[7], trained[7])
        requests = secagg.on_replies(replies)
    assert requests == {}
    for state in states.values():
        assert state.stage == "ready"
        assert not [k for k in [*state.arrays, *state.config] if k.startswith(round_entries)]

    result = secagg.result()
    assert result.total_weight == sum(weights.values()) == 80
    average = {
        name: sum(deltas[node][name] * (weights[node] / 80) for node in (7, 8)) for name in initial
    }
    assert_within_quantization(result.arrays, average, config)


def test_a_long_lived_role_restores_its_key_owner_once_per_key_state() -> None:
    """A site keeps one DoubleBlindClient per run: the same key arrays (the state the site holds
    in memory) give the same key owner without restoring it again; other arrays restore anew."""
    from fedfm.protocols.double_blind.client import DoubleBlindClient

    class CountingBackend:
        restored = 0

        def restore_key_owner(self, arrays: dict) -> object:
            CountingBackend.restored += 1
            return object()

    client = DoubleBlindClient(lambda: None)  # type: ignore[arg-type, return-value]
    backend = CountingBackend()
    keys = {"context": np.zeros(4, dtype=np.uint8), "geometry": np.ones(2)}
    first = client._restored_key_owner(backend, keys)  # type: ignore[arg-type]
    assert client._restored_key_owner(backend, dict(keys)) is first
    assert CountingBackend.restored == 1
    other = {**keys, "context": keys["context"].copy()}  # equal values, another state
    assert client._restored_key_owner(backend, other) is not first  # type: ignore[arg-type]
    assert CountingBackend.restored == 2
