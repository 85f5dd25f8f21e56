"""HELIX (:mod:`fedfm.helix`) as a Flower ServerApp: the relay between provider and clients."""

from fedfm.helix import helix
from fedfm_strategies.runtime import make_server_app

app = make_server_app(helix)
