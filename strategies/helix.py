"""HELIX (:mod:`fedfm.protocols.helix`) as a Flower ServerApp: the relay between the parties."""

from fedfm.protocols.helix import helix
from fedfm_strategies.runtime import make_server_app

app = make_server_app(helix)
