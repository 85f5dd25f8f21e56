"""The one table of double-blind adaptation's defaults (no heavy imports: the CLI reads it).

Every consumer takes its defaults from here: :class:`~fedfm.protocols.double_blind.config.
DoubleBlindConfig` and :class:`~fedfm.protocols.double_blind.runner.Federation` (field
defaults), the Flower apps' run config (:data:`fedfm.protocols.double_blind.settings.DEFAULTS`
maps these names to kebab-case keys; ``simulations/double_blind/pyproject.toml`` is tested
against it) and the ``fedfm`` command's protocol options.
"""

from __future__ import annotations

from typing import NamedTuple


class ProtocolDefaults(NamedTuple):
    """Defaults of the :class:`DoubleBlindConfig` fields a user sets."""

    rounds: int = 20
    batch_size: int = 16
    batches_per_round: int = 4
    rank: int = 8
    alpha: float = 1.0
    lr: float = 0.05
    momentum: float = 0.9
    lr_decay: bool = False
    backend: str = "simulate"
    eval_fraction: float = 0.2
    evaluate_every: int = 1
    reveal: str = "last"
    secure_aggregation: bool = True
    secagg_clipping_range: float = 1.0
    secagg_bits: int = 24
    secagg_neighbours: int = 0
    secagg_threshold: int = 0


class FederationDefaults(NamedTuple):
    """Defaults of :class:`Federation`: how the clients' pool is split (``seed`` is public: it
    seeds the data split, the partition and the evaluation order, never a party's secret)."""

    num_clients: int = 5
    scheme: str = "dirichlet"
    alpha: float = 1.0
    seed: int = 0


PROTOCOL = ProtocolDefaults()
FEDERATION = FederationDefaults()
