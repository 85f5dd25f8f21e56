"""Runtime protocols as Flower apps: the demo app's config, ClientApp/ServerApp over Flower
messages, refusals that keep state, and ``flwr run`` against the in-process run."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
)

from fedfm.errors import ProtocolError
from fedfm.flower.codec import HOLD_MESSAGE_TYPE, to_array_record
from fedfm.protocols.masked_sum import masked_sum
from fedfm.runtime import (
    NodeState,
    run_in_process,
)
from fedfm.runtime.settings import RUN_CONFIG_DEFAULTS
from fedfm_clients.runtime import load_state, save_state
from fedfm_strategies.aggregation import task_identity
from fedfm_strategies.runtime import run_on_grid
from tests.helpers import processes_with
from tests.runtime.support import (
    DEMO,
    LoopbackGrid,
    demo_inputs,
    flower_contexts,
    load_demo,
)


def test_demo_app_declares_the_components_and_every_default() -> None:
    flwr = tomllib.loads((DEMO / "pyproject.toml").read_text())["tool"]["flwr"]
    assert flwr["app"]["components"] == {
        "serverapp": "fedfm_strategies.masked_sum:app",
        "clientapp": "fedfm_clients.masked_sum:app",
    }
    assert flwr["app"]["config"] == RUN_CONFIG_DEFAULTS


@pytest.fixture
def demo_workspace(tmp_path: Path) -> tuple[Path, dict[str, str], str]:
    """The runtime demo app's inputs, run config and the nodes' own config in a fresh
    workspace."""
    workspace = tmp_path / "workspace"
    return workspace, *load_demo().prepare(workspace, length=16, seed=3)


def test_flower_apps_over_flower_messages_equal_the_in_process_run(demo_workspace) -> None:
    workspace, run_config, node_config = demo_workspace
    grid = LoopbackGrid(flower_contexts(run_config, node_config))
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


def test_keep_warm_follows_every_request_with_a_hold_and_changes_no_result(demo_workspace) -> None:
    """Run config ``keep-warm``: the relay follows each request with a hold for the same node
    (answered by the ClientApp, dropped by the transport) and the run's outputs stay those of
    the in-process run; without it, no hold goes out."""
    workspace, run_config, node_config = demo_workspace
    results = {}
    for keep_warm in (True, False):
        config = {**run_config, "keep-warm": keep_warm}
        grid = LoopbackGrid(flower_contexts(config, node_config))
        pushed: list[tuple[str, int]] = []
        push = grid.push_messages

        def recording_push(messages, push=push, pushed=pushed):
            messages = list(messages)
            pushed.extend((m.metadata.message_type, m.metadata.dst_node_id) for m in messages)
            return push(messages)

        grid.push_messages = recording_push  # type: ignore[method-assign]
        with task_identity():
            results[keep_warm] = run_on_grid(grid, masked_sum, config, log=lambda _: None)
        requests = [item for item in pushed if item[0] != HOLD_MESSAGE_TYPE]
        holds = [item for item in pushed if item[0] == HOLD_MESSAGE_TYPE]
        if keep_warm:
            # one hold per request, for the same node, after that request
            assert requests and Counter(n for _, n in holds) == Counter(n for _, n in requests)
            for index, (kind, node) in enumerate(pushed):
                if kind == HOLD_MESSAGE_TYPE:
                    earlier = pushed[:index]
                    assert sum(n == node and k != kind for k, n in earlier) > sum(
                        n == node and k == kind for k, n in earlier
                    )
            assert not grid.replies  # the hold replies were pulled (and dropped)
        else:
            assert holds == []
    expected = run_in_process(masked_sum(), demo_inputs(workspace))
    for result in results.values():
        assert result.to_dict()["outputs"] == expected.to_dict()["outputs"]


def test_flower_client_app_refuses_a_tampered_frame_and_keeps_its_state(demo_workspace) -> None:
    _, run_config, node_config = demo_workspace
    contexts = flower_contexts(run_config, node_config)
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
