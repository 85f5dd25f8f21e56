"""CENTAUR's run config keys and defaults: one table (no heavy imports).

The protocol (:func:`fedfm.protocols.centaur.centaur`), the Flower app's TOML
(``simulations/centaur/pyproject.toml``, checked by a test) and ``fedfm bench-centaur`` read it.
"""

from __future__ import annotations

from fedfm.runtime.transport import ConfigValue

DEFAULTS: dict[str, ConfigValue] = {
    "mode": "faithful",  # "faithful" (the seed), "hardened", "full-sharing" (the baseline)
    "fraction-bits": 16,  # fixed-point fractional bits of the 2^64 ring
    "max-new-tokens": 4,  # llama: greedy tokens (one forward pass each); bert: ignored (1 pass)
    "model-id": "",  # the provisioned model this run is for (its fingerprint); required
    "architecture": "",  # the model's public shape (JSON of Architecture); required
    "request": "0",  # the request's id: part of every dealt value's purpose and message tag
}
