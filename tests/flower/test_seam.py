"""The one Flower seam (fedfm.flower) and the strategy adapter's guard on a Flower internal."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, RecordDict

from fedfm.errors import ConfigError, ProtocolError
from fedfm.flower import codec
from fedfm.protocols.double_blind.client import ClientState
from fedfm.runtime import NodeState
from fedfm_strategies import aggregation


@pytest.mark.parametrize(
    "state",
    [
        ClientState(
            stage="ready",
            round=3,
            block=2,
            config={"rank": 8, "backend": "simulate", "lr": 0.05},
            arrays={"key.secret": np.arange(6, dtype=np.uint8)},
        ),
        NodeState(),
    ],
    ids=["double-blind client", "runtime node"],
)
def test_both_stacks_keep_their_state_through_the_one_codec(state: object) -> None:
    names = codec.state_records("fedfm.test")
    record_dict = RecordDict()
    assert codec.load_state(type(state), record_dict, names) == type(state)()
    codec.save_state(state, record_dict, names)
    restored = codec.load_state(type(state), record_dict, names)
    assert restored.to_records()[1] == state.to_records()[1]
    for name, array in state.to_records()[0].items():
        np.testing.assert_array_equal(restored.to_records()[0][name], array)


def test_a_damaged_client_state_is_named() -> None:
    with pytest.raises(ProtocolError, match="damaged client state"):
        ClientState.from_records({}, {"stage": "ready"})


def test_the_task_identity_shim_refuses_an_unchecked_flower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with aggregation.task_identity():  # the installed, checked version works
        pass
    monkeypatch.setattr(aggregation, "flwr_version", lambda _: "9.0.0")
    refused = pytest.raises(ConfigError, match=r"checked with flwr 1\.41\.x; flwr 9\.0\.0")
    with refused, aggregation.task_identity():
        pass


def test_a_client_app_that_refuses_after_decrypting_keeps_the_left_state_and_no_value() -> None:
    """Through the one ClientApp factory: a forged train.loss (a chosen value in the loss slot)
    gets an error reply that names no decrypted value, and ``context.state`` now holds the
    client that left the run, so the server's next request is refused without an answer."""
    from dataclasses import replace

    from flwr.app import Context

    from fedfm.experiments import red_team
    from fedfm.flower.apps import make_client_app
    from fedfm.protocols.double_blind.client import LEFT
    from fedfm.protocols.double_blind.config import MESSAGE_TYPES, TRAIN_LOSS
    from fedfm.protocols.double_blind.messages import pack_batches, unpack_batches
    from fedfm.runtime.transport import Envelope

    arena = red_team.build_arena()
    server, client, state, _ = red_team._pair(arena)
    app = make_client_app(
        lambda _context: client,
        ClientState,
        message_types=MESSAGE_TYPES,
        state_name="fedfm.test",
    )
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    codec.save_state(state, context.state, codec.state_records("fedfm.test"))

    def ask(envelope: Envelope) -> Message:
        with aggregation.task_identity():  # messages made outside a Flower run need one
            return app(codec.envelope_to_message(envelope), context)

    request = server.start("train", 0, 1, server.initial_arrays(arena.model.vit.embed_dim))
    while request.message_type != TRAIN_LOSS:
        reply = ask(request)
        assert not reply.has_error(), reply.error.reason
        request = server.on_reply(codec.message_to_envelope(reply, 0))
    count = int(request.config["num_batches"])
    losses = unpack_batches(request, "loss", count, server.sessions[0].evaluator.load)
    secret = float(arena.data[0].train_images[5].mean())
    forged = dict(request.arrays)
    forged.update(
        pack_batches("loss", [replace(x, values=np.full_like(x.values, secret)) for x in losses])
    )
    refused = ask(Envelope(TRAIN_LOSS, 0, request.round, forged, request.config))
    assert refused.has_error() and "leaves the run" in refused.error.reason
    assert all(f"{secret:.{d}f}" not in refused.error.reason for d in (2, 3, 4))
    kept = codec.load_state(ClientState, context.state, codec.state_records("fedfm.test"))
    assert kept.stage == LEFT and not kept.arrays
    again = ask(Envelope(TRAIN_LOSS, 0, request.round, request.arrays, request.config))
    assert again.has_error() and "left the run" in again.error.reason
