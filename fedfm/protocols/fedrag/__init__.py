"""FedRAG: federated retrieval, re-ranking and generation with scrambled distributed attention.

Institutions (context owners) hold private documents; a coordinator holds a private query. They
answer the query with a decoder LLM over the union of their documents: each attention between
one party's queries and another's keys and values runs on a compute node that sees them only
scrambled (Hadamard, permutations, random scalings; Eq. 9) and token-permuted, and the inquirer
merges the returned outputs and log-sum-exps with its local attention (online softmax). Spec 002
(§3-§7, App. A, E); see ``docs/fedrag.md``.

Modules: :mod:`~fedfm.protocols.fedrag.scrambler` and :mod:`~fedfm.protocols.fedrag.attention`
(the maths), :mod:`~fedfm.protocols.fedrag.decoder` (transformers' layers, attention swapped in),
:mod:`~fedfm.protocols.fedrag.plan` (roles, §5.4), :mod:`~fedfm.protocols.fedrag.generation`
(§5.3), :mod:`~fedfm.protocols.fedrag.retrieval` (§5.1, CKKS scores),
:mod:`~fedfm.protocols.fedrag.reranking` (§5.2), :mod:`~fedfm.protocols.fedrag.secret_sharing`
(the PermLLM-style baseline), :mod:`~fedfm.protocols.fedrag.protocol` (the declaration).
Harness: :mod:`fedfm.experiments.fedrag_bench`, :mod:`fedfm.experiments.fedrag_attacks`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfm.protocols.fedrag.plan import COORDINATOR, RolePlan, owner_role
    from fedfm.protocols.fedrag.protocol import fedrag, open_report, settings_from_config

_HOME = {
    "COORDINATOR": "plan",
    "RolePlan": "plan",
    "owner_role": "plan",
    "fedrag": "protocol",
    "open_report": "protocol",
    "settings_from_config": "protocol",
}
__all__ = [
    "COORDINATOR",
    "RolePlan",
    "fedrag",
    "open_report",
    "owner_role",
    "settings_from_config",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
