"""The data owner's role of double-blind adaptation as a Flower ``ClientApp``.

Every protocol message (``query.setup``, ``train.block``, ``train.loss``, ``train.secagg``,
``evaluate.block``, ``query.refresh``) goes through the one ClientApp factory
(:func:`fedfm.flower.apps.make_client_app`): decode the message into an envelope, restore the
client's state from ``context.state``, let :class:`~fedfm.protocols.double_blind.DoubleBlindClient`
answer, save the new state and reply.
The secret key is part of that state and never leaves ``context.state``; so are, between the
SecAgg stages, the client's update and its SecAgg secrets. A message the protocol refuses gets an
error reply and leaves ``context.state`` as it was.

With ``site-dir`` in its node config, a data owner answers every message in its long-lived site
process instead (``fedfm site``, :mod:`fedfm.runtime.site`): this module imports nothing
heavy, and the role, keys and data stay in that process's memory.

The client's data: partition ``partition-id`` of ``num-partitions`` (node config; simulation
sets both) of the clients' pool, split exactly as the in-process runner splits it for client
``partition-id``, with the dataset settings of the run config.

The data owner's SecAgg identity and pins come from its node config only (``identity-key``,
``secagg-pins``, ``secagg-mode``; in simulation the folder ``secagg-identity-dir`` names):
:func:`fedfm.protocols.double_blind.identities.data_owner_key_authentication`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flwr.app import Context, RecordDict

from fedfm.flower import codec
from fedfm.flower.apps import make_client_app, node_config
from fedfm.protocols.double_blind.config import MESSAGE_TYPES

if TYPE_CHECKING:  # torch and the crypto backends load with the role, not with this module
    from fedfm.protocols.double_blind.client import ClientState, DoubleBlindClient

STATE_NAME = "fedfm.double_blind"  # context.state records <STATE_NAME>.arrays and .state


def client_role(context: Context) -> DoubleBlindClient:
    """The client role of this node: its partition of the pool and its own privacy policy.

    The policy (which backends it accepts, whether secure aggregation is required, ...) comes
    from the node config (:class:`~fedfm.protocols.double_blind.policy.DataOwnerPolicy`), never
    from the run config; the backend is the one the server's setup names, if the policy
    accepts it (:func:`fedfm.protocols.double_blind.node.data_owner_role`).
    """
    from fedfm.protocols.double_blind.node import data_owner_role

    return data_owner_role(context.run_config, node_config(context))


def state_type() -> type[ClientState]:
    """The client's state type (imported when a message is answered here, not at load)."""
    from fedfm.protocols.double_blind.client import ClientState

    return ClientState


def save_state(state: ClientState, record_dict: RecordDict) -> None:
    """Write a client's ``state`` into ``record_dict`` (a ``context.state``), as the app does."""
    codec.save_state(state, record_dict, codec.state_records(STATE_NAME))


def load_state(record_dict: RecordDict) -> ClientState:
    """The state the app keeps in ``record_dict``; a new client's state if there is none."""
    return codec.load_state(state_type(), record_dict, codec.state_records(STATE_NAME))


# A site's node config may name `site-dir`: then every message goes to the data owner's
# long-lived site process (`fedfm site`), which keeps the role, keys and data in memory.
app = make_client_app(
    client_role,
    state_type,
    message_types=MESSAGE_TYPES,
    state_name=STATE_NAME,
)
