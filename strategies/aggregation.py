"""Aggregation of fedfm client updates through any Flower strategy.

fedfm's driver does all the sending and receiving itself (a double-blind round takes ``2L + 1``
round trips, not Flower's one), so a Flower strategy only aggregates: :class:`StrategyAggregator`
presents the round's updates to it as train replies (an ``ArrayRecord`` of the adapter and head
plus a ``MetricRecord`` with ``num-examples``) and returns what ``aggregate_train`` makes of them.

Before aggregating it calls ``configure_train`` with the round's global arrays and ignores the
messages that returns: strategies keep per-round state there (FedOpt's FedAdam/FedYogi/FedAdagrad
store the arrays they sent, which their update needs). Node sampling in ``configure_train`` sees a
:class:`NodeListGrid` listing the clients that returned an update.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx, Strategy
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.double_blind.server import ClientUpdate
from fedfm_clients.codec import from_array_record, to_array_record

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


@contextmanager
def task_identity() -> Iterator[None]:
    """Let Flower build messages here, also outside a Flower runtime.

    Flower 1.41 stamps every new instruction message with the process's ``TaskIdentity``, which
    only its runtimes set; strategies build such messages in ``configure_train``. Outside a
    runtime (the in-process runner, tests) this lends a placeholder identity for the duration.
    """
    try:
        TaskIdentity.run_id  # noqa: B018  # raises when no runtime has set the identity
    except RuntimeError:
        TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 0
        try:
            yield
        finally:
            TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None
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
                "returned an update; lower its min_train_nodes/min_available_nodes"
            )

    def _replies(self, server_round: int, updates: Sequence[ClientUpdate]) -> list[Message]:
        weight_key = getattr(self.strategy, "weighted_by_key", "num-examples")
        replies = []
        for update in updates:
            request = Message(
                RecordDict(),
                dst_node_id=update.node_id,
                message_type="train",
                group_id=str(server_round),
            )
            content = RecordDict(
                {
                    "arrays": to_array_record(update.arrays),
                    "metrics": MetricRecord(
                        {weight_key: update.num_examples, "train-loss": update.train_loss}
                    ),
                }
            )
            replies.append(Message(content, reply_to=request))
        return replies

    def aggregate(
        self, server_round: int, global_arrays: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        """The strategy's new global arrays, in the dtypes of ``global_arrays``.

        Raises
        ------
        ProtocolError
            If the strategy returns nothing or arrays that do not match ``global_arrays``.
        """
        self._check_node_minimum(len(updates))
        grid = NodeListGrid(update.node_id for update in updates)
        with task_identity():
            self.strategy.configure_train(
                server_round, to_array_record(global_arrays), ConfigRecord(), grid
            )
            aggregated, _ = self.strategy.aggregate_train(
                server_round, self._replies(server_round, updates)
            )
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
