"""Double-blind federated adaptation of a ViT (spec ``001``): roles, messages, driver, runner."""

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
