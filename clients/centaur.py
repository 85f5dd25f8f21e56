"""CENTAUR (:mod:`fedfm.protocols.centaur`) as a Flower ClientApp: the developer's, the cloud's or
the client's node."""

from fedfm.protocols.centaur import centaur
from fedfm_clients.runtime import make_client_app

app = make_client_app(centaur)
