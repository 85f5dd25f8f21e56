"""CENTAUR: random permutations plus 3-party secret sharing for private transformer inference.

Spec 004 (§2-§4, App. A-E): a model developer (P0) holds the weights Θ and permutations, a cloud
(P1) holds the permuted weights Θ' and computes the non-linear layers on permuted plaintext, a
client (P2) holds the input and deals correlated randomness; linear layers run on additive shares
over ``Z_{2^64}``. See ``docs/centaur.md``.

Modules: :mod:`~fedfm.protocols.centaur.model` (weights from transformers, the plaintext layer
loop, Θ'), :mod:`~fedfm.protocols.centaur.engine` (programs of share operations, the dealer),
:mod:`~fedfm.protocols.centaur.approximations` (the MPC approximations of the baseline),
:mod:`~fedfm.protocols.centaur.programs` (the forward pass per mode),
:mod:`~fedfm.protocols.centaur.provisioning` (the developer's offline step),
:mod:`~fedfm.protocols.centaur.local` (the same program without the runtime),
:mod:`~fedfm.protocols.centaur.protocol` (the declaration). Harness:
:mod:`fedfm.experiments.centaur_bench`, :mod:`fedfm.experiments.centaur_attacks`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfm.protocols.centaur.protocol import centaur, open_report, settings_from_config

_HOME = {
    "centaur": "protocol",
    "open_report": "protocol",
    "settings_from_config": "protocol",
}
__all__ = ["centaur", "open_report", "settings_from_config"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
