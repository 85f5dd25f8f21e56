"""The one Flower seam (fedfm.flower) and the strategy adapter's guard on a Flower internal."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import RecordDict

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
