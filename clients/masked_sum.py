"""The masked-sum example protocol (:mod:`fedfm.protocols.masked_sum`) as a Flower ClientApp."""

from fedfm.protocols.masked_sum import masked_sum
from fedfm_clients.runtime import make_client_app

app = make_client_app(masked_sum)
