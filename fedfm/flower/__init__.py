"""fedfm on Flower's app layer: the one codec, transport and app factory of every protocol.

This is the only package of the library that imports Flower's app layer (``flwr.app``,
``flwr.clientapp``, ``flwr.serverapp``); protocols never import it (``tests/test_packaging.py``
checks both). The adapters use it: ``strategies/`` builds ServerApps with
:func:`~fedfm.flower.apps.make_server_app` over a :class:`~fedfm.flower.transport.FlowerTransport`,
``clients/`` builds ClientApps with :func:`~fedfm.flower.apps.make_client_app` around a
protocol's node role; neither imports the other.

Modules: :mod:`~fedfm.flower.codec` (envelopes as Flower messages, role states as
``context.state`` records), :mod:`~fedfm.flower.transport` (a transport over a Flower ``Grid``),
:mod:`~fedfm.flower.apps` (the ClientApp and ServerApp factories).
"""
