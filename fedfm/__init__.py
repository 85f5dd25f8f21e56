"""fedfm: double-blind federated adaptation and private inference of foundation models on Flower.

The library holds the protocol logic (models, approximations, crypto backends, protocol state
machines); the Flower adapters live in ``fedfm_strategies`` (server side) and ``fedfm_clients``
(client side).
"""

__version__ = "0.1.0"
