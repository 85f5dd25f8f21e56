"""HELIX (:mod:`fedfm.protocols.helix`) as a Flower ClientApp: the provider's or a client's node."""

from fedfm.protocols.helix import helix
from fedfm_clients.runtime import make_client_app

app = make_client_app(helix)
