"""FedRAG's run config keys and defaults: one table (no heavy imports).

The protocol (:func:`fedfm.protocols.fedrag.fedrag`), the Flower app's TOML
(``simulations/fedrag/pyproject.toml``, checked by a test) and ``fedfm bench-fedrag`` read it.
"""

from __future__ import annotations

from fedfm.runtime.transport import ConfigValue

DEFAULTS: dict[str, ConfigValue] = {
    "owners": 2,  # context owners (>= 2)
    "compute-plan": "dedicated",  # "dedicated" (a node of its own) or "rotating" (3 nodes, §5.4)
    "stage": "generate",  # "generate" (segments given) or "rag" (retrieve, re-rank, generate)
    "attention": "scrambled",  # "scrambled" (§4), "distributed" (ablation), "secret-sharing"
    "scrambler": "structured",  # "structured" (Eq. 9), "dense" (App. A), "permutation" (VMA)
    "scaling-range": 2.0,  # r: scaling magnitudes log-uniform in [1/r, r] (§4.2)
    "max-new-tokens": 8,  # generated tokens
    "retrieval": "private",  # "private" (CKKS scores) or "faithful" (plaintext embedding, §5.1)
    "top-k": 4,  # candidates after retrieval (global)
    "top-m": 2,  # documents after re-ranking (global)
    "decoder": "llama_fedfm_tiny",  # an embedded decoder name, a folder or a hub name
    "decoder-cache": "runs/cache",  # where `fedfm train-llm` cached the embedded decoder
    "request": "0",  # the request's id: part of every key's purpose
}
