"""The data owner's role of double-blind adaptation as a Flower ``ClientApp``.

Every protocol message (``query.setup``, ``train.block``, ``train.loss``, ``train.secagg``,
``evaluate.block``, ``query.refresh``) goes through the one ClientApp factory
(:func:`fedfm.flower.apps.make_client_app`): decode the message into an envelope, restore the
client's state from ``context.state``, let :class:`~fedfm.protocols.double_blind.DoubleBlindClient`
answer, save the new state and reply.
The secret key is part of that state and never leaves ``context.state``; so are, between the
SecAgg stages, the client's update and its SecAgg secrets. A message the protocol refuses gets an
error reply and leaves ``context.state`` as it was.

The client's data: partition ``partition-id`` of ``num-partitions`` (node config; simulation
sets both) of the clients' pool, split exactly as the in-process runner splits it for client
``partition-id``, with the dataset settings of the run config.

The data owner's SecAgg identity and pins come from its node config only (``identity-key``,
``secagg-pins``, ``secagg-mode``; in simulation the folder ``secagg-identity-dir`` names):
:func:`fedfm.protocols.double_blind.identities.data_owner_key_authentication`.
"""

from __future__ import annotations

import functools

from flwr.app import Context, RecordDict

from fedfm.errors import ConfigError
from fedfm.flower import codec
from fedfm.flower.apps import make_client_app, node_config
from fedfm.models.device import resolve_device
from fedfm.models.student import StudentSource
from fedfm.protocols.double_blind.client import ClientData, ClientState, DoubleBlindClient
from fedfm.protocols.double_blind.config import (
    EVALUATE_BLOCK,
    REFRESH,
    SETUP,
    TRAIN_BLOCK,
    TRAIN_LOSS,
    TRAIN_SECAGG,
    DoubleBlindConfig,
)
from fedfm.protocols.double_blind.identities import data_owner_key_authentication
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.runner import Federation, federation_data
from fedfm.protocols.double_blind.settings import app_settings

STATE_NAME = "fedfm.double_blind"  # context.state records <STATE_NAME>.arrays and .state


@functools.lru_cache(maxsize=2)
def _partitions(
    student: StudentSource, federation: Federation, eval_fraction: float
) -> tuple[ClientData, ...]:
    """Every client's data (cached: a process serves many messages and often many nodes)."""
    splits, _ = student.load_data()
    protocol = DoubleBlindConfig(eval_fraction=eval_fraction)
    return tuple(federation_data(splits, federation, protocol))


def client_role(context: Context) -> DoubleBlindClient:
    """The client role of this node: its partition of the pool and its own privacy policy.

    The policy (which backends it accepts, whether secure aggregation is required, ...) comes
    from the node config (:class:`~fedfm.protocols.double_blind.policy.DataOwnerPolicy`), never
    from the run config; the backend is the one the server's setup names, if the policy
    accepts it.
    """
    settings = app_settings(context.run_config)
    own = node_config(context)
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

    def data() -> ClientData:  # loaded by the first message that needs it (not a refresh)
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


def save_state(state: ClientState, record_dict: RecordDict) -> None:
    """Write a client's ``state`` into ``record_dict`` (a ``context.state``), as the app does."""
    codec.save_state(state, record_dict, codec.state_records(STATE_NAME))


def load_state(record_dict: RecordDict) -> ClientState:
    """The state the app keeps in ``record_dict``; a new client's state if there is none."""
    return codec.load_state(ClientState, record_dict, codec.state_records(STATE_NAME))


app = make_client_app(
    client_role,
    ClientState,
    message_types=(SETUP, TRAIN_BLOCK, TRAIN_LOSS, TRAIN_SECAGG, EVALUATE_BLOCK, REFRESH),
    state_name=STATE_NAME,
)
