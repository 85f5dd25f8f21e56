"""The double-blind protocol as Flower apps: codec, ClientApp, strategies, ServerApp, flwr run."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path
from uuid import uuid4

import numpy as np
import pytest
import tenseal as ts
import torch
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedfm.approx import ApproxConfig, calibrate
from fedfm.crypto import SimulateBackend
from fedfm.crypto.randomness import SecretStream, write_secret_file
from fedfm.data import load_splits
from fedfm.distillation.pipeline import ApproxSettings, load_student, save_student
from fedfm.distillation.text import kept_student_path, polynomial_student, student_run
from fedfm.errors import ConfigError, ProtocolError
from fedfm.flower.apps import NODE_CONFIG_ENV, make_client_app, parse_node_config
from fedfm.flower.codec import (
    HOLD_MESSAGE_TYPE,
    envelope_to_message,
    envelope_to_reply,
    hold_message,
    hold_seconds,
    message_to_envelope,
)
from fedfm.flower.transport import (
    HOLD_FIRST,
    HOLD_MARGIN,
    HOLD_SLACK,
    SUPERNODE_REPLY_POLL,
    FlowerTransport,
)
from fedfm.models import ModelSpec, to_fhe_friendly
from fedfm.models.fhe_text import load_text_encoder, to_fhe_text
from fedfm.models.student import TextStudentSource
from fedfm.protocols.double_blind import (
    ClientState,
    ClientUpdate,
    DoubleBlindConfig,
    DoubleBlindServer,
    SecureAggregate,
    WeightedAverage,
)
from fedfm.protocols.double_blind.config import (
    REFRESH,
    SETUP,
    TRAIN_BLOCK,
    TRAIN_LOSS,
    TRAIN_SECAGG,
)
from fedfm.protocols.double_blind.defaults import PROTOCOL
from fedfm.protocols.double_blind.identities import create_simulation_identities
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.runner import (
    Federation,
    federation_data,
    run_clients_in_process,
    run_in_process,
    text_federation_data,
)
from fedfm.protocols.double_blind.settings import DEFAULTS, app_settings
from fedfm.protocols.secure_aggregation import run_in_process as secure_aggregate
from fedfm.runtime.identity import format_pins
from fedfm.runtime.settings import identity_file
from fedfm.runtime.transport import Envelope, Failure
from fedfm.secagg import STAGES, SecAggConfig
from fedfm.secagg import ClientUpdate as MaskedUpdate
from fedfm_clients.double_blind import app as client_app
from fedfm_clients.double_blind import client_role, load_state, save_state
from fedfm_strategies.aggregation import (
    AGGREGATE_NODE_ID,
    StrategyAggregator,
    make_strategy,
    task_identity,
)
from fedfm_strategies.double_blind import SERVER_SECRET_ENV, run_adaptation
from tests.helpers import processes_with, save_micro_student, save_tiny_text_encoder

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "simulations" / "double_blind"
IMAGE = 16
QUIET = {"log": lambda _: None}


@pytest.fixture(autouse=True)
def identity():
    """Flower stamps new messages with the runtime's task identity; lend one outside a runtime."""
    with task_identity():
        yield


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server_secret(tmp_path_factory) -> Path:
    """The model owner's secret file: keys the server's draws in every run of this module, so a
    Flower run and an in-process run draw the same batches and permutations."""
    path = tmp_path_factory.mktemp("server") / "server.secret"
    write_secret_file(path)
    return path


@pytest.fixture(autouse=True)
def parties_settings(monkeypatch, server_secret):
    """What each party decides for itself, outside the run config: the simulated data owners
    accept the plaintext backend (their node config), the server keys its draws (its file)."""
    monkeypatch.setenv(NODE_CONFIG_ENV, "allow-plaintext=true")
    monkeypatch.setenv(SERVER_SECRET_ENV, str(server_secret))


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory) -> Path:
    """An untrained, calibrated student: these tests check plumbing and equality, not accuracy."""
    folder = tmp_path_factory.mktemp("student")
    splits = load_splits("digits", image_size=IMAGE, max_samples=120, seed=0)
    torch.manual_seed(0)
    spec = ModelSpec("vit_fedfm_tiny", 10, IMAGE)
    student = to_fhe_friendly(spec.build(), ApproxSettings().build())
    calibrate(student, [splits.aux.images[:64]])
    save_student(folder / "student.pt", student, spec, ApproxSettings())
    return folder


def run_config(student_dir: Path, **changes: object) -> dict[str, object]:
    """Three clients, two rounds of one batch: small enough for CI."""
    values: dict[str, object] = {
        "num-clients": 3,
        "rounds": 2,
        "batches-per-round": 1,
        "reveal": "all",  # every block's round trip goes through the apps
        "image-size": IMAGE,
        "workdir": str(student_dir),
    }
    return values | changes


# Each data owner's own SecAgg identity and pins (node config), made once for the module.
OWNERS: dict[int, dict[str, object]] = {}


@pytest.fixture(scope="module", autouse=True)
def data_owners(tmp_path_factory):
    """Identity keys of partitions 0..2 and the pins of all three, as the data owners' node
    config gives them (SecAgg refuses without)."""
    folder = tmp_path_factory.mktemp("data-owners")
    pins = format_pins(create_simulation_identities(folder, 3))
    OWNERS.update(
        {k: {"identity-key": str(identity_file(folder, k)), "secagg-pins": pins} for k in range(3)}
    )
    yield
    OWNERS.clear()


def node_context(node_id: int, partition: int, config: dict[str, object], count: int = 3):
    return Context(
        run_id=1,
        node_id=node_id,
        node_config={"partition-id": partition, "num-partitions": count, **OWNERS[partition]},
        state=RecordDict(),
        run_config=config,
    )


def wire(message: Message) -> Message:
    """The message as the receiving end gets it (Flower's protobuf form and back)."""
    return message_from_proto(message_to_proto(message))


def carries(message: Message, secret: bytes) -> bool:
    return secret in message_to_proto(message).SerializeToString()


# -- run config ---------------------------------------------------------------------------------


def test_app_pyproject_declares_the_components_and_every_default() -> None:
    project = tomllib.loads((APP / "pyproject.toml").read_text())
    flwr = project["tool"]["flwr"]
    assert flwr["app"]["components"] == {
        "serverapp": "fedfm_strategies.double_blind:app",
        "clientapp": "fedfm_clients.double_blind:app",
    }
    assert flwr["app"]["config"] == DEFAULTS
    assert "federations" not in flwr  # flwr run would migrate (rewrite) a legacy table


def test_run_config_defaults_come_from_the_one_table() -> None:
    """The apps' defaults are the protocol's and the federation's, not a copy of them."""
    settings = app_settings({})
    assert settings.protocol == DoubleBlindConfig()
    assert settings.federation == Federation()
    assert DEFAULTS["rounds"] == DoubleBlindConfig().rounds == PROTOCOL.rounds


def test_the_server_app_refuses_without_a_student_and_names_the_command(tmp_path) -> None:
    """Distillation is the model owner's offline step: the ServerApp never runs it."""
    empty = tmp_path / "no-student"
    config = run_config(empty, dataset="digits", **{"max-samples": 40})
    with pytest.raises(ConfigError, match=r"fedfm distill --workdir .*no-student --dataset digits"):
        run_adaptation(None, config, log=lambda _line: None)  # type: ignore[arg-type]
    assert not empty.exists()  # nothing was made on its behalf


def test_run_config_is_checked() -> None:
    settings = app_settings({"rounds": 3, "dirichlet-alpha": 1, "timeout": 0.0})
    assert settings.protocol.rounds == 3 and settings.federation.alpha == 1.0
    assert settings.timeout is None and settings.checkpoint_dir is None
    assert settings.student.image_size is None  # 0: the model's own input size
    with pytest.raises(ConfigError, match="unknown run config keys"):
        app_settings({"round": 3})
    with pytest.raises(ConfigError, match="'rounds' must be int"):
        app_settings({"rounds": "3"})
    with pytest.raises(ConfigError, match="below the minimum"):
        app_settings({"batch-size": 8})


# -- codec --------------------------------------------------------------------------------------


def test_envelope_travels_as_a_flower_message_and_back() -> None:
    arrays = {
        "values": np.arange(12, dtype=np.float32).reshape(3, 4),
        "key_id": np.frombuffer(b"\x00\xffkey", dtype=np.uint8).copy(),
        "steps": np.array([[2, 0, 1]], dtype=np.int64),
        "scalar": np.array(7, dtype=np.int64),
        # SecAgg: node ids and masked inputs span all of uint64; no neighbours is a (0, 32) matrix
        "secagg.ids": np.array([1, 2**63, 2**64 - 1], dtype=np.uint64),
        "secagg.keys": np.zeros((0, 32), dtype=np.uint8),
    }
    config = {"context": b"\x00\x01bytes", "name": "x", "count": 3, "loss": 0.25, "flag": True}
    sent = Envelope(TRAIN_BLOCK, 42, 5, arrays, config)
    request = wire(envelope_to_message(sent))
    assert request.metadata.message_type == TRAIN_BLOCK
    assert request.metadata.dst_node_id == 42 and request.metadata.group_id == "5"
    received = message_to_envelope(request, request.metadata.dst_node_id)
    assert received.config == config
    assert [type(v) for v in received.config.values()] == [bytes, str, int, float, bool]
    assert set(received.arrays) == set(arrays)
    for name, array in arrays.items():
        assert received.arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(received.arrays[name], array)

    reply = wire(envelope_to_reply(Envelope(TRAIN_BLOCK, 42, 5, arrays, {"ok": 1}), request))
    assert reply.metadata.src_node_id == 42
    back = message_to_envelope(reply, reply.metadata.src_node_id)
    assert (back.node_id, back.round, back.config) == (42, 5, {"ok": 1})


def test_codec_names_what_it_cannot_carry() -> None:
    with pytest.raises(ProtocolError, match="NoneType"):
        envelope_to_message(Envelope(SETUP, 1, 0, {}, {"seed": None}))  # type: ignore[dict-item]
    request = envelope_to_message(Envelope(SETUP, 1, 0))
    with pytest.raises(ProtocolError, match="cannot answer"):
        envelope_to_reply(Envelope(TRAIN_LOSS, 1, 0), request)
    error = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "boom"), reply_to=request)
    with pytest.raises(ProtocolError, match="boom"):
        message_to_envelope(error, 1)
    with pytest.raises(ProtocolError, match="lacks"):
        message_to_envelope(Message(RecordDict(), dst_node_id=1, message_type=SETUP), 1)


def test_client_state_round_trips_through_context_state() -> None:
    state = ClientState(
        stage="train",
        round=3,
        block=2,
        config={
            "rank": 8,
            "lr": 0.05,
            "permute": True,
            "backend": "simulate",
            "blob": b"\x00k",
            "secagg.stage": "shared",
            "secagg.clipping_range": 1.0,
        },
        arrays={
            "key.secret": np.arange(32, dtype=np.uint8),
            "block1.0": np.ones((2, 3, 4), dtype=np.float32),
            "perm.steps.0": np.arange(6, dtype=np.int64).reshape(2, 3),
            "update.head.bias": np.full(10, -0.25, dtype=np.float32),
            "secagg.neighbour_ids": np.array([3, 2**64 - 1], dtype=np.uint64),
            "secagg.received_ciphertexts": np.zeros((0, 132), dtype=np.uint8),
        },
    )
    context = node_context(9, 0, {})
    assert load_state(context.state) == ClientState()
    save_state(state, context.state)
    restored = load_state(context_from_proto(context_to_proto(context)).state)
    assert (restored.stage, restored.round, restored.block) == ("train", 3, 2)
    assert restored.config == state.config
    assert set(restored.arrays) == set(state.arrays)
    for name, array in state.arrays.items():
        assert restored.arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(restored.arrays[name], array)
    # half a state (one record lost) is refused by name, not read as a fresh client
    del context.state["fedfm.double_blind.arrays"]
    with pytest.raises(ConfigError, match=r"damaged 'fedfm\.double_blind\.state'"):
        load_state(context.state)


# -- ClientApp ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_model(student_dir):
    return load_student(student_dir / "student.pt")


def ask(context: Context, envelope: Envelope) -> Message:
    """Send one envelope through the ClientApp as a Flower runtime would; the reply as received."""
    return wire(client_app(wire(envelope_to_message(envelope)), context))


def test_client_app_runs_setup_and_a_round_and_the_key_stays_in_context_state(
    student_dir, server_model
) -> None:
    context = node_context(42, 1, run_config(student_dir))
    server = DoubleBlindServer(
        server_model,
        DoubleBlindConfig(rounds=1, batches_per_round=1, reveal="all"),
        SimulateBackend(),
        num_classes=10,
        **QUIET,
    )
    replies = [ask(context, server.setup_request(42))]
    server.on_setup(message_to_envelope(replies[-1], 42))
    request = server.start("train", 42, 1, server.initial_arrays(96))
    while isinstance(request, Envelope):
        replies.append(ask(context, request))
        request = server.on_reply(message_to_envelope(replies[-1], 42))
    assert isinstance(request, ClientUpdate) and request.num_examples == 16
    assert [r.metadata.message_type for r in replies] == [SETUP] + [TRAIN_BLOCK] * 4 + [TRAIN_LOSS]
    # secure aggregation (the default): the update waits in context.state for the SecAgg stages
    assert request.arrays == {} and message_to_envelope(replies[-1], 42).arrays == {}
    kept = load_state(context.state)
    assert kept.stage == "trained" and set(kept.group("update")) == set(server.initial_arrays(96))

    secret = bytes(load_state(context.state).group("key")["secret"])
    assert len(secret) == 32
    assert secret in context_to_proto(context).SerializeToString()
    assert not any(carries(reply, secret) for reply in replies)


def test_client_app_partition_k_holds_the_in_process_client_k_data(student_dir) -> None:
    config = run_config(student_dir)
    settings = app_settings(config)
    splits, _ = settings.student.load_data()
    expected = federation_data(splits, settings.federation, settings.protocol)
    for partition in range(3):
        role = client_role(node_context(100 + partition, partition, config))
        assert role.partition_id == partition
        np.testing.assert_array_equal(role.data.train_labels, expected[partition].train_labels)
        np.testing.assert_array_equal(role.data.eval_images, expected[partition].eval_images)
    with pytest.raises(ConfigError, match="partition-id"):
        client_role(Context(1, 1, {}, RecordDict(), config))


def test_refused_messages_get_an_error_reply_and_leave_context_state_alone(
    student_dir, server_model
) -> None:
    context = node_context(42, 0, run_config(student_dir))
    server = DoubleBlindServer(
        server_model, DoubleBlindConfig(), SimulateBackend(), num_classes=10, **QUIET
    )
    assert not ask(context, server.setup_request(42)).has_error()
    before = context_to_proto(context).SerializeToString()

    for early in (TRAIN_LOSS, TRAIN_SECAGG):  # a loss step or a SecAgg stage before training
        reply = ask(context, Envelope(early, 42, 1))
        assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        assert "ProtocolError" in reply.error.reason and "cannot accept" in reply.error.reason
        assert context_to_proto(context).SerializeToString() == before

    # An action no handler is registered for: Flower's ClientApp raises, and Flower's runtimes
    # (simulation: vce_api.worker; deployment: run_clientapp) answer with an error reply.
    with pytest.raises(ValueError, match="No train function registered with name 'nope'"):
        client_app(wire(envelope_to_message(Envelope("train.nope", 42, 1))), context)
    assert context_to_proto(context).SerializeToString() == before


# -- strategies ---------------------------------------------------------------------------------


def updates() -> tuple[dict[str, np.ndarray], list[ClientUpdate]]:
    rng = np.random.default_rng(0)
    arrays = {"head.weight": rng.normal(size=(10, 96)), "head.bias": rng.normal(size=10)}
    arrays = {name: value.astype(np.float32) for name, value in arrays.items()}
    moved = [
        ClientUpdate(
            node,
            {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in arrays.items()},
            count,
            1.0,
        )
        for node, count in ((11, 16), (12, 48), (13, 32))
    ]
    return arrays, moved


def test_fedavg_through_flower_equals_fedfm_weighted_average() -> None:
    arrays, moved = updates()
    expected = WeightedAverage().aggregate(1, arrays, moved)
    result = StrategyAggregator(make_strategy("fedavg")).aggregate(1, arrays, moved)
    assert set(result) == set(expected)
    for name in expected:
        assert result[name].dtype == np.float32
        np.testing.assert_array_equal(result[name], expected[name])


def test_fedadam_needs_configure_train_and_moves_elsewhere() -> None:
    arrays, moved = updates()
    average = WeightedAverage().aggregate(1, arrays, moved)
    aggregator = StrategyAggregator(make_strategy("fedadam"))
    first = aggregator.aggregate(1, arrays, moved)
    second = aggregator.aggregate(2, first, moved)
    for name in arrays:
        assert first[name].dtype == np.float32 and np.isfinite(second[name]).all()
        assert not np.allclose(first[name], average[name])
    np.testing.assert_array_equal(
        aggregator.strategy.current_arrays["head.bias"], first["head.bias"]
    )


def secure_aggregate_of(
    arrays: dict[str, np.ndarray], moved: list[ClientUpdate]
) -> tuple[SecureAggregate, float]:
    """What the driver hands a strategy under secure aggregation: the global arrays plus the
    securely averaged updates (real SecAgg over the clients' differences), and the bound on
    its distance from the plain weighted average: one quantization step plus float32 rounding."""
    config = SecAggConfig(clipping_range=8.0)  # the updates here move by N(0, 1)
    result = secure_aggregate(
        config,
        {
            u.node_id: MaskedUpdate({k: u.arrays[k] - v for k, v in arrays.items()}, u.num_examples)
            for u in moved
        },
    )
    aggregate = SecureAggregate(
        {k: (v + result.arrays[k]).astype(v.dtype) for k, v in arrays.items()},
        result.total_weight,
        result.included,
        1.0,
    )
    scale = max(float(np.abs(v).max()) for v in aggregate.arrays.values())
    return aggregate, config.quantizer.step + 2.0**-20 * scale


def test_fedavg_returns_the_secure_aggregate_unchanged() -> None:
    arrays, moved = updates()
    aggregate, bound = secure_aggregate_of(arrays, moved)
    assert aggregate.included == {11, 12, 13} and aggregate.total_weight == 96
    result = StrategyAggregator(make_strategy("fedavg")).aggregate_secure(1, arrays, aggregate)
    average = WeightedAverage().aggregate(1, arrays, moved)
    for name, value in result.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, aggregate.arrays[name])
        np.testing.assert_allclose(value, average[name], rtol=0, atol=bound)


def test_fedadam_on_the_secure_aggregate_equals_fedadam_on_the_plain_average() -> None:
    """FedAdam's server step sees one reply (the aggregate) instead of three, and moves the
    same way: its step ``eta m / (sqrt(v) + tau)``, with ``m = (1 - beta_1) d`` and
    ``v = (1 - beta_2) d**2`` for the averaged update ``d``, changes by at most
    ``eta (1 - beta_1) / tau`` times ``d``'s quantization error."""
    arrays, moved = updates()
    aggregate, bound = secure_aggregate_of(arrays, moved)
    plain = StrategyAggregator(make_strategy("fedadam"))
    secure = StrategyAggregator(make_strategy("fedadam"))
    expected = plain.aggregate(1, arrays, moved)
    result = secure.aggregate_secure(1, arrays, aggregate)
    strategy = plain.strategy
    gain = strategy.eta * (1 - strategy.beta_1) / strategy.tau
    for name, value in expected.items():
        np.testing.assert_allclose(result[name], value, rtol=0, atol=gain * bound)
        assert not np.allclose(result[name], aggregate.arrays[name])  # FedAdam moved elsewhere


class RecordingFedAvg(FedAvg):
    """A custom strategy: FedAvg that records what it was asked."""

    def __init__(self) -> None:
        super().__init__(min_available_nodes=3)
        self.calls: list[tuple[str, int, list[int]]] = []

    def configure_train(self, server_round, arrays, config, grid):
        self.calls.append(("configure_train", server_round, sorted(grid.get_node_ids())))
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        nodes = sorted(reply.metadata.src_node_id for reply in replies)
        self.calls.append(("aggregate_train", server_round, nodes))
        return super().aggregate_train(server_round, replies)


def test_custom_strategies_are_used_and_checked(monkeypatch) -> None:
    arrays, moved = updates()
    strategy = make_strategy(f"{__name__}:RecordingFedAvg")
    result = StrategyAggregator(strategy).aggregate(4, arrays, moved)
    assert strategy.calls == [
        ("configure_train", 4, [11, 12, 13]),
        ("aggregate_train", 4, [11, 12, 13]),
    ]
    np.testing.assert_array_equal(
        result["head.bias"], WeightedAverage().aggregate(4, arrays, moved)["head.bias"]
    )
    with pytest.raises(ProtocolError, match="needs 3 nodes"):  # not a hang in configure_train
        StrategyAggregator(RecordingFedAvg()).aggregate(1, arrays, moved[:2])

    # secure aggregation: one reply from no node; sampling and minimums see its clients
    aggregate, _ = secure_aggregate_of(arrays, moved)
    strategy = RecordingFedAvg()
    StrategyAggregator(strategy).aggregate_secure(5, arrays, aggregate)
    assert strategy.calls == [
        ("configure_train", 5, [11, 12, 13]),
        ("aggregate_train", 5, [AGGREGATE_NODE_ID]),
    ]
    with pytest.raises(ProtocolError, match="needs 3 nodes"):
        two = replace(aggregate, included=frozenset({11, 12}))
        StrategyAggregator(RecordingFedAvg()).aggregate_secure(1, arrays, two)

    monkeypatch.syspath_prepend(str(APP))  # Flower puts the app folder on the import path
    logging = StrategyAggregator(make_strategy("custom_strategy:LoggingFedAvg"))
    assert type(logging.strategy).__name__ == "LoggingFedAvg"
    for name, value in logging.aggregate_secure(1, arrays, aggregate).items():
        np.testing.assert_array_equal(value, aggregate.arrays[name])
    for name, message in [
        ("fedsgd", "unknown strategy"),
        ("no_such_module:X", "cannot load"),
        ("json:loads", "cannot be built without arguments"),
        ("builtins:dict", "not a Flower Strategy"),
    ]:
        with pytest.raises(ConfigError, match=message):
            make_strategy(name)


# -- the ServerApp ------------------------------------------------------------------------------


class LoopbackGrid(Grid):
    """Delivers every message to its node's ClientApp in this process, in Flower's wire form.

    Exceptions of the ClientApp become error replies, as in Flower's runtimes; nodes in
    ``silent`` never answer.
    """

    def __init__(self, contexts: dict[int, Context], silent: Iterable[int] = ()) -> None:
        self.contexts, self.silent = contexts, set(silent)
        self.replies: dict[str, Message] = {}
        self.answered: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid4().hex  # as Flower's InMemoryGrid
            received = wire(message)
            node = received.metadata.dst_node_id
            if node not in self.silent:
                try:
                    reply = client_app(received, self.contexts[node])
                except Exception as error:
                    reply = Message(
                        Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(error)), reply_to=received
                    )
                self.replies[received.metadata.message_id] = wire(reply)
                self.answered.append(self.replies[received.metadata.message_id])
            ids.append(received.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def set_run(self, run):
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        raise NotImplementedError


def loopback(config: dict[str, object], silent: Iterable[int] = ()) -> LoopbackGrid:
    # node ids in the opposite order of the partitions: the server must order by partition id
    return LoopbackGrid(
        {900 - 7 * k: node_context(900 - 7 * k, k, config) for k in range(3)}, silent
    )


def in_process_history(config: dict, student_dir: Path, checkpoint_dir: Path | None = None) -> list:
    """The in-process runner's history for the same run config and student."""
    settings = app_settings(config)
    splits, _ = settings.student.load_data()
    history, _ = run_in_process(
        load_student(student_dir / "student.pt"),
        splits,
        settings.protocol,
        settings.federation,
        checkpoint_dir=checkpoint_dir,
        policy=DataOwnerPolicy.from_node_config(parse_node_config(os.environ[NODE_CONFIG_ENV])),
        randomness=SecretStream.from_file(Path(os.environ[SERVER_SECRET_ENV])),
        **QUIET,
    )
    return history


def test_server_app_over_flower_messages_equals_the_in_process_run(
    student_dir, monkeypatch
) -> None:
    """Bit for bit, with secure aggregation off (its stochastic rounding would differ between
    the runs; the next test and the flwr run below take the SecAgg stages through Flower)."""
    # updates in the clear: the data owners' decision, in their node config
    monkeypatch.setenv(NODE_CONFIG_ENV, "allow-plaintext=true require-secure-aggregation=false")
    config = run_config(
        student_dir,
        **{"checkpoint-dir": str(student_dir / "checkpoint"), "secure-aggregation": False},
    )
    grid = loopback(config)
    history = run_adaptation(grid, config, **QUIET)

    expected = in_process_history(config, student_dir)
    assert [r.round for r in history] == [1, 2]
    for ours, theirs in zip(history, expected, strict=True):
        assert ours.balanced_accuracy == theirs.balanced_accuracy
        assert ours.train_loss == theirs.train_loss
        assert (ours.clients_trained, ours.clients_evaluated) == (3, 3)
    saved = json.loads((student_dir / "checkpoint" / "state.json").read_text())
    assert saved["identity"]["strategy"] == "fedavg" and saved["round"] == 2
    # no reply of the whole run carries any client's secret key
    for context in grid.contexts.values():
        secret = bytes(load_state(context.state).group("key")["secret"])
        assert not any(carries(reply, secret) for reply in grid.answered)


class LaggingGrid(LoopbackGrid):
    """A loopback grid whose node ``slow`` answers late: each of its replies shows only after
    ``lag`` pulls. Records the node of every message pushed, in order."""

    def __init__(self, contexts: dict[int, Context], slow: int, lag: int) -> None:
        super().__init__(contexts)
        self.slow, self.lag = slow, lag
        self.pushed: list[int] = []
        self.hidden: dict[str, int] = {}

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for message, message_id in zip(messages, ids, strict=True):
            self.pushed.append(message.metadata.dst_node_id)
            if message.metadata.dst_node_id == self.slow:
                self.hidden[message_id] = self.lag
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        visible = []
        for message_id in message_ids:
            if self.hidden.get(message_id, 0) > 0:
                self.hidden[message_id] -= 1
            else:
                visible.append(message_id)
        return super().pull_messages(visible)


def most_between_slow_requests(pushed: list[int], slow: int) -> int:
    """The most requests one other node got between two consecutive requests of ``slow``."""
    marks = [index for index, node in enumerate(pushed) if node == slow]
    return max(
        max((window.count(node) for node in set(window) - {slow}), default=0)
        for window in (pushed[a:b] for a, b in itertools.pairwise(marks))
    )


def test_a_pipelined_server_app_does_not_wait_for_a_slow_client_and_equals_the_in_process_run(
    student_dir, monkeypatch
) -> None:
    """``pipelined = true``: a client's next request goes out as soon as its reply is answered.
    With one client answering late, the others get their next requests before its reply is in;
    the run still equals the in-process (lockstep) run bit for bit, round trips included."""
    monkeypatch.setenv(NODE_CONFIG_ENV, "allow-plaintext=true require-secure-aggregation=false")
    config = run_config(student_dir, **{"secure-aggregation": False, "pipelined": True})
    slow = 900  # partition 0
    grid = LaggingGrid(
        {900 - 7 * k: node_context(900 - 7 * k, k, config) for k in range(3)}, slow, 3
    )
    history = run_adaptation(grid, config, **QUIET)

    expected = in_process_history(config, student_dir)
    for ours, theirs in zip(history, expected, strict=True):
        assert ours.balanced_accuracy == theirs.balanced_accuracy
        assert ours.train_loss == theirs.train_loss
        assert ours.round_trips == theirs.round_trips
        assert (ours.clients_trained, ours.clients_evaluated) == (3, 3)
        # round trips overlap: the time inside the transport is wall time, within the round's
        assert 0.0 < ours.transport_seconds < ours.seconds
    # between two requests of the slow client, a fast one got two of its own
    assert most_between_slow_requests(grid.pushed, slow) >= 2, grid.pushed

    # without pipelining, every client waits for the slowest at each round trip
    lockstep = LaggingGrid(
        {900 - 7 * k: node_context(900 - 7 * k, k, config) for k in range(3)}, slow, 3
    )
    run_adaptation(lockstep, {**config, "pipelined": False}, **QUIET)
    assert most_between_slow_requests(lockstep.pushed, slow) == 1, lockstep.pushed


def test_flower_transport_posts_requests_node_by_node(student_dir) -> None:
    """``post``/``replies``: answers come as they arrive; a silent node times out; an error
    reply becomes a failure; a second request in flight to one node is refused."""
    grid = loopback(run_config(student_dir), silent=[900])
    transport = FlowerTransport(grid, poll_interval=0.01)
    transport.post(Envelope(SETUP, 886, 0), timeout=None)
    transport.post(Envelope(TRAIN_LOSS, 893, 1), timeout=None)
    transport.post(Envelope(SETUP, 900, 0), timeout=0.05)
    with pytest.raises(ProtocolError, match="in flight already"):
        transport.post(Envelope(SETUP, 900, 0), timeout=None)
    first = transport.replies()
    by_node = {reply.node_id: reply for reply in first}
    assert isinstance(by_node[886], Envelope) and by_node[886].message_type == SETUP
    assert isinstance(by_node[893], Failure) and "cannot accept" in by_node[893].reason
    assert 900 not in by_node  # still waiting for its timeout
    assert transport.replies() == [Failure(900, "no reply before the timeout")]


class RecordingGrid(LoopbackGrid):
    """A loopback grid that keeps every message pushed, in order, as the node received it."""

    def __init__(self, contexts: dict[int, Context], silent: Iterable[int] = ()) -> None:
        super().__init__(contexts, silent)
        self.pushed: list[Message] = []

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        self.pushed.extend(messages)
        return ids


@pytest.mark.parametrize("seconds", [-0.5, 30.5, float("nan")])
def test_a_hold_outside_its_range_is_refused_when_made_and_when_read(seconds: float) -> None:
    """A server cannot make a hold longer than the cap, and a ClientApp reads none it did not
    allow (a relay could rewrite the seconds on the way)."""
    with pytest.raises(ProtocolError, match="a hold lasts 0 to 30 s"):
        hold_message(1, seconds)
    forged = hold_message(1, 1.0)
    forged.content["fedfm.hold"]["seconds"] = seconds
    with pytest.raises(ProtocolError, match="a hold lasts 0 to 30 s"):
        hold_seconds(forged)
    assert hold_seconds(hold_message(1, 30.0)) == 30.0


def test_flower_transport_keeps_each_node_warm_with_a_hold_after_its_request(student_dir) -> None:
    """``keep_warm``: every request is followed by a hold for the same node, whose length
    follows the server's answer time for that node; the ClientApp answers a hold without
    touching its state, and the hold replies are pulled and dropped, never returned."""
    grid = RecordingGrid(loopback(run_config(student_dir)).contexts)
    transport = FlowerTransport(grid, poll_interval=0.01, keep_warm=True)
    transport.post(Envelope(SETUP, 886, 0), timeout=None)
    (reply,) = transport.replies()
    assert isinstance(reply, Envelope) and reply.message_type == SETUP
    state = dict(grid.contexts[886].state)
    time.sleep(0.6)  # the server's "answer time" for node 886
    replies = transport.send_and_receive(
        [Envelope(SETUP, 893, 0), Envelope(TRAIN_LOSS, 886, 1)], timeout=None
    )
    assert [type(r).__name__ for r in replies] == ["Envelope", "Failure"]  # no hold among them

    kinds = [(m.metadata.message_type, m.metadata.dst_node_id) for m in grid.pushed]
    assert kinds == [
        (SETUP, 886),
        (HOLD_MESSAGE_TYPE, 886),
        (SETUP, 893),
        (TRAIN_LOSS, 886),
        (HOLD_MESSAGE_TYPE, 893),
        (HOLD_MESSAGE_TYPE, 886),
    ]
    first, hold_893, hold_886 = (
        hold_seconds(m) for m in grid.pushed if m.metadata.message_type == HOLD_MESSAGE_TYPE
    )
    assert first == hold_893 == HOLD_FIRST  # nothing measured yet for these nodes
    due = HOLD_MARGIN * 0.6 + HOLD_SLACK - SUPERNODE_REPLY_POLL  # the answer took 0.6 s
    assert due <= hold_886 <= due + HOLD_MARGIN * 0.3
    assert transport.holds_sent == 3 and not transport._holds and not grid.replies
    holds = [m for m in grid.answered if m.metadata.message_type == HOLD_MESSAGE_TYPE]
    assert len(holds) == 3 and not any(m.has_error() for m in holds)
    assert dict(grid.contexts[886].state) == state  # the refused step left it too

    # without keep_warm, no holds
    plain = RecordingGrid(loopback(run_config(student_dir)).contexts)
    FlowerTransport(plain, poll_interval=0.01).send_and_receive(
        [Envelope(SETUP, 886, 0)], timeout=None
    )
    assert [m.metadata.message_type for m in plain.pushed] == [SETUP]


def test_a_client_app_refuses_a_malformed_hold_and_roles_cannot_claim_the_hold_type(
    student_dir,
) -> None:
    context = node_context(886, 1, run_config(student_dir))
    for content in (RecordDict(), RecordDict({"fedfm.hold": ConfigRecord({"seconds": 31.0})})):
        message = wire(
            Message(content, dst_node_id=886, message_type=HOLD_MESSAGE_TYPE, group_id="0")
        )
        reply = client_app(message, context)
        assert reply.has_error() and "hold" in reply.error.reason
    assert dict(context.state) == {}
    with pytest.raises(ProtocolError, match="0 to 30 s"):
        hold_message(886, -1.0)
    with pytest.raises(ConfigError, match="keep-warm"):
        make_client_app(client_role, object, message_types=[HOLD_MESSAGE_TYPE], state_name="x")


def test_flower_transport_turns_silence_and_errors_into_failures(student_dir) -> None:
    grid = loopback(run_config(student_dir), silent=[900])
    transport = FlowerTransport(grid, poll_interval=0.01)
    envelopes = [Envelope(TRAIN_LOSS, 893, 1), Envelope(SETUP, 886, 0), Envelope(SETUP, 900, 0)]
    refused, setup, silent = transport.send_and_receive(envelopes, timeout=0.05)
    assert isinstance(refused, Failure) and "cannot accept" in refused.reason
    assert isinstance(setup, Envelope) and setup.node_id == 886
    assert silent == Failure(900, "no reply before the timeout")
    with pytest.raises(ProtocolError, match="one envelope per node"):
        transport.send_and_receive(envelopes[:1] * 2, timeout=None)

    # the silent node fails setup after the timeout; the run goes on with the other two
    lines: list[str] = []
    history = run_adaptation(grid, run_config(student_dir, rounds=1, timeout=1.0), log=lines.append)
    assert (history[0].clients_trained, history[0].clients_evaluated) == (2, 2)
    # secure aggregation (the default): the ClientApps answered its 4 stages as train.secagg
    # messages, and no train.loss reply carried parameters
    # the held-out sets rode along the training: one round trip evaluates, on the kept outputs
    assert history[0].round_trips == 4 + 1 + len(STAGES) + 1
    answered = [reply for reply in grid.answered if not reply.has_error()]
    secagg = [m for m in answered if m.metadata.message_type == TRAIN_SECAGG]
    assert len(secagg) == 2 * len(STAGES)
    for reply in answered:
        if reply.metadata.message_type == TRAIN_LOSS:
            assert message_to_envelope(reply, reply.metadata.src_node_id).arrays == {}
    assert "stage unmask, 2 replies of 2" in "\n".join(lines)
    assert "FedAvg (fedavg) over the secure aggregate" in "\n".join(lines)


# -- flwr run ------------------------------------------------------------------------------------


def flwr_run(
    config: dict[str, object], home: Path, *, timeout: float
) -> tuple[subprocess.CompletedProcess[str], str]:
    """``run.py`` with three simulated SuperNodes and ``config`` as run config overrides; the
    process and its whole output."""
    overrides = " ".join(
        f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in config.items()
    )
    result = subprocess.run(
        [
            sys.executable,
            str(APP / "run.py"),
            "--supernodes",
            "3",
            "--flwr-home",
            str(home),
            "--run-config",
            overrides,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return result, result.stdout + result.stderr


def test_flwr_run_simulation_completes_and_equals_the_in_process_run(student_dir, tmp_path) -> None:
    home = tmp_path / "flwr-home"
    config = run_config(student_dir, **{"checkpoint-dir": str(tmp_path / "checkpoint")})
    result, output = flwr_run(config, home, timeout=240)
    assert result.returncode == 0, output[-3000:]
    assert "flwr run: finished:completed; SuperLink stopped" in output
    for round_number in (1, 2):
        assert f"round {round_number}/2 [simulate]" in output and "balanced accuracy" in output
    assert processes_with(f"FLWR_HOME={home}") == []

    history = json.loads((tmp_path / "checkpoint" / "state.json").read_text())["history"]
    expected = in_process_history(config, student_dir, tmp_path / "in-process")
    # Same data, batches, permutations and arithmetic, but the ClientApps run in a Ray worker
    # whose torch may use another thread count (another summation order of float reductions),
    # and secure aggregation (on by default) rounds stochastically: each aggregate is within
    # one step 2c / (2**24 - 1) = 1.2e-7 of the exact average. The global arrays agree to
    # well below the updates' size (about 1e-2), the losses to float precision.
    with (
        np.load(tmp_path / "checkpoint" / "global.npz") as ours,
        np.load(tmp_path / "in-process" / "global.npz") as theirs,
    ):
        for name in theirs.files:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-5)
    for ours, theirs in zip(history, expected, strict=True):
        assert ours["train_loss"] == pytest.approx(theirs.train_loss, rel=1e-5)
        # the held-out sets rode along round 1's training and the ClientApps kept their
        # outputs in their context state: every round evaluates in one round trip
        trips = 4 + 1 + len(STAGES) + 1
        assert (ours["clients_trained"], ours["round_trips"]) == (3, trips)
        # a near-tie of two logits may flip between the runs: one held-out sample at most
        assert ours["accuracy"] == pytest.approx(theirs.accuracy, abs=0.02)


@pytest.fixture(scope="module")
def micro_student_dir(tmp_path_factory) -> Path:
    """An untrained, calibrated two-block micro student on 8x8 digits (5 tokens)."""
    splits = load_splits("digits", image_size=8, max_samples=120, seed=0)
    return save_micro_student(tmp_path_factory.mktemp("micro"), splits)


@pytest.mark.ckks
@pytest.mark.slow
def test_double_blind_runs_end_to_end_under_ckks_over_flower_messages(micro_student_dir) -> None:
    """Two clients, one round, one batch of 16 under real CKKS (N = 8192, masked refreshes):
    the same accuracy as the simulate backend and a loss within CKKS precision."""
    config = run_config(
        micro_student_dir,
        **{
            "backend": "ckks-8192",
            "model": "vit_fedfm_micro",
            "image-size": 8,
            "max-samples": 120,
            "num-clients": 2,
            "rounds": 1,
            "eval-fraction": 0.4,
            "seed": 3,
        },
    )
    grid = LoopbackGrid({700 + k: node_context(700 + k, k, config, count=2) for k in range(2)}, ())
    lines: list[str] = []
    history = run_adaptation(grid, config, log=lines.append)
    expected = in_process_history(config | {"backend": "simulate"}, micro_student_dir)
    assert (history[0].clients_trained, history[0].clients_evaluated) == (2, 2)
    assert history[0].balanced_accuracy == expected[0].balanced_accuracy
    assert abs(history[0].train_loss - expected[0].train_loss) < 1e-3
    assert any("backend=ckks-8192" in line for line in lines)
    refreshes = [m for m in grid.answered if m.metadata.message_type == REFRESH]
    assert refreshes  # the server ran out of depth and the clients refreshed masked values
    setups = [m for m in grid.answered if m.metadata.message_type == SETUP]
    assert len(setups) == 2
    for reply in setups:  # what the server got to evaluate with cannot decrypt
        public = message_to_envelope(reply, reply.metadata.src_node_id).config["public_context"]
        assert not ts.context_from(public).is_private()


# -- a text encoder through the apps --------------------------------------------------------------


@pytest.fixture(scope="module")
def text_source(tmp_path_factory) -> TextStudentSource:
    """A tiny BERT folder (a user's own model) and, where `fedfm distill-text --keep-student`
    keeps one, a calibrated but undistilled student of it with the report a kept student has."""
    folder = tmp_path_factory.mktemp("text")
    model = save_tiny_text_encoder(folder / "model")
    source = TextStudentSource(model=str(model), workdir=folder / "work")
    with pytest.raises(ConfigError, match=r"fedfm distill-text --keep-student .*work --model"):
        source.load_student()  # none yet: the command that makes it is named
    splits, tokens = source.load_data()
    encoder, tokenizer = load_text_encoder(model)
    teacher = to_fhe_text(
        encoder,
        ApproxConfig.exact(),
        num_classes=len(splits.classes),
        pad_token_id=int(tokenizer.pad_token_id),
        max_tokens=tokens,
    )
    run = student_run(str(model))
    student = polynomial_student(teacher, run.approx.build(), [splits.aux.input_ids])
    report = {"classes": list(splits.classes), "model": run.model, "settings": asdict(run)}
    path = kept_student_path(run, source.workdir)
    path.parent.mkdir(parents=True)
    torch.save({"state": student.state_dict(), "report": json.dumps(report)}, path)
    assert source.student_path == path
    return source


def text_run_config(source: TextStudentSource, **changes: object) -> dict[str, object]:
    values: dict[str, object] = {
        "dataset": "docstrings",
        "model": source.model,
        "workdir": str(source.workdir),
        "num-clients": 3,
        "rounds": 2,
        "batches-per-round": 1,
        "reveal": "all",
    }
    return values | changes


def test_text_run_config_names_what_does_not_fit() -> None:
    settings = app_settings({"dataset": "docstrings", "model": "minilm", "workdir": "runs/text"})
    assert isinstance(settings.student, TextStudentSource) and settings.student.model == "minilm"
    with pytest.raises(ConfigError, match="is text: set run config 'model' to a text encoder"):
        app_settings({"dataset": "docstrings"})  # the default model is the ViT
    with pytest.raises(ConfigError, match=r"\['image-size'\] apply to image datasets"):
        app_settings({"dataset": "docstrings", "model": "minilm", "image-size": 16})


def test_server_app_runs_a_text_encoder_as_the_in_process_run(text_source, monkeypatch) -> None:
    """The ServerApp and ClientApps over Flower messages on a text encoder: the data owners
    embed their docstrings with the server's tables and upload key masks; bit for bit the
    in-process run of the same roles (secure aggregation off, as above)."""
    monkeypatch.setenv(NODE_CONFIG_ENV, "allow-plaintext=true require-secure-aggregation=false")
    config = text_run_config(text_source, **{"secure-aggregation": False})
    lines: list[str] = []
    history = run_adaptation(loopback(config), config, log=lines.append)
    assert f"FHE-friendly student {text_source.student_path}" in "\n".join(lines)

    settings = app_settings(config)
    splits, _ = text_source.load_data()
    datasets = text_federation_data(
        splits.pool,
        settings.federation,
        settings.protocol,
        pad_token_id=text_source.pad_token_id(),
    )
    expected, _ = run_clients_in_process(
        text_source.load_student(),
        datasets,
        settings.protocol,
        num_classes=len(splits.classes),
        identity={"test": "text"},
        policy=DataOwnerPolicy.from_node_config(parse_node_config(os.environ[NODE_CONFIG_ENV])),
        randomness=SecretStream.from_file(Path(os.environ[SERVER_SECRET_ENV])),
        **QUIET,
    )
    assert [r.round for r in history] == [1, 2]
    for ours, theirs in zip(history, expected, strict=True):
        assert (ours.clients_trained, ours.clients_evaluated) == (3, 3)
        assert ours.balanced_accuracy == theirs.balanced_accuracy
        assert ours.train_loss == theirs.train_loss


@pytest.mark.slow
def test_flwr_run_simulation_runs_a_text_encoder(text_source, tmp_path) -> None:
    """`flwr run` (Flower's simulation, the apps in their own processes) on a text encoder."""
    home = tmp_path / "flwr-home"
    config = text_run_config(text_source, rounds=1)
    result, output = flwr_run(config, home, timeout=300)
    assert result.returncode == 0, output[-3000:]
    assert "flwr run: finished:completed; SuperLink stopped" in output
    assert "round 1/1 [simulate]" in output and "3 trained, 3 evaluated" in output
    assert processes_with(f"FLWR_HOME={home}") == []
