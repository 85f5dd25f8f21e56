"""Aggregation of fedfm client updates through any Flower strategy.

fedfm's driver does all the sending and receiving itself (a double-blind round takes ``2L + 1``
round trips, plus 4 for secure aggregation, not Flower's one), so a Flower strategy only
aggregates: :class:`StrategyAggregator` presents the round's training to it as train replies (an
``ArrayRecord`` of the adapter and head plus a ``MetricRecord`` with ``num-examples``) and returns
what ``aggregate_train`` makes of them.

With secure aggregation the server holds no client's update, only their weighted average: the
strategy gets that as a single train reply from node :data:`AGGREGATE_NODE_ID` with
``num-examples`` = the total weight (and ``num-clients``). FedAvg returns it unchanged; FedAdam,
FedYogi and FedAdagrad apply their server optimiser to it exactly as to the average of individual
replies. Strategies that need the individual updates (median, trimmed mean, Krum, Bulyan,
per-client clipping for differential privacy) cannot work under secure aggregation: given one
reply they see nothing to compare or clip; turn secure aggregation off to use them.

Before aggregating it calls ``configure_train`` with the round's global arrays and ignores the
messages that returns: strategies keep per-round state there (FedOpt's FedAdam/FedYogi/FedAdagrad
store the arrays they sent, which their update needs). Node sampling in ``configure_train`` sees a
:class:`NodeListGrid` listing the clients that returned an update.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import version as flwr_version
from typing import NoReturn

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx, Strategy
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedfm.errors import ConfigError, ProtocolError
from fedfm.flower.codec import from_array_record, to_array_record
from fedfm.protocols.double_blind import SecureAggregate
from fedfm.protocols.double_blind.server import ClientUpdate

# The sender of a secure aggregate's train reply: no single node (Flower's node ids are positive).
AGGREGATE_NODE_ID = 0

# Built-in names. The driver decides who takes part (``min-clients``), so their node minimums are
# 1. FedProx aggregates as FedAvg does; its proximal term belongs in the client's loss, which the
# double-blind client does not add (``proximal-mu`` would travel in configure_train's messages,
# which are not sent).
BUILT_IN: dict[str, type[FedAvg]] = {"fedavg": FedAvg, "fedadam": FedAdam, "fedprox": FedProx}


def make_strategy(name: str) -> Strategy:
    """The strategy called ``name``: a built-in name or ``module:attribute``.

    ``attribute`` is a Strategy subclass or any callable returning a Strategy; it is called with
    no arguments.

    Raises
    ------
    ConfigError
        If the name is unknown, cannot be imported, or does not give a Strategy.
    """
    if name in BUILT_IN:
        return BUILT_IN[name](min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"unknown strategy {name!r}: use one of {sorted(BUILT_IN)} or 'module:Class'"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"cannot load strategy {name!r}: {error}") from error
    try:
        strategy = factory()
    except TypeError as error:
        raise ConfigError(
            f"strategy {name!r} cannot be built without arguments: {error}"
        ) from error
    if not isinstance(strategy, Strategy):
        raise ConfigError(f"{name!r} gave a {type(strategy).__name__}, not a Flower Strategy")
    return strategy


class NodeListGrid(Grid):
    """A grid that only lists nodes: all ``configure_train``'s node sampling asks of it."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self._node_ids)

    def _refuse(self, *_: object, **__: object) -> NoReturn:
        raise ProtocolError("NodeListGrid only lists nodes; fedfm's driver sends the messages")

    set_run = create_message = push_messages = pull_messages = send_and_receive = _refuse

    @property
    def run(self) -> Run:
        self._refuse()


# The Flower versions whose internal ``TaskIdentity`` the shim below was checked against (its
# class attributes and the RuntimeError it raises when unset are not public API).
TASK_IDENTITY_CHECKED = ("1.41.",)


def _check_task_identity_shim() -> None:
    """Refuse to patch a Flower internal this shim was not checked against."""
    installed = flwr_version("flwr")
    if not installed.startswith(TASK_IDENTITY_CHECKED):
        raise ConfigError(
            f"fedfm's strategy adapter lends Flower's internal TaskIdentity outside a runtime and "
            f"was checked with flwr {', '.join(v + 'x' for v in TASK_IDENTITY_CHECKED)}; flwr "
            f"{installed} is installed: install a checked version (pyproject.toml pins one) or "
            "check flwr.supercore.task_identity and extend TASK_IDENTITY_CHECKED"
        )


@contextmanager
def task_identity() -> Iterator[None]:
    """Let Flower build messages here, also outside a Flower runtime.

    Flower 1.41 stamps every new instruction message with the process's ``TaskIdentity``, which
    only its runtimes set; strategies build such messages in ``configure_train``. Outside a
    runtime (the in-process runner, tests) this lends a placeholder identity for the duration.
    """
    _check_task_identity_shim()
    try:
        TaskIdentity.run_id  # noqa: B018  # raises when no runtime has set the identity
    except RuntimeError:
        TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 0
        try:
            yield
        finally:
            # Flower's unset state is None, which its annotations do not admit
            TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None  # type: ignore[assignment]
    else:
        yield


class StrategyAggregator:
    """fedfm's :class:`~fedfm.protocols.double_blind.Aggregator` backed by a Flower strategy."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def _check_node_minimum(self, count: int) -> None:
        # configure_train would wait forever for nodes that will not come
        needed = max(
            getattr(self.strategy, "min_available_nodes", 0),
            getattr(self.strategy, "min_train_nodes", 0),
        )
        if count < needed:
            raise ProtocolError(
                f"{type(self.strategy).__name__} needs {needed} nodes to aggregate, {count} "
                "contributed an update; lower its min_train_nodes/min_available_nodes"
            )

    def _reply(
        self,
        server_round: int,
        node_id: int,
        arrays: dict[str, np.ndarray],
        weight: int,
        metrics: dict[str, int | float],
    ) -> Message:
        """A train reply from ``node_id`` as Flower's runtime would hand it to the strategy."""
        weight_key = getattr(self.strategy, "weighted_by_key", "num-examples")
        request = Message(
            RecordDict(), dst_node_id=node_id, message_type="train", group_id=str(server_round)
        )
        content = RecordDict(
            {
                "arrays": to_array_record(arrays),
                "metrics": MetricRecord({weight_key: weight, **metrics}),
            }
        )
        return Message(content, reply_to=request)

    def aggregate(
        self, server_round: int, global_arrays: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        """The strategy's new global arrays from one train reply per client's update.

        Raises
        ------
        ProtocolError
            If the strategy returns nothing or arrays that do not match ``global_arrays``.
        """
        replies = [
            self._reply(
                server_round, u.node_id, u.arrays, u.num_examples, {"train-loss": u.train_loss}
            )
            for u in updates
        ]
        return self._aggregate(server_round, global_arrays, [u.node_id for u in updates], replies)

    def aggregate_secure(
        self, server_round: int, global_arrays: dict[str, np.ndarray], aggregate: SecureAggregate
    ) -> dict[str, np.ndarray]:
        """The strategy's new global arrays from the secure aggregate as a single train reply.

        Node sampling in ``configure_train`` and the strategy's node minimums see the clients
        in the aggregate.
        """
        reply = self._reply(
            server_round,
            AGGREGATE_NODE_ID,
            aggregate.arrays,
            aggregate.total_weight,
            {"train-loss": aggregate.train_loss, "num-clients": len(aggregate.included)},
        )
        return self._aggregate(server_round, global_arrays, sorted(aggregate.included), [reply])

    def _aggregate(
        self,
        server_round: int,
        global_arrays: dict[str, np.ndarray],
        node_ids: Sequence[int],
        replies: list[Message],
    ) -> dict[str, np.ndarray]:
        """``configure_train`` then ``aggregate_train``; the result in ``global_arrays``' dtypes."""
        self._check_node_minimum(len(node_ids))
        grid = NodeListGrid(node_ids)
        with task_identity():
            self.strategy.configure_train(
                server_round, to_array_record(global_arrays), ConfigRecord(), grid
            )
            aggregated, _ = self.strategy.aggregate_train(server_round, replies)
        name = type(self.strategy).__name__
        if aggregated is None:
            raise ProtocolError(f"{name} aggregated nothing in round {server_round}")
        arrays = from_array_record(aggregated)
        if set(arrays) != set(global_arrays):
            raise ProtocolError(f"{name} returned arrays {sorted(arrays)}, not the adapter's")
        result = {}
        for key, reference in global_arrays.items():
            if arrays[key].shape != reference.shape:
                raise ProtocolError(f"{name} returned {key} with shape {arrays[key].shape}")
            result[key] = arrays[key].astype(reference.dtype, copy=False)
        return result
