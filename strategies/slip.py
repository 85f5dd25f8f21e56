"""SLIP (:mod:`fedfm.protocols.slip`) as a Flower ServerApp: the relay between Charlie and David."""

from fedfm.protocols.slip import slip
from fedfm_strategies.runtime import make_server_app

app = make_server_app(slip)
