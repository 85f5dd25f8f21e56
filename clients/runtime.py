"""Any protocol of the fedfm runtime as a Flower ``ClientApp``.

:func:`make_client_app` answers the runtime's two message types (``query.runtime_hello`` and
``query.runtime_step``) with :class:`~fedfm.runtime.NodeRuntime`: decode the message into an
envelope, read the node's settings (roles, identity key, pins, inputs; node config first, then
run config, see :mod:`fedfm.runtime.settings`), restore the node's state from
``context.state``, answer, save the new state and reply. On the Deployment Engine every message
runs in a fresh ``flwr-clientapp`` process, so the session's private key, sequence numbers and
role state live in ``context.state``, and the identity key in the file node config names; they
never leave the node. A request the node refuses (a tampered, replayed or misaddressed frame, a
substituted key) gets an error reply naming the problem and leaves ``context.state`` as it was.
"""

from __future__ import annotations

from logging import WARNING

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from fedfm.errors import FedfmError
from fedfm.runtime import NodeRuntime, NodeState, ProtocolFactory, node_settings, split_run_config
from fedfm.runtime.messages import HELLO, STEP
from fedfm_clients.codec import (
    envelope_to_reply,
    load_records,
    message_to_envelope,
    save_records,
)

STATE_RECORDS = ("fedfm.runtime.arrays", "fedfm.runtime.state")  # context.state: arrays, config


def save_state(state: NodeState, record_dict: RecordDict) -> None:
    """Write ``state`` into ``record_dict`` (a ``context.state``), replacing the previous one."""
    save_records(record_dict, STATE_RECORDS, *state.to_records())


def load_state(record_dict: RecordDict) -> NodeState:
    """The state saved by :func:`save_state`; a fresh node's state if there is none."""
    records = load_records(record_dict, STATE_RECORDS)
    return NodeState() if records is None else NodeState.from_records(*records)


def node_runtime(build_protocol: ProtocolFactory, context: Context) -> NodeRuntime:
    """This node's runtime: the protocol the run config describes, the roles and keys its
    node config (or the run config) gives it."""
    _, protocol_config = split_run_config(context.run_config)
    settings = node_settings(context.node_config, context.run_config)
    return NodeRuntime(
        build_protocol(protocol_config),
        roles=settings.roles,
        identity=settings.identity(),
        pins=settings.pins,
        inputs=settings.load_inputs,
    )


def make_client_app(build_protocol: ProtocolFactory) -> ClientApp:
    """A ClientApp running the protocol ``build_protocol`` makes from the run config."""

    def handle(message: Message, context: Context) -> Message:
        try:
            envelope = message_to_envelope(message, message.metadata.dst_node_id)
            runtime = node_runtime(build_protocol, context)
            reply, state = runtime.handle(envelope, load_state(context.state))
            answer = envelope_to_reply(reply, message)
        except FedfmError as error:
            reason = f"{type(error).__name__}: {error}"
            log(WARNING, "[fedfm] refused %s: %s", message.metadata.message_type, reason)
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)
        save_state(state, context.state)
        return answer

    app = ClientApp()
    for message_type in (HELLO, STEP):
        app.query(message_type.partition(".")[2])(handle)
    return app
