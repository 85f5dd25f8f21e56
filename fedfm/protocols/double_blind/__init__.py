"""Double-blind federated adaptation of a ViT (spec ``001``): roles, messages, driver, runner.

The names below load on first use (PEP 562), so that the light modules of this package (its
:mod:`~fedfm.protocols.double_blind.defaults`, read by the ``fedfm`` command to build its
options) do not import torch and TenSEAL.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfm.protocols.double_blind.adapter import SideAdapterHead
    from fedfm.protocols.double_blind.client import ClientData, ClientState, DoubleBlindClient
    from fedfm.protocols.double_blind.config import DoubleBlindConfig
    from fedfm.protocols.double_blind.driver import (
        Aggregator,
        RoundRecord,
        SecureAggregate,
        WeightedAverage,
        run_double_blind,
    )
    from fedfm.protocols.double_blind.server import (
        ClientUpdate,
        DoubleBlindServer,
        EvaluationResult,
        balanced_accuracy,
    )

_HOME = {
    "SideAdapterHead": "adapter",
    "ClientData": "client",
    "ClientState": "client",
    "DoubleBlindClient": "client",
    "DoubleBlindConfig": "config",
    "Aggregator": "driver",
    "RoundRecord": "driver",
    "SecureAggregate": "driver",
    "WeightedAverage": "driver",
    "run_double_blind": "driver",
    "ClientUpdate": "server",
    "DoubleBlindServer": "server",
    "EvaluationResult": "server",
    "balanced_accuracy": "server",
}
__all__ = [
    "Aggregator",
    "ClientData",
    "ClientState",
    "ClientUpdate",
    "DoubleBlindClient",
    "DoubleBlindConfig",
    "DoubleBlindServer",
    "EvaluationResult",
    "RoundRecord",
    "SecureAggregate",
    "SideAdapterHead",
    "WeightedAverage",
    "balanced_accuracy",
    "run_double_blind",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
