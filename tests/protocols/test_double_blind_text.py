"""The double-blind protocol on a BERT-family text encoder (fedfm.protocols.double_blind.text):
the data owner embeds its tokens with the server's tables, uploads key masks, and the protocol's
update is the plaintext SGD step of mean-pooled side adapters on the masked blocks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from fedfm.approx import ApproxConfig
from fedfm.crypto import SimulateBackend, get_backend
from fedfm.crypto.randomness import ResearchStream
from fedfm.distillation.text import polynomial_student
from fedfm.errors import ConfigError, DataError, ProtocolError
from fedfm.models.fhe_text import FheTextClassifier, to_fhe_text
from fedfm.protocols.double_blind import (
    ClientData,
    ClientState,
    DoubleBlindClient,
    DoubleBlindConfig,
    DoubleBlindServer,
    SideAdapterHead,
)
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.runner import run_clients_in_process
from fedfm.protocols.double_blind.text import TextClientData, embed_tokens, embedding_arrays
from fedfm.runtime.transport import Envelope
from tests.models.test_fhe_text import PAD, tiny_bert
from tests.protocols.test_double_blind import trained_params

TOKENS = 8
CLASSES = 3
WIDTH = 16
PLAIN = DataOwnerPolicy(allow_plaintext=True, require_secure_aggregation=False)
CALIBRATION = ((40, 0), (20, 100), (40, 1), (20, 101))  # the texts of text_data(seed=0 and 1)


def texts(count: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` right-padded texts of 1 to 8 tokens; the label is the first token's residue
    mod 3 (learnable from the tokens)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 50, size=(count, TOKENS))
    lengths = rng.integers(1, TOKENS + 1, size=count)
    for row, length in enumerate(lengths):
        ids[row, length:] = PAD
    return ids.astype(np.int64), ids != PAD, (ids[:, 0] % CLASSES).astype(np.int64)


def text_data(train: int = 40, held_out: int = 20, seed: int = 0) -> TextClientData:
    train_ids, train_mask, train_labels = texts(train, seed)
    eval_ids, eval_mask, eval_labels = texts(held_out, seed + 100)
    return TextClientData(
        train_ids, train_mask, train_labels, eval_ids, eval_mask, eval_labels, CLASSES
    )


@pytest.fixture(scope="module")
def student() -> FheTextClassifier:
    """A tiny BERT with every non-linearity polynomial (what CKKS can evaluate)."""
    teacher = to_fhe_text(
        tiny_bert(), ApproxConfig.exact(), num_classes=CLASSES, pad_token_id=PAD, max_tokens=TOKENS
    )
    approx = ApproxConfig.build(gelu_degree=4, gelu_radius=4.0, gelu_channel_scale=True)
    # calibrated on every text the tests' data owners hold (approximation domains cover them)
    calibration = [torch.from_numpy(texts(count, seed)[0]) for count, seed in CALIBRATION]
    return polynomial_student(teacher, approx, calibration).eval()


def small_config(**changes) -> DoubleBlindConfig:
    base = DoubleBlindConfig(rounds=3, batches_per_round=2, batch_size=16, reveal="all")
    return replace(base, **changes)


def text_pair(student, config, *, backend=None, policy=PLAIN, data=None):
    backend = backend or SimulateBackend()
    server = DoubleBlindServer(
        student,
        config,
        backend,
        num_classes=CLASSES,
        randomness=ResearchStream(3),
        log=lambda _: None,
    )
    client = DoubleBlindClient(data or text_data(), backend, policy=policy, partition_id=0)
    reply, state = client.handle(server.setup_request(7), ClientState())
    server.on_setup(reply)
    return server, client, state


def test_client_embeds_as_the_model_does(student) -> None:
    """The tables the server sends let the data owner compute the model's own embedding."""
    tables, eps = embedding_arrays(student)
    ids, _, _ = texts(5, 1)
    got = embed_tokens({k.split(".", 1)[1]: v for k, v in tables.items()}, eps, ids)
    with torch.no_grad():
        expected = student.embed(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    longer = np.full((1, TOKENS + 1), 1, dtype=np.int64)
    with pytest.raises(DataError, match="exceed the server model's 8 positions"):
        embed_tokens({k.split(".", 1)[1]: v for k, v in tables.items()}, eps, longer)
    with pytest.raises(DataError, match="outside the server model's table of 50"):
        embed_tokens({k.split(".", 1)[1]: v for k, v in tables.items()}, eps, ids + 60)


def _plaintext_step(student, data, batches, initial, lr, *, last_only=False, all_real=False):
    """The plaintext SGD step of the mean-pooled adapters on ``batches`` of training texts
    (``last_only``: on the last block's output alone; ``all_real``: with all-real key masks, as
    a data owner that hides its texts' lengths uploads them)."""
    taps = [student.num_blocks - 1] if last_only else list(range(student.num_blocks))
    adapter = SideAdapterHead(
        num_blocks=len(taps), dim=WIDTH, num_classes=CLASSES, rank=8, pooling="mean"
    )
    adapter.set_arrays(initial)
    losses = []
    for batch in batches:
        ids = torch.from_numpy(data.train_tokens[batch])
        mask = torch.from_numpy(data.train_key_mask[batch])
        if all_real:
            mask = torch.ones_like(mask)
        with torch.no_grad():
            hidden, outputs = student.embed(ids), []
            for index in range(student.num_blocks):
                hidden = student.block(index, hidden, mask)
                if index in taps:
                    outputs.append(hidden)
        identity = torch.arange(len(batch))
        logits = adapter(outputs, identity, torch.stack([identity] * len(taps)), mask)
        labels = torch.from_numpy(data.train_labels[batch])
        losses.append(torch.nn.functional.cross_entropy(logits, labels))
    loss = torch.stack(losses).mean()
    loss.backward()
    step = {
        name: (parameter - lr * parameter.grad).detach().numpy()
        for name, parameter in adapter.named_parameters()
    }
    return step, loss.item()


def _train_round(server, client, state, initial, riding):
    outcome = server.start("train", 7, 1, initial, with_evaluation=riding)
    flight = server.sessions[7].in_flight
    batches = [b.copy() for b in flight.indices[: server.config.batches_per_round]]
    while isinstance(outcome, Envelope):
        reply, state = client.handle(outcome, state)
        outcome = server.on_reply(reply)
    return outcome, state, batches


@pytest.mark.parametrize(
    ("secure", "riding", "reveal"),
    [(False, False, "all"), (True, True, "all"), (False, True, "last")],
)
def test_text_update_equals_plaintext_sgd_step(student, secure, riding, reveal) -> None:
    """Permuted rows with their key masks, client-side embedding and mean pooling in label
    order change nothing in the mathematics: the update is the plaintext step (with the first
    block hidden, ``reveal="last"``, too)."""
    config = small_config(momentum=0.0, lr=0.5, secure_aggregation=secure, reveal=reveal)
    server, client, state = text_pair(student, config)
    initial = server.initial_arrays(WIDTH)
    outcome, state, batches = _train_round(server, client, state, initial, riding)
    expected, loss = _plaintext_step(
        student, client.data, batches, initial, 0.5, last_only=reveal == "last"
    )
    params = trained_params(outcome, state, initial)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1e-5)
    assert outcome.train_loss == pytest.approx(loss, rel=1e-5)
    if riding:  # the held-out outputs and their key masks are kept for later evaluations
        assert state.group("kept")  # non-empty
        assert {f"keymask.{i}" for i in range(1)} <= set(state.group("kept"))


def test_the_key_masks_travel_with_the_permuted_rows(student) -> None:
    """Without the server's key masks (all real), the update is another: the masks are used."""
    config = small_config(momentum=0.0, lr=0.5, secure_aggregation=False)
    server, client, state = text_pair(student, config)
    initial = server.initial_arrays(WIDTH)
    outcome, _, batches = _train_round(server, client, state, initial, False)
    expected, _ = _plaintext_step(student, client.data, batches, initial, 0.5)
    hidden = text_pair(student, config, policy=replace(PLAIN, hide_text_lengths=True))
    assert hidden[0].sessions[7].train_key_mask.all()  # the server learns no length
    unmasked, _, hidden_batches = _train_round(*hidden, initial, False)
    # the same data and initial arrays (the server's draws may differ between the two runs)
    masked, _ = _plaintext_step(student, client.data, hidden_batches, initial, 0.5)
    gaps = [np.abs(unmasked.arrays[k] - masked[k]).max() for k in masked]
    assert max(gaps) > 1e-3  # attending to padding changes the step ...
    # ... to the plaintext step with all-real masks (what `fedfm paper-text
    # --hide-text-lengths` computes on cached block outputs)
    all_real, _ = _plaintext_step(student, client.data, hidden_batches, initial, 0.5, all_real=True)
    for name, value in all_real.items():
        np.testing.assert_allclose(unmasked.arrays[name], value, rtol=1e-4, atol=1e-5)
    matches = [np.abs(outcome.arrays[k] - expected[k]).max() for k in expected]
    assert max(matches) < 1e-4


def test_text_setup_refuses_mismatched_parties(student) -> None:
    config = small_config()
    server = DoubleBlindServer(
        student, config, SimulateBackend(), num_classes=CLASSES, log=lambda _: None
    )
    request = server.setup_request(1)
    assert request.config["input"] == "text" and "embedding.word" in request.arrays
    # a data owner holding images cannot join a text model's run
    images = ClientData(
        train_images=np.zeros((20, 3, 4, 4), dtype=np.float32),
        train_labels=np.zeros(20, dtype=np.int64),
        eval_images=np.zeros((8, 3, 4, 4), dtype=np.float32),
        eval_labels=np.zeros(8, dtype=np.int64),
        num_classes=CLASSES,
    )
    with pytest.raises(ProtocolError, match="reads texts; this data owner holds images"):
        DoubleBlindClient(images, SimulateBackend(), policy=PLAIN).handle(request, ClientState())

    # texts padded to another length than the model reads
    def padded(count: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids, mask, labels = texts(count, seed)
        return (
            np.pad(ids, ((0, 0), (0, 2)), constant_values=PAD),
            np.pad(mask, ((0, 0), (0, 2))),
            labels,
        )

    data = TextClientData(*padded(20, 3), *padded(16, 4), CLASSES)
    client = DoubleBlindClient(data, SimulateBackend(), policy=PLAIN)
    with pytest.raises(ProtocolError, match="reads 8 tokens per text; this data owner's texts"):
        client.handle(request, ClientState())
    # a reply whose key masks are not booleans of (texts, tokens) is refused, nothing registered
    reply, _ = DoubleBlindClient(text_data(), SimulateBackend(), policy=PLAIN).handle(
        request, ClientState()
    )
    reply.arrays["train_key_mask"] = reply.arrays["train_key_mask"].astype(np.float32)
    with pytest.raises(ProtocolError, match="train upload's key mask must be booleans"):
        server.on_setup(reply)
    assert server.sessions == {}


def test_bad_text_data_is_refused_with_its_problem() -> None:
    ids, mask, labels = texts(6, 0)
    empty = mask.copy()
    empty[0] = False
    with pytest.raises(DataError, match="a text without a real token"):
        TextClientData(ids, empty, labels, ids, mask, labels, CLASSES)
    with pytest.raises(DataError, match="key mask must be booleans"):
        TextClientData(ids, mask.astype(int), labels, ids, mask, labels, CLASSES)
    with pytest.raises(DataError, match="token ids must be integers"):
        TextClientData(ids.astype(float), mask, labels, ids, mask, labels, CLASSES)


def test_text_run_in_process_trains_and_evaluates(student) -> None:
    """Two data owners, three rounds in one process: every round evaluates every held-out text
    (the first in full, riding along training, then on the kept outputs) and the training loss
    falls."""
    config = small_config(rounds=3, lr=0.5)
    history, _ = run_clients_in_process(
        student,
        [text_data(seed=0), text_data(seed=1)],
        config,
        num_classes=CLASSES,
        identity={"test": "text"},
        policy=PLAIN,
        randomness=ResearchStream(5),
        log=lambda _: None,
        device="cpu",
    )
    assert len(history) == 3
    for record in history:
        assert record.clients_evaluated == 2 and record.failures == []
        assert 0.0 <= record.balanced_accuracy <= 1.0
    assert history[-1].train_loss < history[0].train_loss


@pytest.mark.slow
@pytest.mark.ckks
def test_text_update_under_ckks_equals_plaintext_step(student) -> None:
    """The same round under CKKS (N = 8192): the update matches the plaintext step within the
    scheme's error."""
    config = small_config(momentum=0.0, lr=0.5, secure_aggregation=False, backend="ckks-8192")
    server, client, state = text_pair(
        student,
        config,
        backend=get_backend("ckks-8192"),
        policy=DataOwnerPolicy(require_secure_aggregation=False),
    )
    initial = server.initial_arrays(WIDTH)
    outcome, _, batches = _train_round(server, client, state, initial, False)
    expected, loss = _plaintext_step(student, client.data, batches, initial, 0.5)
    for name, value in expected.items():
        np.testing.assert_allclose(outcome.arrays[name], value, rtol=1e-3, atol=1e-3)
    assert outcome.train_loss == pytest.approx(loss, rel=1e-3)


def test_hiding_text_lengths_is_the_data_owners_node_config() -> None:
    assert DataOwnerPolicy.from_node_config({"hide-text-lengths": "true"}).hide_text_lengths
    assert not DataOwnerPolicy.from_node_config({}).hide_text_lengths
    with pytest.raises(ConfigError, match="'hide-text-lengths' must be true or false"):
        DataOwnerPolicy.from_node_config({"hide-text-lengths": "maybe"})
