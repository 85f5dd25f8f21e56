"""HELIX (:mod:`fedfm.helix`) as a Flower ClientApp: the provider's or a client's node."""

from fedfm.helix import helix
from fedfm_clients.runtime import make_client_app

app = make_client_app(helix)
