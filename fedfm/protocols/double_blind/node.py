"""A data owner's role for one run, from the run config and the data owner's own node config.

One function for both places a data owner runs: the ClientApp (:mod:`fedfm_clients.double_blind`,
from a Flower ``Context``) and the long-lived site process (``fedfm site``,
:mod:`fedfm.runtime.site`), which holds the role across messages.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from fedfm.errors import ConfigError
from fedfm.models.device import resolve_device
from fedfm.models.student import StudentSource, TextStudentSource
from fedfm.protocols.double_blind.client import ClientData, DoubleBlindClient
from fedfm.protocols.double_blind.config import DoubleBlindConfig
from fedfm.protocols.double_blind.identities import data_owner_key_authentication
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.runner import (
    Federation,
    federation_data,
    text_federation_data,
)
from fedfm.protocols.double_blind.settings import app_settings
from fedfm.protocols.double_blind.text import TextClientData


@functools.lru_cache(maxsize=2)
def _partitions(
    student: StudentSource | TextStudentSource, federation: Federation, eval_fraction: float
) -> tuple[ClientData | TextClientData, ...]:
    """Every client's data (cached: a process serves many messages and often many nodes):
    images, or the text task's token ids and key masks."""
    protocol = DoubleBlindConfig(eval_fraction=eval_fraction)
    if isinstance(student, StudentSource):
        splits, _ = student.load_data()
        return tuple(federation_data(splits, federation, protocol))
    texts, _ = student.load_data()
    return tuple(
        text_federation_data(texts.pool, federation, protocol, pad_token_id=student.pad_token_id())
    )


def data_owner_role(run_config: Mapping[str, Any], own: Mapping[str, Any]) -> DoubleBlindClient:
    """The client role of a node: its partition of the pool and its own privacy policy.

    ``run_config`` is the server's (dataset, partition scheme); ``own`` is the node's own
    config, from which alone come its partition, its policy (which backends it accepts, whether
    secure aggregation is required, ...: :class:`DataOwnerPolicy`), its SecAgg identity and pins,
    and its device. The backend is the one the server's setup names, if the policy accepts it.

    Raises
    ------
    ConfigError
        If ``own`` lacks an integer ``partition-id`` in ``0..num-partitions - 1``.
    """
    settings = app_settings(run_config)
    try:
        partition_id = int(own["partition-id"])
        num_partitions = int(own["num-partitions"])
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(
            "the node config needs integer 'partition-id' and 'num-partitions' (simulation sets "
            "them; start a SuperNode with --node-config 'partition-id=0 num-partitions=5')"
        ) from error
    if not 0 <= partition_id < num_partitions:
        raise ConfigError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    federation = Federation(
        num_clients=num_partitions,
        scheme=settings.federation.scheme,
        alpha=settings.federation.alpha,
        seed=settings.federation.seed,
    )

    # loaded by the first message that needs it (not a refresh)
    def data() -> ClientData | TextClientData:
        return _partitions(settings.student, federation, settings.protocol.eval_fraction)[
            partition_id
        ]

    return DoubleBlindClient(
        data,
        policy=DataOwnerPolicy.from_node_config(own),
        partition_id=partition_id,
        authentication=data_owner_key_authentication(own),
        # the data owner's own hardware: its node config's 'device', else the run config's
        device=resolve_device(str(own.get("device", settings.device))),
    )
