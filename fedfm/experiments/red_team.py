"""``fedfm red-team``: every attack on fedfm's promises, run against the current code.

Each attack names the secret it goes after (``target``), who mounts it (``adversary``: a curious
client, an active server, the relay), its outcome against the current code (``defended`` or
``succeeds``), the measured figure, the same figure under the conditions the attack was written
against (``control``: the behaviour before the defence, or a deliberately weakened setting; an
attack whose control does not succeed proves nothing) and the test that checks both.

Protocol-level attacks run on a small arena (an untrained, calibrated two-block micro student on
8x8 digits, real clients and server roles driven message by message in this process), because
what they measure does not depend on accuracy. The extraction attacks run on the distilled
student of a work folder, as ``fedfm bench-extraction`` does.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedfm.approx import ApproxConfig, calibrate
from fedfm.crypto import get_backend
from fedfm.crypto.randomness import RandomSource, ResearchStream, SecretStream
from fedfm.crypto.simulate import SimulatedBatch
from fedfm.data import DataSplits, load_splits
from fedfm.distillation.pipeline import DistillRun, load_data, obtain_student
from fedfm.errors import ConfigError, ProtocolAbort, ProtocolError
from fedfm.experiments.bench_protocol import curious_run, extraction_metrics
from fedfm.experiments.results import write_results
from fedfm.experiments.secagg_attack import false_dropout_attack, key_substitution_attack
from fedfm.models import ModelSpec, to_fhe_friendly
from fedfm.models.fhe_vit import FheViT
from fedfm.protocols.double_blind.client import ClientData, ClientState, DoubleBlindClient
from fedfm.protocols.double_blind.config import (
    TRAIN_BLOCK,
    TRAIN_LOSS,
    DoubleBlindConfig,
)
from fedfm.protocols.double_blind.messages import pack_batches, unpack_batches
from fedfm.protocols.double_blind.permutation import relative
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.runner import Federation, client_data, federation_data
from fedfm.protocols.double_blind.server import ClientUpdate, DoubleBlindServer
from fedfm.protocols.secure_aggregation import signed_federation
from fedfm.runtime.identity import Identity, IdentityError, KeyBundle, format_pins, parse_pins
from fedfm.runtime.settings import node_settings, split_run_config
from fedfm.runtime.transport import Envelope
from fedfm.secagg import ClientUpdate as MaskedUpdate
from fedfm.secagg import KeyAuthentication, SecAggConfig

DEFENDED, SUCCEEDS = "defended", "succeeds"
TESTS = "tests/experiments/test_red_team.py"
# The run config's public seed before the server had secret streams (its default was 0).
PUBLIC_SEED = 0


@dataclass(frozen=True)
class AttackResult:
    """One attack: what it is after, who mounts it, and what it achieved."""

    name: str
    target: str
    adversary: str
    outcome: str
    figure: str
    value: float
    control: float
    test: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.outcome not in (DEFENDED, SUCCEEDS):
            raise ConfigError(f"an attack's outcome is {DEFENDED!r} or {SUCCEEDS!r}")


# -- the arena ---------------------------------------------------------------------------------


@dataclass
class Arena:
    """A small double-blind setting: a micro student and two data owners' data."""

    model: FheViT
    data: list[ClientData]
    config: DoubleBlindConfig = field(
        default_factory=lambda: DoubleBlindConfig(
            rounds=3, batch_size=16, batches_per_round=2, reveal="all"
        )
    )


def build_arena() -> Arena:
    """An untrained, calibrated ``vit_fedfm_micro`` student on 8x8 digits, two clients."""
    splits: DataSplits = load_splits("digits", image_size=8, max_samples=400, seed=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        vit = ModelSpec("vit_fedfm_micro", splits.aux.num_classes, 8).build()
        with torch.no_grad():  # keep LayerNorm's inputs inside its domain (tests/helpers.py)
            cast(torch.nn.Parameter, vit.pos_embed).normal_(0.0, 0.5)
            cast(torch.nn.Parameter, vit.cls_token).normal_(0.0, 1.0)
        student = to_fhe_friendly(vit, ApproxConfig())
    calibrate(student, [splits.aux.images])
    pool = splits.pool
    data = [
        client_data(pool, np.arange(70 * k, 70 * (k + 1)), eval_fraction=0.3, seed=k)
        for k in range(2)
    ]
    return Arena(student.eval(), data)


PERMISSIVE = DataOwnerPolicy(allow_plaintext=True, require_secure_aggregation=False)
"""A data owner that accepts whatever the server proposes: the clients before the policy."""


def _pair(
    arena: Arena,
    *,
    config: DoubleBlindConfig | None = None,
    randomness: RandomSource | None = None,
    policy: DataOwnerPolicy = PERMISSIVE,
    node: int = 0,
) -> tuple[DoubleBlindServer, DoubleBlindClient, ClientState, Envelope]:
    """A server and client ``node`` after setup; the setup reply too."""
    config = config or arena.config
    backend = get_backend(config.backend)
    server = DoubleBlindServer(
        arena.model,
        config,
        backend,
        num_classes=arena.data[node].num_classes,
        randomness=randomness,
        log=lambda _line: None,
    )
    client = DoubleBlindClient(arena.data[node], backend, policy=policy, partition_id=node)
    reply, state = client.handle(server.setup_request(node), ClientState())
    server.on_setup(reply)
    return server, client, state, reply


def _train_round(
    server: DoubleBlindServer,
    client: DoubleBlindClient,
    state: ClientState,
    server_round: int,
    arrays: dict[str, np.ndarray],
    *,
    node: int = 0,
) -> tuple[ClientUpdate, ClientState, list[Envelope]]:
    """One training round between the two roles; the update, the client's state, the requests
    the client received."""
    request: Any = server.start("train", node, server_round, arrays)
    received = []
    while isinstance(request, Envelope):
        received.append(request)
        reply, state = client.handle(request, state)
        request = server.on_reply(reply)
    return request, state, received


# -- 1. permutation replay -----------------------------------------------------------------------


def _replayed_orders(
    seed: int, total: int, config: DoubleBlindConfig, num_blocks: int
) -> list[list[np.ndarray]]:
    """The permutations a server seeded with ``seed`` draws for the first client it serves, as
    the client recomputes them from public values (the run config and its own sample count)."""
    replay = ResearchStream(seed)
    replay.torch_seed()  # the initial adapter's draw comes first
    n = config.batch_size
    count = min(config.batches_per_round, total // n)
    replay.choice(total, size=count * n, replace=False)
    return [[replay.permutation(n) for _ in range(num_blocks + 1)] for _ in range(count)]


def _replay_hits(arena: Arena, randomness: RandomSource) -> float:
    """Share of client 0's batches whose absolute permutations it reconstructs by replaying a
    generator seeded with the public seed (it checks its guess against the relative
    permutations it received, which fix every ``pi_l`` once one is known)."""
    server, client, state, _ = _pair(arena, randomness=randomness)
    arrays = server.initial_arrays(arena.model.vit.embed_dim)
    _, _, received = _train_round(server, client, state, 1, arrays)
    # the last block carries the relative permutations
    last = [request for request in received if request.message_type == TRAIN_BLOCK][-1]
    count, num_blocks = int(last.config["num_batches"]), int(last.config["num_blocks"])
    steps = [last.arrays[f"steps.{i}"] for i in range(count)]
    guesses = _replayed_orders(
        PUBLIC_SEED, len(arena.data[0].train_labels), arena.config, num_blocks
    )
    matched = 0
    for received_steps, guess in zip(steps, guesses, strict=False):
        implied = np.stack([relative(guess[i], guess[i + 1]) for i in range(num_blocks)])
        matched += int(np.array_equal(implied, received_steps))
    return matched / count


def permutation_replay(arena: Arena) -> AttackResult:
    """A curious client replays the server's generator from the run config's public seed."""
    control = _replay_hits(arena, ResearchStream(PUBLIC_SEED))
    value = _replay_hits(arena, SecretStream())
    return AttackResult(
        name="permutation_replay",
        target="the server's permutations (which client sample each row holds)",
        adversary="curious client",
        outcome=DEFENDED if value == 0 else SUCCEEDS,
        figure="share of the client's batches whose absolute permutations it reconstructs",
        value=value,
        control=control,
        test=f"{TESTS}::test_permutation_replay",
        detail=(
            "control: the server's draws from NumPy's generator seeded with the run config's "
            f"seed ({PUBLIC_SEED}), as before secret streams; now: SecretStream (AES-256-CTR "
            "under a key from the OS), which no other party can replay"
        ),
    )


# -- 2. downgrades -------------------------------------------------------------------------------


def _plaintext_share(arena: Arena, policy: DataOwnerPolicy) -> float:
    """Share of the client's training pixels the server holds in the clear after setup."""
    config = replace(arena.config, backend="simulate")
    try:
        _, _, _, reply = _pair(arena, config=config, policy=policy)
    except ProtocolError:
        return 0.0
    uploaded = unpack_batches(
        reply,
        "train_images",
        1,
        get_backend("simulate")
        .create_evaluator(
            reply.config["public_context"]  # type: ignore[arg-type]
        )
        .load,
    )[0]
    values = np.asarray(cast(SimulatedBatch, uploaded).values)  # simulate carries plaintext
    images = arena.data[0].train_images
    return float(np.isclose(values, images).mean()) if values.shape == images.shape else 0.0


def backend_downgrade(arena: Arena) -> AttackResult:
    """An active server's setup names the plaintext ``simulate`` backend."""
    return AttackResult(
        name="backend_downgrade",
        target="the data owner's images",
        adversary="active server",
        outcome=DEFENDED if _plaintext_share(arena, DataOwnerPolicy()) == 0 else SUCCEEDS,
        figure="share of the client's training pixels the server receives in the clear",
        value=_plaintext_share(arena, DataOwnerPolicy()),
        control=_plaintext_share(arena, PERMISSIVE),
        test=f"{TESTS}::test_backend_downgrade",
        detail=(
            "control: a client that takes the backend from the server's setup (before the data "
            "owner's policy); now: the default DataOwnerPolicy refuses plaintext unless the "
            "data owner's node config says allow-plaintext=true"
        ),
    )


def _individual_update(arena: Arena, policy: DataOwnerPolicy) -> float:
    """1.0 if the server receives this client's own trained parameters, else 0.0."""
    config = replace(arena.config, secure_aggregation=False)
    try:
        server, client, state, _ = _pair(arena, config=config, policy=policy)
    except ProtocolError:
        return 0.0
    update, _, _ = _train_round(
        server, client, state, 1, server.initial_arrays(arena.model.vit.embed_dim)
    )
    return 1.0 if update.arrays else 0.0


def secure_aggregation_downgrade(arena: Arena) -> AttackResult:
    """An active server's setup turns secure aggregation off."""
    value = _individual_update(arena, DataOwnerPolicy(allow_plaintext=True))
    return AttackResult(
        name="secure_aggregation_downgrade",
        target="the data owner's individual update",
        adversary="active server",
        outcome=DEFENDED if value == 0 else SUCCEEDS,
        figure="1 if the server receives the client's own adapter and head, else 0",
        value=value,
        control=_individual_update(arena, PERMISSIVE),
        test=f"{TESTS}::test_secure_aggregation_downgrade",
        detail=(
            "control: a client that follows the setup's secure_aggregation flag; now: the "
            "policy requires SecAgg+ unless require-secure-aggregation=false in its node config"
        ),
    )


# -- 6. replays and oracles ---------------------------------------------------------------------


def _retrains(arena: Arena, *, forget_rounds: bool) -> float:
    """Updates the client produces for round 1 when the server restarts it after training.

    ``forget_rounds`` emulates the client before monotonic rounds (its state kept no record of
    the rounds it had trained).
    """
    server, client, state, _ = _pair(arena)
    arrays = server.initial_arrays(arena.model.vit.embed_dim)
    _, state, _ = _train_round(server, client, state, 1, arrays)
    updates = 1
    if forget_rounds:
        state = replace(state, trained_round=0, evaluated_round=0)
    try:
        _train_round(server, client, state, 1, arrays)
        updates += 1
    except ProtocolError:
        server.abandon(0)
    return float(updates)


def round_replay(arena: Arena) -> AttackResult:
    """An active server restarts a round the client already trained."""
    value = _retrains(arena, forget_rounds=False)
    return AttackResult(
        name="round_replay",
        target="the data owner's update (two updates of one round differ by its data)",
        adversary="active server",
        outcome=DEFENDED if value == 1 else SUCCEEDS,
        figure="updates the client computes for one round when the server replays it",
        value=value,
        control=_retrains(arena, forget_rounds=True),
        test=f"{TESTS}::test_round_replay",
        detail=(
            "control: the client's state without its record of trained rounds (as before "
            "monotonic rounds: block 1 was accepted in any stage with any round); now: rounds "
            "only move forward, setup only with no round open, train.loss once after the last "
            "block. Not covered: a server that runs later rounds with the same global model "
            "and other cohorts (see docs/double_blind.md)"
        ),
    )


# -- 5b. evaluation flood -------------------------------------------------------------------------

# Evaluations an active server asks one client for, each with a head of its choosing, after the
# client's first (full) evaluation of round 1.
FLOOD_REQUESTS = 12


def _evaluations_answered(arena: Arena, *, bounded: bool) -> float:
    """Evaluations client 0 answers: round 1 in full, then :data:`FLOOD_REQUESTS` later rounds
    on its kept outputs, each a confusion matrix of its held-out set under a head the server
    chose, at no encrypted cost to the server. ``bounded=False`` emulates a client that does not
    hold the server to the rounds it announced at setup."""
    server, client, state, _ = _pair(arena)
    arrays = server.initial_arrays(arena.model.vit.embed_dim)
    answered = 0
    for server_round in range(1, 2 + FLOOD_REQUESTS):
        if not bounded:
            state = replace(state, config={**state.config, "rounds": 10**6})
        heads = np.random.default_rng(server_round)  # the server's chosen heads
        chosen = {k: v + heads.normal(0, 1, v.shape).astype(v.dtype) for k, v in arrays.items()}
        request: Any = server.start("evaluate", 0, server_round, chosen)
        try:
            while isinstance(request, Envelope):
                reply, state = client.handle(request, state)
                request = server.on_reply(reply)
        except ProtocolError:  # refused (and the client left the run)
            break
        answered += 1
    return float(answered)


def evaluation_flood(arena: Arena) -> AttackResult:
    """An active server asks for evaluations under heads of its choosing, round after round."""
    value = _evaluations_answered(arena, bounded=True)
    return AttackResult(
        name="evaluation_flood",
        target="the data owner's held-out data (a confusion matrix per head the server chooses)",
        adversary="active server",
        outcome=DEFENDED if value <= arena.config.rounds else SUCCEEDS,
        figure=(
            f"evaluations the client answers when the server asks for {FLOOD_REQUESTS + 1} "
            f"in a run announced with {arena.config.rounds} rounds"
        ),
        value=value,
        control=_evaluations_answered(arena, bounded=False),
        test=f"{TESTS}::test_evaluation_flood",
        detail=(
            "after its first evaluation a client keeps the frozen blocks' outputs on its "
            "held-out set and later evaluations cost the server nothing (evaluate.cached); "
            "control: a client that answers any later round; now: rounds move forward, at most "
            "the rounds announced at setup and the data owner's max-rounds. Residual: each "
            "answered round still gives the server a confusion matrix under a head it chose "
            "(as every evaluation always did; see docs/double_blind.md)"
        ),
    )


# Questions the oracle attack asks per secret, the secrets it goes after (indices of client 0's
# training images) and the public range of a normalised pixel mean it bisects.
ORACLE_QUESTIONS = 8
ORACLE_IMAGES = (3, 9)
ORACLE_RANGE = (-3.0, 3.0)


def _to_loss(
    arena: Arena,
    server: DoubleBlindServer,
    client: DoubleBlindClient,
    state: ClientState,
    server_round: int,
) -> tuple[Any, ClientState]:
    """Run a round's blocks; the server's ``train.loss`` request and the client's state."""
    server.abandon(0)
    arrays = server.initial_arrays(arena.model.vit.embed_dim)
    request: Any = server.start("train", 0, server_round, arrays)
    while isinstance(request, Envelope) and request.message_type != TRAIN_LOSS:
        reply, state = client.handle(request, state)
        request = server.on_reply(reply)
    return request, state


def _oracle_answers(arena: Arena, image: int, *, leaves: bool) -> int:
    """Yes/no questions about the mean pixel ``x`` of client 0's training image ``image`` that
    an active server gets answered by forging ``train.loss``: question "is ``x < c``?" is the
    server's own loss plus an encrypted step ``1[x >= c]`` (under CKKS a polynomial of the
    image's ciphertext; here, in the simulate arena, computed in the clear), so the client
    accepts the loss iff the answer is yes. The server bisects :data:`ORACLE_RANGE`; an
    accepted loss ends the round, so the next question comes in the next round.

    ``leaves=False`` emulates the client before it left the run on a refusal (a refused request
    left its state as it was, so the server could ask again at once).
    """
    # a run announced with enough rounds for every question (one per accepted loss)
    config = replace(arena.config, rounds=ORACLE_QUESTIONS + 1)
    server, client, state, _ = _pair(arena, config=config)
    secret = float(arena.data[0].train_images[image].mean())
    low, high = ORACLE_RANGE
    answered, server_round = 0, 1
    try:
        request, state = _to_loss(arena, server, client, state, server_round)
        for _ in range(ORACLE_QUESTIONS):
            middle = (low + high) / 2
            count = int(request.config["num_batches"])
            losses = [
                cast(SimulatedBatch, loss)  # the arena runs the simulate backend
                for loss in unpack_batches(
                    request, "loss", count, server.sessions[0].evaluator.load
                )
            ]
            step = 0.0 if secret < middle else 1.0
            forged = dict(request.arrays)
            forged.update(
                pack_batches("loss", [replace(loss, values=loss.values + step) for loss in losses])
            )
            try:
                _, state = client.handle(
                    Envelope(TRAIN_LOSS, 0, request.round, forged, request.config), state
                )
                yes = True
            except ProtocolAbort as abort:
                yes = False
                if leaves:
                    state = cast(ClientState, abort.state)
            answered += 1
            low, high = (low, middle) if yes else (middle, high)
            if yes:
                server_round += 1
                request, state = _to_loss(arena, server, client, state, server_round)
    except ProtocolError:  # the client refuses without answering: it has left the run
        pass
    return answered


def _oracle_bits(arena: Arena, *, leaves: bool) -> float:
    """Mean number of questions answered (bits learned) over :data:`ORACLE_IMAGES`."""
    return float(np.mean([_oracle_answers(arena, i, leaves=leaves) for i in ORACLE_IMAGES]))


def loss_decryption_oracle(arena: Arena) -> AttackResult:
    """An active server turns the client's check of ``train.loss`` into a yes/no oracle on a
    value under the client's key (and reads the refusal's text)."""
    value = _oracle_bits(arena, leaves=True)
    bound = math.log2(ORACLE_QUESTIONS + 1)
    return AttackResult(
        name="loss_decryption_oracle",
        target="the data owner's images (any value under its key)",
        adversary="active server",
        outcome=DEFENDED if value <= bound else SUCCEEDS,
        figure=(
            f"bits the server learns about an image's mean pixel from {ORACLE_QUESTIONS} "
            f"questions hidden in train.loss (mean over {len(ORACLE_IMAGES)} images)"
        ),
        value=value,
        control=_oracle_bits(arena, leaves=False),
        test=f"{TESTS}::test_loss_decryption_oracle",
        detail=(
            "control: a client whose refusal leaves its state as it was (before this defence) "
            "answers every question, and a bisection pins the value; now: the client computes "
            "its own loss from the labels the gradient implies, refuses a loss that is not its "
            "own without naming any decrypted value, and leaves the run at its first refusal "
            "after decrypting (refreshes, blocks and the loss alike). Residual (selective "
            "failure): accepted answers continue, so Q questions in a run tell the server at "
            f"most log2(Q + 1) bits on average ({bound:.2f} for Q = {ORACLE_QUESTIONS}); Q is "
            "at most the run's refreshes and losses"
        ),
    )


# -- 7. relay pin injection ---------------------------------------------------------------------


def relay_pin_injection() -> AttackResult:
    """The relay writes its own identity's fingerprint into the run config as a peer's pin."""
    relay = Identity.generate()
    digest, session = os.urandom(32), os.urandom(16)
    session_key = X25519PrivateKey.generate().public_key().public_bytes_raw()
    forged = KeyBundle.signed(relay, ("alice",), session_key, digest, session)
    run_config = {"pins": format_pins({"alice": relay.fingerprint})}

    def accepted(pins: dict[str, str]) -> float:
        try:
            forged.verify("alice", pins, digest, session)
        except IdentityError:
            return 0.0
        return 1.0

    # control: the node's pins as the fallback took them (from the run config)
    control = accepted(parse_pins(str(run_config["pins"])))
    try:
        split_run_config(run_config)
        pins = node_settings({"roles": "carol"}).pins
        value = accepted(pins)
    except (ConfigError, IdentityError):
        value = 0.0
    return AttackResult(
        name="relay_pin_injection",
        target="the end-to-end channels between roles (the relay in the middle)",
        adversary="relay",
        outcome=DEFENDED if value == 0 else SUCCEEDS,
        figure="1 if a node accepts the relay's session key for a peer role, else 0",
        value=value,
        control=control,
        test=f"{TESTS}::test_relay_pin_injection",
        detail=(
            "control: pins taken from the run config when the node config had none; now: run "
            "config keys roles/pins/identity/inputs are refused and a node without pins "
            "verifies nobody"
        ),
    )


# -- extraction (App. C): what a curious client fits of the model --------------------------------

EXTRACTION_SUCCESS_R2 = 0.2
"""An extraction attack *succeeds* when the client's fit explains a fifth or more of the variance
of the model's computation on held-out samples (R^2 on samples the fit never saw): a partial
copy of the model the client was never given."""


def extraction_attacks(
    student: FheViT,
    datasets: list[ClientData],
    config: DoubleBlindConfig,
    *,
    seed: int,
    setting: str,
    log: Callable[[str], None] = print,
) -> list[AttackResult]:
    """(a') and (b) of ``fedfm bench-extraction``, every client curious, on ``config``'s tap set
    (the value) and on the paper's (every block revealed: the control); ``setting`` describes
    the student and the federation for the report.

    (a') fits the image to the first revealed output after realigning rows by labels: the
    embedding and every block up to that output. (b) fits each later revealed output from the
    previous one; a tap set with one revealed output leaves it nothing to fit (R^2 0).
    """
    backend = get_backend(config.backend)
    figures: dict[str, dict[str, float]] = {}
    shown: dict[str, list[int]] = {}
    for reveal in (config.reveal, "all"):
        curious = replace(config, reveal=reveal)
        clients, observed = curious_run(student, datasets, curious, backend, log, seed=seed)
        metrics = extraction_metrics(
            observed.server.num_blocks, datasets, curious, clients, observed.server.drawn, mlp=False
        )
        later = [
            float(np.mean(values))
            for name, values in metrics.items()
            if name.startswith("b") and name.endswith("_r2_output") and "control" not in name
        ]
        figures[reveal] = {
            "first": float(np.mean(metrics["a_labels_r2"])),
            "later": float(np.mean(later)) if later else 0.0,
        }
        shown[reveal] = list(observed.server.revealed)
    detail = (
        f"value: reveal={config.reveal} (blocks {shown[config.reveal]} of {student.num_blocks} "
        f"shown); control: reveal=all (the paper's taps); {setting}, {config.rounds} rounds, "
        f"n={config.batch_size} x {config.batches_per_round}, permutations on"
    )

    def result(name: str, key: str, target: str, figure: str) -> AttackResult:
        value = figures[config.reveal][key]
        return AttackResult(
            name=name,
            target=target,
            adversary="curious client",
            outcome=SUCCEEDS if value >= EXTRACTION_SUCCESS_R2 else DEFENDED,
            figure=figure,
            value=value,
            control=figures["all"][key],
            test=f"{TESTS}::test_extraction_attacks_report_their_fits",
            detail=detail,
        )

    return [
        result(
            "extraction_block1",
            "first",
            f"the model's embedding and blocks 1..{shown[config.reveal][0]}",
            "held-out R^2 of the client's fit image -> first revealed output, after aligning "
            "rows by its labels (a')",
        ),
        result(
            "extraction_later_blocks",
            "later",
            "the model's blocks between two revealed outputs",
            "held-out R^2 of each later revealed output fitted from the previous one (b), mean "
            "over outputs (0: no two outputs revealed)",
        ),
    ]


# -- 4. and 5. what the key holder sees of the server's computation --------------------------------

# A default run of the embedded model before the budget: 1,797 refreshed ciphertexts per block
# evaluation (results of bench-ckks then), 4 blocks trained and evaluated, 20 rounds.
PREVIOUS_RUN_CIPHERTEXTS = 1797 * 4 * 2 * 20


def refresh_distance_per_run() -> AttackResult:
    """A curious key holder learns from the masked refreshes what the masks fail to hide: the
    statistical distance of its whole run's view from masks alone."""
    from fedfm.crypto import CKKS_8192_REFRESH, CKKS_16384, CkksBackend
    from fedfm.crypto.refresh import RefreshBound

    def bound(params: Any) -> RefreshBound:
        owner = CkksBackend(params).create_key_owner()
        return owner._refresher.bound  # the harness reads both sides; the library never does

    deployed = bound(CKKS_16384)
    budget = 2.0**-CKKS_16384.run_budget_bits
    value = math.log2(deployed.run_bound(deployed.rated_ciphertexts(budget)))
    # the chain before the budget: a refresh level of q0 q1 = 98 bits, B = 2^95, T = 2^50
    previous = RefreshBound(8192, 2**50, 95, 2**98)
    control = math.log2(previous.run_bound(PREVIOUS_RUN_CIPHERTEXTS))
    small = bound(CKKS_8192_REFRESH)
    small_budget = 2.0**-CKKS_8192_REFRESH.run_budget_bits
    return AttackResult(
        name="refresh_distance_per_run",
        target=(
            "the server's intermediate values inside its blocks (its model, seen through the "
            "client's data)"
        ),
        adversary="curious client (the key holder) against its own masked refreshes",
        outcome=DEFENDED if value <= -40 else SUCCEEDS,
        figure="log2 of the statistical distance of a whole run's refreshes from masks alone "
        "(deployment set ckks, at the longest run its accountant allows)",
        value=value,
        control=control,
        test=f"{TESTS}::test_key_holder_rows_report_the_refresh_budget_and_circuit_privacy",
        detail=(
            f"ckks: 2^{math.log2(deployed.per_ciphertext):.0f} per ciphertext, accountant "
            "refuses past 2^-40; control: the chain before the budget over a default 20-round "
            f"run ({PREVIOUS_RUN_CIPHERTEXTS} refreshed ciphertexts); ckks-8192 (CI set) is "
            f"rated for 2^{-CKKS_8192_REFRESH.run_budget_bits} only, "
            f"{small.rated_ciphertexts(small_budget)} refreshed ciphertexts per key"
        ),
    )


def circuit_privacy_distinguisher(trials: int = 40) -> AttackResult:
    """The key holder tells two Benes swap-mask choices (same plaintext) apart from the
    ciphertexts it receives: from ``c1`` (before release) and from the decrypted noise."""
    from fedfm.experiments import circuit_privacy as privacy

    arena = privacy.build_arena()
    control = privacy.c1_replay_rate(arena, released=False)
    value = privacy.noise_distinguisher_rate(arena, trials=trials, seed=2)
    bound = privacy.distance_bound(arena)
    # at chance: within 3.2 standard errors of a coin over ``trials`` flips
    chance = abs(value - 0.5) <= 3.2 * 0.5 / math.sqrt(trials)
    return AttackResult(
        name="circuit_privacy_distinguisher",
        target="the server's secrets inside its computation (here Benes swap masks)",
        adversary="curious client (the key holder)",
        outcome=DEFENDED if chance and bound < 2**-6 else SUCCEEDS,
        figure=f"the key holder's success rate naming the secret from released ciphertexts "
        f"({trials} trials; 0.5 is chance)",
        value=value,
        control=control,
        test="tests/crypto/test_circuit_privacy.py::"
        "test_rerandomising_alone_leaves_the_noise_to_read_flooding_hides_it",
        detail=(
            "control: c1 matched against the key holder's replays before release (lowest level, "
            "fresh encryption of zero, Gaussian flood 2^20); the flood's statistical distance "
            f"between the two views is 2^{math.log2(bound):.1f}: a weak parameter, not 2^-40 "
            "(which would cost about 2^19 in every slot at scale 2^40)"
        ),
    )


# -- 3. secure aggregation against an active server -----------------------------------------------


def _secagg_round(count: int, *, seed: int) -> tuple[SecAggConfig, dict[int, MaskedUpdate]]:
    """``count`` clients' updates (a head's shape, values within the clipping range)."""
    rng = np.random.default_rng(seed)
    updates = {
        node: MaskedUpdate(
            {"head.weight": rng.uniform(-0.9, 0.9, (10, 16)).astype(np.float32)},
            int(rng.integers(16, 65)),
        )
        for node in range(1, count + 1)
    }
    config = SecAggConfig(clipping_range=1.0, quantization_bits=24, max_weight=64, min_clients=2)
    return config, updates


def secagg_key_substitution() -> AttackResult:
    """The server substitutes its own keys for a target's neighbours (fedfm.experiments.
    secagg_attack) and unmasks the target's update."""
    config, updates = _secagg_round(8, seed=21)
    target = 4

    def recovered(authentication: dict[int, KeyAuthentication]) -> float:
        outcome = key_substitution_attack(config, updates, authentication, target=target)
        return 1.0 if outcome.succeeded else 0.0

    control = recovered({node: KeyAuthentication.semi_honest() for node in updates})
    value = recovered(dict(signed_federation(updates)))
    return AttackResult(
        name="secagg_key_substitution",
        target="one data owner's update under secure aggregation",
        adversary="active server",
        outcome=DEFENDED if value == 0 else SUCCEEDS,
        figure="1 if the server recovers the target's update within one quantization step",
        value=value,
        control=control,
        test="tests/secagg/test_active_server.py::test_key_substitution_is_refused_when_keys_are_signed",
        detail=(
            "8 clients, complete graph; control: keys taken as relayed (the semi-honest mode, "
            "as before signed keys); now: keys signed by each data owner's identity and checked "
            "against its pins"
        ),
    )


def secagg_false_dropouts() -> AttackResult:
    """The server lies about which neighbours dropped, with authentic keys (a residual)."""
    config, updates = _secagg_round(6, seed=31)
    signed = dict(signed_federation(updates))
    value = float(false_dropout_attack(config, updates, signed, target=2).succeeded)
    config5, updates5 = _secagg_round(5, seed=31)
    control = float(
        false_dropout_attack(
            config5, updates5, dict(signed_federation(updates5)), target=2
        ).succeeded
    )
    return AttackResult(
        name="secagg_false_dropouts",
        target="one data owner's update under secure aggregation",
        adversary="active server",
        outcome=DEFENDED if value == 0 else SUCCEEDS,
        figure="1 if the server recovers the target's update (6 clients, complete graph, "
        "signed keys)",
        value=value,
        control=control,
        test="tests/secagg/test_active_server.py::test_false_dropouts_unmask_a_target_despite_signed_keys",
        detail=(
            "not defended: SecAgg+ without the consistency round of Bonawitz et al. lets a server "
            "tell holders different survivor sets; infeasible with 5 clients on the complete "
            "graph (the control column: the default federation), feasible from 6; see "
            "docs/secure_aggregation.md"
        ),
    )


# -- the command --------------------------------------------------------------------------------

ArenaAttack = Callable[[Arena], AttackResult]
ARENA_ATTACKS: dict[str, ArenaAttack] = {
    "permutation_replay": permutation_replay,
    "backend_downgrade": backend_downgrade,
    "secure_aggregation_downgrade": secure_aggregation_downgrade,
    "round_replay": round_replay,
    "loss_decryption_oracle": loss_decryption_oracle,
    "evaluation_flood": evaluation_flood,
}
STANDALONE_ATTACKS: dict[str, Callable[[], AttackResult]] = {
    "refresh_distance_per_run": refresh_distance_per_run,
    "circuit_privacy_distinguisher": circuit_privacy_distinguisher,
    "secagg_key_substitution": secagg_key_substitution,
    "secagg_false_dropouts": secagg_false_dropouts,
    "relay_pin_injection": relay_pin_injection,
}
# Each protocol's own attack suite: ``"module:function"``, a function of no arguments returning
# a list of AttackResult (imported only when the red team runs; the protocol's harness module
# lives in fedfm.experiments). One line per protocol.
PROTOCOL_SUITES: dict[str, str] = {
    "fedrag": "fedfm.experiments.fedrag_attacks:red_team_suite",
    "slip": "fedfm.experiments.slip_attacks:red_team_suite",
    "centaur": "fedfm.experiments.centaur_attacks:red_team_suite",
    "double_blind_text": "fedfm.experiments.text_attacks:red_team_suite",
}


def protocol_suite(name: str) -> Callable[[], list[AttackResult]]:
    """The attack suite registered for protocol ``name`` in :data:`PROTOCOL_SUITES`."""
    module_name, _, function = PROTOCOL_SUITES[name].partition(":")
    suite: Callable[[], list[AttackResult]] = getattr(
        importlib.import_module(module_name), function
    )
    return suite


def run_red_team(
    *,
    extraction: tuple[DistillRun, DoubleBlindConfig, Federation] | None = None,
    results_dir: Path = Path("results"),
    log: Callable[[str], None] = print,
    command: str | None = None,
    protocols: Sequence[str] | None = None,
) -> list[AttackResult]:
    """Run every attack (the extraction attacks on ``extraction``'s student, tap set and
    federation, when given; the attack suites of ``protocols``, default all registered in
    :data:`PROTOCOL_SUITES`); write ``red_team.json`` and ``red_team.md``."""
    chosen = list(PROTOCOL_SUITES) if protocols is None else [p.strip() for p in protocols]
    unknown = sorted(set(chosen) - set(PROTOCOL_SUITES))
    if unknown:
        raise ConfigError(
            f"no attack suite registered for {unknown}; registered: {sorted(PROTOCOL_SUITES)}"
        )
    results: list[AttackResult] = []
    arena = build_arena()
    for name, attack in ARENA_ATTACKS.items():
        log(f"[fedfm] red team: {name}")
        results.append(attack(arena))
    for name, standalone in STANDALONE_ATTACKS.items():
        log(f"[fedfm] red team: {name}")
        results.append(standalone())
    for protocol in chosen:
        log(f"[fedfm] red team: the {protocol} suite")
        results += protocol_suite(protocol)()
    if extraction is not None:
        log("[fedfm] red team: extraction_block1, extraction_later_blocks")
        run, config, federation = extraction
        student = obtain_student(run, progress=False, log=log)
        splits, image_size = load_data(run)
        results += extraction_attacks(
            student,
            federation_data(splits, federation, config),
            config,
            seed=federation.seed,
            setting=(
                f"{run.model} distilled on {run.dataset} at {image_size}px, K="
                f"{federation.num_clients} ({federation.scheme}, alpha={federation.alpha})"
            ),
            log=lambda _line: None,
        )
    for result in results:
        log(
            f"[fedfm] {result.name}: {result.outcome} ({result.figure}: {result.value:.4g}, "
            f"control {result.control:.4g})"
        )
    write_results(
        results_dir,
        "red_team",
        title="Red team: every attack on fedfm's promises, against the current code",
        description=(
            "One row per attack: the secret it is after, who mounts it, its outcome against the "
            "current code, the measured figure, the same figure under the conditions the attack "
            "was written against (control) and the test that checks both. Protocol attacks on "
            "an untrained micro student (8x8 digits, two clients, simulate backend): they "
            "measure messages, not accuracy."
        ),
        rows=[asdict(result) for result in results],
        columns=[
            ("name", "attack"),
            ("target", "target"),
            ("adversary", "adversary"),
            ("outcome", "outcome"),
            ("figure", "figure"),
            ("value", "value"),
            ("control", "control"),
            ("test", "test"),
        ],
        command=command,
    )
    return results
