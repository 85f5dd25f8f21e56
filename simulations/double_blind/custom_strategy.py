"""A custom aggregation strategy for the double-blind app: FedAvg that logs what it combines.

Select it with ``--run-config "strategy='custom_strategy:LoggingFedAvg'"``: Flower puts the app's
folder on the ServerApp's import path, so this module imports as ``custom_strategy``. Any
``module:attribute`` importable there works the same way; the attribute is called with no
arguments and must give a ``flwr.serverapp.strategy.Strategy``.

With secure aggregation on (the default) a strategy gets a single train reply per round, the
securely averaged adapter and head, from node 0 with ``num-examples`` = the total weight and
``num-clients`` = how many clients it averages; with ``secure-aggregation=false`` it gets one
reply per client.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp.strategy import FedAvg


class LoggingFedAvg(FedAvg):
    """FedAvg (with node minimums of 1) that logs each round's replies and their weights."""

    def __init__(self) -> None:
        super().__init__(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        weights = {
            reply.metadata.src_node_id: (
                metrics[self.weighted_by_key],
                metrics.get("num-clients", 1),
            )
            for reply in replies
            for metrics in reply.content.metric_records.values()
        }
        log(
            INFO,
            "[custom strategy] round %d: averaging {node: (weight, clients)} %s",
            server_round,
            weights,
        )
        return super().aggregate_train(server_round, replies)
