"""fedfm envelopes as Flower messages, and role states as ``context.state`` records, and back.

A message carries an envelope's arrays in an ``ArrayRecord`` (numpy arrays, any dtype) and its
config values in a ``ConfigRecord`` (``int``, ``float``, ``str``, ``bytes``, ``bool``); the
round travels as the message's ``group_id`` (Flower's place for the federated round), the type as
its ``message_type``. Both Flower adapters use this module: the ServerApp's transport to send
requests and read replies, the ClientApp to read requests and answer them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedfm.errors import ConfigError, ProtocolError
from fedfm.runtime.transport import ConfigValue, Envelope, RoleState, StateT

ARRAYS = "fedfm.arrays"
CONFIG = "fedfm.config"


def to_array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Numpy arrays as an ``ArrayRecord`` (dtype and shape are kept)."""
    return ArrayRecord({name: Array(np.asarray(value)) for name, value in arrays.items()})


def from_array_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The numpy arrays of an ``ArrayRecord``."""
    return {name: array.numpy() for name, array in record.items()}


def to_config_record(config: Mapping[str, ConfigValue]) -> ConfigRecord:
    """Plain values as a ``ConfigRecord``; refuses values Flower cannot carry."""
    for key, value in config.items():
        if not isinstance(value, int | float | str | bytes | bool):
            raise ProtocolError(
                f"config value {key!r} is a {type(value).__name__}; messages carry only "
                "int, float, str, bytes and bool"
            )
    return ConfigRecord(dict(config))


def save_records(
    record_dict: RecordDict,
    names: tuple[str, str],
    arrays: Mapping[str, np.ndarray],
    config: Mapping[str, ConfigValue],
) -> None:
    """Keep ``arrays`` and ``config`` in ``record_dict`` (a ``context.state``) under ``names``
    (the arrays' record name, the config's), replacing what was there."""
    record_dict[names[0]] = to_array_record(arrays)
    record_dict[names[1]] = ConfigRecord(dict(config))


def load_records(
    record_dict: RecordDict, names: tuple[str, str]
) -> tuple[dict[str, np.ndarray], dict[str, ConfigValue]] | None:
    """What :func:`save_records` kept under ``names``; ``None`` if nothing was.

    Raises
    ------
    ConfigError
        If only one of the two records is there, or one has the wrong type.
    """
    arrays, config = record_dict.get(names[0]), record_dict.get(names[1])
    if arrays is None and config is None:
        return None
    if not isinstance(arrays, ArrayRecord) or not isinstance(config, ConfigRecord):
        raise ConfigError(f"context.state holds a damaged {names[1]!r}/{names[0]!r} pair")
    return from_array_record(arrays), dict(config)  # type: ignore[arg-type]


def state_records(name: str) -> tuple[str, str]:
    """The names of the two ``context.state`` records (arrays, config) of state ``name``."""
    return f"{name}.arrays", f"{name}.state"


def save_state(state: RoleState, record_dict: RecordDict, names: tuple[str, str]) -> None:
    """Write a role's ``state`` into ``record_dict`` (a ``context.state``), replacing the last."""
    save_records(record_dict, names, *state.to_records())


def load_state(state_type: type[StateT], record_dict: RecordDict, names: tuple[str, str]) -> StateT:
    """The state :func:`save_state` kept under ``names``; a new node's state if there is none."""
    records = load_records(record_dict, names)
    return state_type() if records is None else state_type.from_records(*records)


def _content(envelope: Envelope) -> RecordDict:
    return RecordDict(
        {ARRAYS: to_array_record(envelope.arrays), CONFIG: to_config_record(envelope.config)}
    )


def envelope_to_message(envelope: Envelope, *, ttl: float | None = None) -> Message:
    """A server request: a message to ``envelope.node_id``."""
    return Message(
        _content(envelope),
        dst_node_id=envelope.node_id,
        message_type=envelope.message_type,
        group_id=str(envelope.round),
        ttl=ttl,
    )


def envelope_to_reply(envelope: Envelope, request: Message) -> Message:
    """A client reply to ``request`` (type, round and addresses come from the request)."""
    if envelope.message_type != request.metadata.message_type:
        raise ProtocolError(
            f"a {envelope.message_type} envelope cannot answer a {request.metadata.message_type}"
        )
    return Message(_content(envelope), reply_to=request)


def message_to_envelope(message: Message, node_id: int) -> Envelope:
    """The envelope a message carries; ``node_id`` is the client it goes to or comes from.

    Raises
    ------
    ProtocolError
        If the message carries an error or lacks fedfm's records or round.
    """
    if message.has_error():
        raise ProtocolError(f"message carries an error: {message.error.reason}")
    content = message.content
    arrays, config = content.get(ARRAYS), content.get(CONFIG)
    if not isinstance(arrays, ArrayRecord) or not isinstance(config, ConfigRecord):
        raise ProtocolError(
            f"{message.metadata.message_type} message lacks the {ARRAYS!r} ArrayRecord or the "
            f"{CONFIG!r} ConfigRecord"
        )
    group_id = message.metadata.group_id
    if not group_id.isdigit():
        raise ProtocolError(f"message group id {group_id!r} is not a round number")
    return Envelope(
        message_type=message.metadata.message_type,
        node_id=node_id,
        round=int(group_id),
        arrays=from_array_record(arrays),
        config=dict(config),  # type: ignore[arg-type]  # scalars only, as sent
    )


# -- hold messages (keep-warm) --------------------------------------------------------------------
# A hold keeps a SuperNode busy while the server works out that node's next request: Flower's
# SuperNode sleeps a fixed 3 s whenever it asks for a message and finds none, so a node whose
# reply the server answers 0.5 s later would otherwise wait 3 s for it. A ClientApp answers a
# hold by waiting (at most MAX_HOLD_SECONDS) and replying with nothing; it touches no state.
HOLD_MESSAGE_TYPE = "query.fedfm_hold"
HOLD = "fedfm.hold"
MAX_HOLD_SECONDS = 30.0


def _hold_length(seconds: float) -> float:
    """``seconds`` as a float; :class:`ProtocolError` outside 0 to ``MAX_HOLD_SECONDS``, or NaN."""
    if not 0.0 <= seconds <= MAX_HOLD_SECONDS:
        raise ProtocolError(f"a hold lasts 0 to {MAX_HOLD_SECONDS:g} s, not {seconds!r}")
    return float(seconds)


def hold_message(node_id: int, seconds: float, *, ttl: float | None = None) -> Message:
    """A hold for ``node_id``: its ClientApp waits ``seconds`` before answering."""
    return Message(
        RecordDict({HOLD: ConfigRecord({"seconds": _hold_length(seconds)})}),
        dst_node_id=node_id,
        message_type=HOLD_MESSAGE_TYPE,
        ttl=ttl,
    )


def hold_seconds(message: Message) -> float:
    """How long the hold ``message`` asks its ClientApp to wait.

    Raises
    ------
    ProtocolError
        If the message is not a well-formed hold or asks for more than ``MAX_HOLD_SECONDS``.
    """
    record = message.content.get(HOLD) if message.has_content() else None
    seconds = record.get("seconds") if isinstance(record, ConfigRecord) else None
    if isinstance(seconds, bool) or not isinstance(seconds, float | int):
        raise ProtocolError(f"a {HOLD_MESSAGE_TYPE} message lacks its {HOLD!r} seconds")
    return _hold_length(seconds)
