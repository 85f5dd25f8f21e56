"""SLIP (:mod:`fedfm.protocols.slip`) as a Flower ClientApp: Charlie's (trusted) or David's
(untrusted) node."""

from fedfm.protocols.slip import slip
from fedfm_clients.runtime import make_client_app

app = make_client_app(slip)
