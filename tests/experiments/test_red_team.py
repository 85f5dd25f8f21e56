"""The red team's attacks: each one succeeds under the conditions it was written against (its
control) and fails against the current code, and ``fedfm red-team`` lists them all."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedfm.crypto.randomness import ResearchStream, SecretStream
from fedfm.errors import ConfigError, ProtocolAbort, ProtocolError
from fedfm.experiments import red_team
from fedfm.experiments.red_team import DEFENDED, SUCCEEDS, Arena, AttackResult
from fedfm.protocols.double_blind.client import LEFT, ClientState
from fedfm.protocols.double_blind.config import TRAIN_LOSS
from fedfm.protocols.double_blind.messages import pack_batches, unpack_batches
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.runtime.transport import Envelope


@pytest.fixture(scope="module")
def arena() -> Arena:
    return red_team.build_arena()


def check(result: AttackResult, name: str) -> None:
    assert result.name == name
    assert result.test.endswith(f"::test_{name}")
    assert result.outcome == DEFENDED, result


def test_permutation_replay(arena: Arena) -> None:
    """A client that knows the run config's seed recomputes the permutations of a seeded
    server (every batch of its round), and none of a server keyed by its secret stream."""
    result = red_team.permutation_replay(arena)
    check(result, "permutation_replay")
    assert result.control == 1.0 and result.value == 0.0
    # the same replay against a server keyed by another public number finds nothing either
    assert red_team._replay_hits(arena, ResearchStream(red_team.PUBLIC_SEED + 1)) == 0.0
    assert red_team._replay_hits(arena, SecretStream()) == 0.0


def test_backend_downgrade(arena: Arena) -> None:
    result = red_team.backend_downgrade(arena)
    check(result, "backend_downgrade")
    assert (result.control, result.value) == (1.0, 0.0)
    # the data owner's opt-in is its own decision: with it, the plaintext run goes through
    assert red_team._plaintext_share(arena, DataOwnerPolicy(allow_plaintext=True)) == 1.0


def test_secure_aggregation_downgrade(arena: Arena) -> None:
    result = red_team.secure_aggregation_downgrade(arena)
    check(result, "secure_aggregation_downgrade")
    assert (result.control, result.value) == (1.0, 0.0)


def test_round_replay(arena: Arena) -> None:
    result = red_team.round_replay(arena)
    check(result, "round_replay")
    assert (result.control, result.value) == (2.0, 1.0)


def test_evaluation_flood(arena: Arena) -> None:
    """After one full evaluation, kept evaluations are free for the server: a client answers
    only the rounds announced at setup (3 of the 13 asked), a client without the bound all."""
    result = red_team.evaluation_flood(arena)
    check(result, "evaluation_flood")
    assert (result.value, result.control) == (3.0, 1.0 + red_team.FLOOD_REQUESTS)


def test_loss_decryption_oracle(arena: Arena) -> None:
    """Yes/no questions hidden in train.loss: every one answered by a client whose refusals
    left its state alone (a bisection of the pixel to 2^-8 of its range), at most the answers
    up to the first refusal now."""
    result = red_team.loss_decryption_oracle(arena)
    check(result, "loss_decryption_oracle")
    assert result.control == red_team.ORACLE_QUESTIONS
    assert 1 <= result.value <= np.log2(red_team.ORACLE_QUESTIONS + 1)


def test_a_refusal_after_decryption_names_no_value_and_the_client_leaves(arena: Arena) -> None:
    """The refusal's text goes back to the server (Flower's error reply): it carries no value
    the client decrypted, and the client, having refused, answers nothing more in the run."""
    server, client, state, _ = red_team._pair(arena)
    request, state = red_team._to_loss(arena, server, client, state, 1)
    count = int(request.config["num_batches"])
    losses = unpack_batches(request, "loss", count, server.sessions[0].evaluator.load)
    secret = float(arena.data[0].train_images[5].mean())
    chosen = [replace(loss, values=np.full_like(loss.values, secret)) for loss in losses]
    forged = dict(request.arrays)
    forged.update(pack_batches("loss", chosen))
    with pytest.raises(ProtocolAbort) as refused:
        client.handle(Envelope(TRAIN_LOSS, 0, request.round, forged, request.config), state)
    numbers = [float(x) for x in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", str(refused.value))]
    assert all(abs(x - secret) > 1e-3 for x in numbers), str(refused.value)
    left = refused.value.state
    assert isinstance(left, ClientState) and left.stage == LEFT and not left.arrays
    with pytest.raises(ProtocolError, match="left the run"):
        client.handle(Envelope(TRAIN_LOSS, 0, request.round, request.arrays, request.config), left)
    with pytest.raises(ProtocolError, match="left the run"):
        client.handle(server.setup_request(0), left)


@pytest.mark.ckks
def test_key_holder_rows_report_the_refresh_budget_and_circuit_privacy() -> None:
    """The rows for defects 4 and 5 (their own tests: tests/crypto/test_refresh.py and
    test_circuit_privacy.py): the deployment set's run stays within 2^-40 where the previous
    chain was near 2^-15 over a default run; the key holder names the server's swap masks from
    c1 every time before release and at chance after it."""
    refresh = red_team.refresh_distance_per_run()
    assert refresh.outcome == DEFENDED and refresh.value <= -40 and refresh.control > -16
    privacy = red_team.circuit_privacy_distinguisher(trials=20)
    assert privacy.control == 1.0 and privacy.outcome == DEFENDED
    assert abs(privacy.value - 0.5) <= 3.2 * 0.5 / 20**0.5


def test_secagg_rows_report_the_active_server_attacks() -> None:
    """The rows the red team writes for SecAgg+ (the attacks' own tests live in
    tests/secagg/test_active_server.py): key substitution is defended by signed keys, false
    dropouts succeed from six clients on the complete graph, not with the default five."""
    substitution = red_team.secagg_key_substitution()
    assert (substitution.outcome, substitution.value, substitution.control) == (DEFENDED, 0, 1)
    dropouts = red_team.secagg_false_dropouts()
    assert (dropouts.outcome, dropouts.value, dropouts.control) == (SUCCEEDS, 1, 0)


def test_relay_pin_injection() -> None:
    result = red_team.relay_pin_injection()
    check(result, "relay_pin_injection")
    assert (result.control, result.value) == (1.0, 0.0)
    # the same injection through the runtime's ClientApp role builder (what a SuperNode runs):
    # the relay's run config names pins, the site's node config has roles but no pins
    from flwr.app import Context, RecordDict

    from fedfm.protocols.masked_sum import masked_sum
    from fedfm.runtime.identity import Identity, IdentityError, KeyBundle, format_pins
    from fedfm.runtime.settings import node_settings
    from fedfm_clients.runtime import node_runtime

    relay = Identity.generate()
    context = Context(
        run_id=1,
        node_id=1,
        node_config={"roles": "alice"},
        state=RecordDict(),
        run_config={"pins": format_pins({"bob": relay.fingerprint})},
    )
    with pytest.raises(ConfigError, match=r"run config keys \['pins'\] are refused"):
        node_runtime(masked_sum, context)
    # without the relay's keys the site's own node config decides: no identity key is an error
    # naming the key, and a peer without a pin is refused naming 'pins'
    context.run_config = {}
    with pytest.raises(ConfigError, match="node config 'identity-key'"):
        node_runtime(masked_sum, context)
    forged = KeyBundle.signed(relay, ("bob",), os.urandom(32), b"d" * 32, b"s" * 16)
    with pytest.raises(IdentityError, match="node config 'pins'"):
        forged.verify("bob", node_settings(context.node_config).pins, b"d" * 32, b"s" * 16)


def test_the_client_refuses_what_its_stage_does_not_expect(arena: Arena) -> None:
    """The state machine's other rules: setup only with no round open, the loss only after the
    last block, evaluation labels only the client's own."""
    server, client, state, _ = red_team._pair(arena)
    request = server.start("train", 0, 1, server.initial_arrays(arena.model.vit.embed_dim))
    reply, open_state = client.handle(request, state)  # block 1: a round is open
    with pytest.raises(ProtocolError, match=r"cannot accept 'query\.setup'"):
        client.handle(server.setup_request(0), open_state)
    loss = Envelope(TRAIN_LOSS, 0, 1, {}, {"num_batches": 2})
    with pytest.raises(ProtocolAbort, match="after the last block, once") as early:
        client.handle(loss, open_state)
    assert isinstance(early.value.state, ClientState) and early.value.state.stage == LEFT
    # a second block 1 of the open round is a replay of it
    with pytest.raises(ProtocolAbort, match="rounds only move forward"):
        client.handle(request, open_state)
    # state unchanged by refusals: the next block still fits
    server.on_reply(reply)
    assert open_state.stage == "train" and open_state.block == 1


def test_the_policy_comes_from_node_config_and_names_its_rules() -> None:
    policy = DataOwnerPolicy.from_node_config(
        {"allow-plaintext": "true", "min-aggregate": 3, "max-rounds": 5, "partition-id": 0}
    )
    assert policy == DataOwnerPolicy(allow_plaintext=True, min_aggregate=3, max_rounds=5)
    strict = DataOwnerPolicy.from_node_config({"backends": "ckks"})
    strict.check_setup(backend="ckks", secure_aggregation=True, rounds=6)
    with pytest.raises(ProtocolError, match=r"accepts only \['ckks'\] \(node config backends\)"):
        strict.check_setup(backend="ckks-8192", secure_aggregation=True, rounds=6)
    with pytest.raises(ConfigError, match="'backends' must be a string"):
        DataOwnerPolicy.from_node_config({"backends": 3})
    with pytest.raises(ProtocolError, match="max-rounds=5"):
        policy.check_setup(backend="ckks", secure_aggregation=True, rounds=6)
    with pytest.raises(ProtocolError, match="min-aggregate=3"):
        policy.check_aggregate(2)
    with pytest.raises(ConfigError, match="min-aggregate must be >= 2"):
        DataOwnerPolicy(min_aggregate=1)
    with pytest.raises(ConfigError, match="'allow-plaintext' must be true or false"):
        DataOwnerPolicy.from_node_config({"allow-plaintext": "yes"})
    assert ClientState().trained_round == 0


def test_extraction_attacks_report_their_fits(arena: Arena) -> None:
    """On the micro student (two blocks): the default tap set (the last output only) against the
    paper's (every output): one entry per fit, its outcome the threshold rule on the measured
    R^2; with one revealed output there is no pair of outputs to fit."""
    config = replace(arena.config, reveal="last")
    results = red_team.extraction_attacks(
        arena.model, arena.data, config, seed=0, setting="micro", log=lambda _: None
    )
    assert [r.name for r in results] == ["extraction_block1", "extraction_later_blocks"]
    for result in results:
        assert np.isfinite([result.value, result.control]).all()
        expected = SUCCEEDS if result.value >= red_team.EXTRACTION_SUCCESS_R2 else DEFENDED
        assert result.outcome == expected and result.adversary == "curious client"
    first, later = results
    assert later.value == 0.0 and later.control > red_team.EXTRACTION_SUCCESS_R2
    assert first.control > red_team.EXTRACTION_SUCCESS_R2  # block 1 alone: the seed's leak


@pytest.mark.slow
def test_red_team_command_writes_every_attack(tmp_path: Path) -> None:
    results = red_team.run_red_team(results_dir=tmp_path, log=lambda _: None, command="test")
    payload = json.loads((tmp_path / "red_team.json").read_text())
    names = [row["name"] for row in payload["rows"]]
    assert names == [result.name for result in results]
    assert set(red_team.ARENA_ATTACKS) | set(red_team.STANDALONE_ATTACKS) <= set(names)
    for row in payload["rows"]:
        assert row["outcome"] in (DEFENDED, SUCCEEDS)
        assert row["test"].startswith("tests/") and "::test_" in row["test"]
        assert {"target", "adversary", "figure", "value", "control"} <= set(row)
    assert "| permutation_replay |" in (tmp_path / "red_team.md").read_text()
    assert np.isfinite([row["control"] for row in payload["rows"]]).all()


def test_the_red_team_names_an_unknown_protocol_suite(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no attack suite registered for \['nope'\]"):
        red_team.run_red_team(results_dir=tmp_path, log=lambda _: None, protocols=["nope"])
    assert not list(tmp_path.iterdir())
