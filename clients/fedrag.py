"""FedRAG (:mod:`fedfm.protocols.fedrag`) as a Flower ClientApp: a coordinator's, a context
owner's or a compute node's node."""

from fedfm.protocols.fedrag import fedrag
from fedfm_clients.runtime import make_client_app

app = make_client_app(fedrag)
