"""A secure-aggregation round stage by stage, for tests that inspect or alter what travels.

The library's in-process run (:func:`fedfm.protocols.secure_aggregation.run_in_process`) goes
over the runtime's transport and in-process nodes; this stepper exposes each stage's requests
and replies instead, so a test can play a misbehaving server between stages.

Every request, reply and client state goes through its ``(arrays, config)`` records on the way,
as it would through Flower, so a round here exercises the same encoding a deployment uses.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from fedfm.errors import ConfigError, FedfmError
from fedfm.protocols.secure_aggregation import signed_federation
from fedfm.secagg.authentication import KeyAuthentication
from fedfm.secagg.client import ClientSecAggState, ClientUpdate, handle
from fedfm.secagg.config import SecAggConfig
from fedfm.secagg.layout import ArrayLayout
from fedfm.secagg.messages import STAGES, Request, decode_reply, decode_request
from fedfm.secagg.records import Arrays, Config
from fedfm.secagg.server import SecAggResult, SecAggServer

Records = tuple[Arrays, Config]


class InProcessRound:
    """The server and the clients of one round, run stage by stage.

    ``dropouts`` maps a stage to the nodes that never answer its request (they crash or time
    out on receiving it); the server does not ask them again. A client that refuses a request
    (raises a :class:`FedfmError`) drops out the same way, with the reason in
    ``client_errors``. ``sent`` and ``received`` hold, per stage and node, the records of each
    request and reply: exactly what the server sent and learnt. ``pending`` are the requests
    the next :meth:`run_stage` delivers (tests may alter them to play a misbehaving server).
    ``authentication`` is each node's key authentication (default: every node signs with a
    fresh identity and pins the others', :func:`signed_federation`).
    """

    def __init__(
        self,
        config: SecAggConfig,
        updates: Mapping[int, ClientUpdate],
        *,
        round_id: int = 0,
        dropouts: Mapping[str, Collection[int]] | None = None,
        authentication: Mapping[int, KeyAuthentication] | None = None,
    ) -> None:
        self.updates = dict(updates)
        if not self.updates:
            raise ConfigError("a round needs at least one client update")
        self.authentication = dict(authentication or signed_federation(self.updates))
        self.layout = ArrayLayout.of(next(iter(self.updates.values())).arrays)
        self.server = SecAggServer(config, self.layout, round_id=round_id)
        self.dropouts = {stage: set(nodes) for stage, nodes in (dropouts or {}).items()}
        self.states: dict[int, Records] = {
            node: ClientSecAggState().to_records() for node in self.updates
        }
        self.sent: dict[str, dict[int, Records]] = {}
        self.received: dict[str, dict[int, Records]] = {}
        self.client_errors: dict[int, str] = {}
        self.pending: dict[int, Request] = dict(self.server.start(sorted(self.updates)))

    def run_stage(self) -> None:
        """Deliver the pending requests, collect the replies, hand them to the server."""
        stage = self.server.stage
        replies = {}
        for node, request in sorted(self.pending.items()):
            records = request.to_records()
            self.sent.setdefault(stage, {})[node] = records
            if node in self.dropouts.get(stage, ()):
                continue
            state = ClientSecAggState.from_records(*self.states[node])
            try:
                reply, new_state = handle(
                    state,
                    decode_request(*records),
                    update=self.updates[node],
                    authentication=self.authentication[node],
                )
            except FedfmError as error:
                self.client_errors[node] = f"{stage}: {error}"
                continue
            self.states[node] = new_state.to_records()
            reply_records = reply.to_records()
            self.received.setdefault(stage, {})[node] = reply_records
            replies[node] = decode_reply(*reply_records)
        self.pending = self.server.on_replies(replies)

    def run(self) -> SecAggResult:
        """Run the remaining stages; the result, or the server's :class:`ProtocolError`."""
        while self.server.stage in STAGES:
            self.run_stage()
        return self.server.result()

    def client_state(self, node: int) -> ClientSecAggState:
        return ClientSecAggState.from_records(*self.states[node])


# -- updates and the aggregate they should give (shared by the SecAgg test modules) ------------

CLIP = 1.0
BITS = 16  # one step (3e-5) is far above float32 rounding, so the bound is the quantization's
SHAPES = {"adapter.down": (6, 4), "adapter.up": (4, 6), "head.weight": (3, 8), "head.bias": (3,)}


def make_updates(
    count: int,
    *,
    shapes: dict[str, tuple[int, ...]] = SHAPES,
    seed: int = 0,
    spread: float = 0.9 * CLIP,
) -> dict[int, ClientUpdate]:
    """Updates keyed by Flower-like node ids: arbitrary, some above 2**63."""
    rng = np.random.default_rng(seed)
    ids = sorted({int(i) for i in rng.integers(1, 2**64 - 1, size=count, dtype=np.uint64)})
    assert len(ids) == count
    return {
        node: ClientUpdate(
            {
                name: rng.uniform(-spread, spread, shape).astype(np.float32)
                for name, shape in shapes.items()
            },
            int(rng.integers(1, 500)),
        )
        for node in ids
    }


def weighted_average(updates: dict[int, ClientUpdate], nodes, clip: float = CLIP):
    total = sum(updates[n].num_examples for n in nodes)
    names = next(iter(updates.values())).arrays
    return {
        name: sum(
            updates[n].num_examples
            * np.clip(updates[n].arrays[name].astype(np.float64), -clip, clip)
            for n in nodes
        )
        / total
        for name in names
    }, total


def bound(config: SecAggConfig) -> float:
    """The documented bound: one quantization step, plus float32 rounding of the output."""
    return config.quantizer.step + config.clipping_range * 2.0**-23


def assert_is_average_of(result, updates, nodes, config) -> None:
    expected, total = weighted_average(updates, nodes, config.clipping_range)
    assert result.included == frozenset(nodes)
    assert result.total_weight == total
    assert list(result.arrays) == list(next(iter(updates.values())).arrays)
    for name, value in expected.items():
        assert result.arrays[name].dtype == np.float32
        assert result.arrays[name].shape == value.shape
        assert np.max(np.abs(result.arrays[name] - value)) <= bound(config), name


def config(**overrides) -> SecAggConfig:
    return SecAggConfig(**{"clipping_range": CLIP, "quantization_bits": BITS, **overrides})
