"""The masked-sum example protocol (:mod:`fedfm.protocols.masked_sum`) as a Flower ServerApp."""

from fedfm.protocols.masked_sum import masked_sum
from fedfm_strategies.runtime import make_server_app

app = make_server_app(masked_sum)
