"""The data owner's role of double-blind adaptation as a Flower ``ClientApp``.

Every protocol message (``query.setup``, ``train.block``, ``train.loss``, ``train.secagg``,
``evaluate.block``, ``query.refresh``) goes to :func:`handle`: decode the message into an
envelope, restore the client's state from ``context.state``, let
:class:`~fedfm.protocols.double_blind.DoubleBlindClient` answer, save the new state and reply.
The secret key is part of that state and never leaves ``context.state``; so are, between the
SecAgg stages, the client's update and its SecAgg secrets. A message the protocol refuses gets an
error reply and leaves ``context.state`` as it was.

The client's data: partition ``partition-id`` of ``num-partitions`` (node config; simulation
sets both) of the clients' pool, split exactly as the in-process runner splits it for client
``partition-id``, with the dataset settings of the run config.
"""

from __future__ import annotations

import functools
from logging import WARNING

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from fedfm.crypto import get_backend
from fedfm.distillation.pipeline import DistillRun, load_data
from fedfm.errors import ConfigError, FedfmError
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
from fedfm.protocols.double_blind.runner import Federation, federation_data
from fedfm.protocols.double_blind.settings import app_settings
from fedfm_clients.codec import (
    envelope_to_reply,
    load_records,
    message_to_envelope,
    save_records,
)

STATE_RECORDS = ("fedfm.double_blind.arrays", "fedfm.double_blind.state")  # arrays, config
_SCALARS = ("stage", "round", "block")


def save_state(state: ClientState, record_dict: RecordDict) -> None:
    """Write ``state`` into ``record_dict`` (a ``context.state``), replacing the previous one."""
    config = {name: getattr(state, name) for name in _SCALARS}
    config.update({f"config.{key}": value for key, value in state.config.items()})
    save_records(record_dict, STATE_RECORDS, state.arrays, config)


def load_state(record_dict: RecordDict) -> ClientState:
    """The state saved by :func:`save_state`; a new client's state if there is none."""
    records = load_records(record_dict, STATE_RECORDS)
    if records is None:
        return ClientState()
    arrays, config = records
    prefix = "config."
    return ClientState(
        stage=str(config["stage"]),
        round=int(config["round"]),
        block=int(config["block"]),
        config={k[len(prefix) :]: v for k, v in config.items() if k.startswith(prefix)},
        arrays=arrays,
    )


@functools.lru_cache(maxsize=2)
def _partitions(
    distill_run: DistillRun, federation: Federation, eval_fraction: float
) -> tuple[ClientData, ...]:
    """Every client's data (cached: a process serves many messages and often many nodes)."""
    splits, _ = load_data(distill_run)
    protocol = DoubleBlindConfig(eval_fraction=eval_fraction)
    return tuple(federation_data(splits, federation, protocol))


def client_role(context: Context) -> DoubleBlindClient:
    """The client role of this node: its partition of the pool and the run's crypto backend."""
    settings = app_settings(context.run_config)
    try:
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
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
    data = _partitions(settings.distill_run, federation, settings.protocol.eval_fraction)
    return DoubleBlindClient(
        data[partition_id], get_backend(settings.protocol.backend), partition_id=partition_id
    )


def handle(message: Message, context: Context) -> Message:
    """Answer one protocol message; a refused message gets an error reply, state untouched."""
    try:
        envelope = message_to_envelope(message, message.metadata.dst_node_id)
        reply, state = client_role(context).handle(envelope, load_state(context.state))
        answer = envelope_to_reply(reply, message)
    except FedfmError as error:
        reason = f"{type(error).__name__}: {error}"
        log(WARNING, "[fedfm] refused %s: %s", message.metadata.message_type, reason)
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)
    save_state(state, context.state)
    return answer


app = ClientApp()
_REGISTER = {"train": app.train, "evaluate": app.evaluate, "query": app.query}
for _message_type in (SETUP, TRAIN_BLOCK, TRAIN_LOSS, TRAIN_SECAGG, EVALUATE_BLOCK, REFRESH):
    _category, _action = _message_type.split(".")
    _REGISTER[_category](_action)(handle)
