"""FedRAG (:mod:`fedfm.protocols.fedrag`) as a Flower ServerApp: the relay between the parties."""

from fedfm.protocols.fedrag import fedrag
from fedfm_strategies.runtime import make_server_app

app = make_server_app(fedrag)
