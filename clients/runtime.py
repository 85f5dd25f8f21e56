"""Any protocol of the fedfm runtime as a Flower ``ClientApp``.

:func:`make_client_app` answers the runtime's two message types (``query.runtime_hello`` and
``query.runtime_step``) with :class:`~fedfm.runtime.NodeRuntime`, through the one ClientApp
factory (:func:`fedfm.flower.apps.make_client_app`): the node's settings (roles, identity key,
pins, inputs) come from its own node config only, never from the run config the relay hands
out (see :mod:`fedfm.runtime.settings`); its state (the session's private key, sequence numbers, role
state) lives in ``context.state`` and the identity key in the file the node config names; they
never leave the node. A request the node refuses (a tampered, replayed or misaddressed frame, a
substituted key) gets an error reply naming the problem and leaves ``context.state`` as it was.
"""

from __future__ import annotations

from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp

from fedfm.flower import codec
from fedfm.flower.apps import make_client_app as make_app
from fedfm.flower.apps import node_config
from fedfm.runtime import NodeRuntime, NodeState, ProtocolFactory, node_settings, split_run_config
from fedfm.runtime.messages import HELLO, STEP

STATE_NAME = "fedfm.runtime"  # context.state records fedfm.runtime.arrays, fedfm.runtime.state


def node_runtime(build_protocol: ProtocolFactory, context: Context) -> NodeRuntime:
    """This node's runtime: the protocol the run config describes, the roles and keys its own
    node config gives it."""
    _, protocol_config = split_run_config(context.run_config)
    settings = node_settings(node_config(context))
    return NodeRuntime(
        build_protocol(protocol_config),
        roles=settings.roles,
        identity=settings.identity(),
        pins=settings.pins,
        inputs=settings.load_inputs,
    )


def make_client_app(build_protocol: ProtocolFactory) -> ClientApp:
    """A ClientApp running the protocol ``build_protocol`` makes from the run config."""
    return make_app(
        lambda context: node_runtime(build_protocol, context),
        NodeState,
        message_types=(HELLO, STEP),
        state_name=STATE_NAME,
    )


def save_state(state: NodeState, record_dict: RecordDict) -> None:
    """Write a node's ``state`` into ``record_dict`` (a ``context.state``), as the app does."""
    codec.save_state(state, record_dict, codec.state_records(STATE_NAME))


def load_state(record_dict: RecordDict) -> NodeState:
    """The state the app keeps in ``record_dict``; a fresh node's state if there is none."""
    return codec.load_state(NodeState, record_dict, codec.state_records(STATE_NAME))
