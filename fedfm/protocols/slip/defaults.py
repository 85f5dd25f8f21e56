"""SLIP's run config keys and defaults: one table (no heavy imports).

The protocol (:func:`fedfm.protocols.slip.slip`), the Flower app's TOML
(``simulations/slip/pyproject.toml``, checked by a test) and ``fedfm bench-slip`` read it.
"""

from __future__ import annotations

from fedfm.runtime.transport import ConfigValue

DEFAULTS: dict[str, ConfigValue] = {
    "model": "llama_fedfm_tiny",  # an embedded decoder name, a folder or a hub name
    "decoder-cache": "runs/cache",  # where `fedfm train-llm` cached the embedded decoder
    "blocks": "first-last",  # split blocks: first-last, first, last, all, none or "0,3"
    "layers": "all",  # split layer types in those blocks ("all" or e.g. "mlp.up_proj")
    "rank": 8,  # k: singular components Charlie keeps per split layer (k >= 2, App. A.1)
    "composition": "safe",  # "safe" (all masked), "faithful" (Fig. 10), "unmasked" (Fig. 6)
    "attention": "single-step",  # "single-step" or "double-step" (Fig. 11)
}
