"""CENTAUR (:mod:`fedfm.protocols.centaur`) as a Flower ServerApp: the relay between the parties."""

from fedfm.protocols.centaur import centaur
from fedfm_strategies.runtime import make_server_app

app = make_server_app(centaur)
