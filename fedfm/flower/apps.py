"""One ClientApp factory and one ServerApp factory for every fedfm protocol.

A protocol's client side is a node role (:class:`~fedfm.runtime.transport.NodeRole`: answer a
request from the state the node kept) and a state type with ``to_records``/``from_records``.
:func:`make_client_app` turns the two into a Flower ``ClientApp``: decode the message into an
envelope, load the state from ``context.state``, let the role answer, save the new state and
reply. A request the role refuses (a :class:`~fedfm.errors.FedfmError`) gets an error reply that
names the problem and leaves ``context.state`` as it was, except a
:class:`~fedfm.errors.ProtocolAbort`, whose new state (the role leaving the run) is saved. On
the Deployment Engine every message runs in a fresh ``flwr-clientapp`` process, so everything a
node keeps between messages (keys, sequence numbers, the stage) lives in ``context.state`` and
never leaves the node.

A protocol's server side is one function of the grid and the run config;
:func:`make_server_app` makes it the ServerApp's entry point.
"""

from __future__ import annotations

import os
import shlex
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, cast

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from fedfm.errors import ConfigError, FedfmError, ProtocolAbort
from fedfm.flower.codec import (
    HOLD_MESSAGE_TYPE,
    envelope_to_reply,
    hold_seconds,
    load_state,
    message_to_envelope,
    save_state,
    state_records,
)
from fedfm.runtime import site
from fedfm.runtime.transport import NodeRole, StateT

RoleOf = Callable[[Context], NodeRole[StateT]]
# The node config key naming the data owner's site folder (``fedfm site --dir``).
SITE_DIR = "site-dir"
# How long a ClientApp waits for its site's answer (node config ``site-timeout``, seconds): a
# site that hangs must not hold the message longer than the server waits for it.
SITE_TIMEOUT = 3600.0

# A node's own settings for nodes that Flower starts without a ``--node-config`` (simulation):
# ``key=value`` pairs in the environment of the process that runs the ClientApp, i.e. the
# operator's, never the run config the server hands out.
NODE_CONFIG_ENV = "FEDFM_NODE_CONFIG"


def node_config(context: Context) -> dict[str, Any]:
    """This node's config: ``context.node_config`` over the pairs in ``$FEDFM_NODE_CONFIG``.

    The SuperNode's ``--node-config`` wins; the environment fills in what it lacks, so the
    simulated nodes of one operator (which all share the same environment) can carry the
    settings a real site would put on its SuperNode's command line.

    Raises
    ------
    ConfigError
        If ``$FEDFM_NODE_CONFIG`` is not ``key=value`` pairs.
    """
    return {**parse_node_config(os.environ.get(NODE_CONFIG_ENV, "")), **context.node_config}


def parse_node_config(text: str) -> dict[str, Any]:
    """``key=value`` pairs separated by spaces (Flower's ``--node-config`` syntax: TOML values,
    bare words taken as strings)."""
    values: dict[str, Any] = {}
    for item in shlex.split(text):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"${NODE_CONFIG_ENV}: {item!r} is not key=value")
        try:
            values[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = raw
    return values


def log_info(line: str) -> None:
    """A progress line through Flower's logger (what the apps print by default)."""
    log(INFO, line)


def _answer_at_site(message: Message, context: Context, folder: str) -> Message:
    """``message`` answered by the site process in ``folder`` (:mod:`fedfm.runtime.site`)."""
    own = node_config(context)
    envelope = message_to_envelope(message, message.metadata.dst_node_id)
    reply = site.forward(
        Path(folder),
        run_id=context.run_id,
        run_config=dict(context.run_config),
        envelope=envelope,
        timeout=float(own.get("site-timeout", SITE_TIMEOUT)),
    )
    return envelope_to_reply(reply, message)


def answer_hold(message: Message, context: Context) -> Message:
    """A keep-warm hold (:data:`~fedfm.flower.codec.HOLD_MESSAGE_TYPE`): wait as asked (at most
    ``MAX_HOLD_SECONDS``), then reply with nothing. No state is read or written and no site
    process is asked: a hold only keeps the SuperNode from its idle sleep."""
    del context  # a hold touches no state
    try:
        seconds = hold_seconds(message)
    except FedfmError as error:
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(error)), reply_to=message)
    time.sleep(seconds)
    return Message(RecordDict(), reply_to=message)


def make_client_app(
    role_of: RoleOf[StateT],
    state_type: type[StateT] | Callable[[], type[StateT]],
    *,
    message_types: Iterable[str],
    state_name: str,
) -> ClientApp:
    """A ClientApp answering ``message_types`` with the role ``role_of(context)`` gives.

    If the node config names a site folder (``site-dir``), the ClientApp only forwards each
    message to the data owner's site process there (``fedfm site``), which holds the role
    and its state; ``role_of`` and ``state_type`` are then not used in this process.

    Parameters
    ----------
    role_of:
        This node's role, built from its context (run config, node config). Called for every
        message: a role should be cheap to build or cache what is expensive.
    state_type:
        The role's state (``state_type()`` is a new node's state), or a function returning it
        (so that a module defining the app need not import the state's heavy module).
    message_types:
        Every message type the role answers (``<train|evaluate|query>.<action>``).
    state_name:
        The prefix of the two ``context.state`` records that keep the state.
    """
    names = state_records(state_name)

    def resolved_state_type() -> type[StateT]:
        if isinstance(state_type, type):
            return state_type
        return state_type()

    def handle(message: Message, context: Context) -> Message:
        try:
            folder = node_config(context).get(SITE_DIR)
            if folder:
                return _answer_at_site(message, context, str(folder))
            envelope = message_to_envelope(message, message.metadata.dst_node_id)
            state = load_state(resolved_state_type(), context.state, names)
            reply, new_state = role_of(context).handle(envelope, state)
            answer = envelope_to_reply(reply, message)
        except FedfmError as error:
            if isinstance(error, ProtocolAbort):  # the role leaves: keep the state it left in
                save_state(cast(StateT, error.state), context.state, names)
            reason = f"{type(error).__name__}: {error}"
            log(WARNING, "[fedfm] refused %s: %s", message.metadata.message_type, reason)
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)
        save_state(new_state, context.state, names)
        return answer

    app = ClientApp()
    register = {"train": app.train, "evaluate": app.evaluate, "query": app.query}
    message_types = list(message_types)
    if HOLD_MESSAGE_TYPE in message_types:
        raise ConfigError(f"{HOLD_MESSAGE_TYPE} is fedfm's keep-warm message, not a role's")
    register["query"](HOLD_MESSAGE_TYPE.partition(".")[2])(answer_hold)
    for message_type in message_types:
        category, _, action = message_type.partition(".")
        if action:
            register[category](action)(handle)
        else:
            register[category]()(handle)
    return app


def make_server_app(run: Callable[[Grid, Mapping[str, Any]], object]) -> ServerApp:
    """A ServerApp whose entry point is ``run(grid, context.run_config)``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run(grid, context.run_config)

    return app
