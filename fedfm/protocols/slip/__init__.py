"""SLIP: SVD model decomposition and masked hybrid inference (spec 003); see ``docs/slip.md``.

A model owner splits chosen weight matrices ``W = W_C + W_D`` by SVD
(:mod:`~fedfm.protocols.slip.decomposition`): the trusted party Charlie keeps the top-``k``
singular part, the untrusted party David everything else. At inference Charlie sends David his
activations masked by one-time pads over the ring of integers modulo 2**64
(:mod:`~fedfm.protocols.slip.ring`, :mod:`~fedfm.protocols.slip.pads`), David returns
``W_D (a + r)``, Charlie removes ``W_D r`` (precomputed offline) and adds ``W_C a``
(:mod:`~fedfm.protocols.slip.hybrid`: transformers' modules, linear layers and attention
swapped in). :mod:`~fedfm.protocols.slip.protocol` declares it on the runtime.
Harness: :mod:`fedfm.experiments.slip_bench`, :mod:`fedfm.experiments.slip_figures`,
:mod:`fedfm.experiments.slip_attacks`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfm.protocols.slip.hybrid import Charlie, David, Decomposition, decompose
    from fedfm.protocols.slip.protocol import (
        Parties,
        open_report,
        provision,
        settings_from_config,
        slip,
    )

_HOME = {
    "Charlie": "hybrid",
    "David": "hybrid",
    "Decomposition": "hybrid",
    "decompose": "hybrid",
    "Parties": "protocol",
    "open_report": "protocol",
    "provision": "protocol",
    "settings_from_config": "protocol",
    "slip": "protocol",
}
__all__ = [
    "Charlie",
    "David",
    "Decomposition",
    "Parties",
    "decompose",
    "open_report",
    "provision",
    "settings_from_config",
    "slip",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
