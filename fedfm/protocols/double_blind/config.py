"""Settings of a double-blind adaptation run, and the message types of the protocol."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fedfm.errors import ConfigError

# Message types (Flower form: category.action). One source of truth for both ends.
SETUP = "query.setup"
TRAIN_BLOCK = "train.block"
TRAIN_LOSS = "train.loss"
EVALUATE_BLOCK = "evaluate.block"
# Client-assisted refresh of masked ciphertexts in the middle of the server's evaluation (CKKS).
REFRESH = "query.refresh"

# App. C: with n samples per batch a curious client faces n! candidate permutations; below 16
# (16! ~ 2e13) the protocol refuses to run.
DEFAULT_MIN_BATCH_SIZE = 16
SERVER_ONLY_SETTINGS = ("seed", "permute")


@dataclass(frozen=True)
class DoubleBlindConfig:
    """What both roles agree on for a run (the server sends it to clients at setup).

    Parameters
    ----------
    rounds:
        Federated rounds.
    batch_size:
        Samples per batch ``n``; also the size of every permutation.
    batches_per_round:
        Batches each client contributes per round; all travel in the same messages, so round
        trips per round are ``L + 1`` whatever this is.
    rank, alpha:
        Adapter rank (0: linear probing, no adapter) and scale (Eq. 5).
    lr, momentum:
        The client's SGD on adapter and head: one step per round on the round's mean loss.
    min_batch_size:
        Smallest ``n`` accepted (App. C).
    permute:
        Debug switch: ``False`` sends block outputs unpermuted (for the extraction tests only).
    backend:
        Crypto backend name: ``simulate`` (plaintext stand-in) or ``ckks`` (TenSEAL).
    eval_fraction:
        Share of each client's data held out for evaluation.
    seed:
        Seeds the server's sampling and permutations and the adapter initialisation. The
        default ``None`` draws them from the operating system, which is what a deployment
        needs (anyone who knows the seed can recompute the permutations); experiments pass a
        seed to be reproducible.
    """

    rounds: int = 20
    batch_size: int = 16
    batches_per_round: int = 4
    rank: int = 8
    alpha: float = 1.0
    lr: float = 0.05
    momentum: float = 0.9
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE
    permute: bool = True
    backend: str = "simulate"
    eval_fraction: float = 0.2
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if self.batch_size < self.min_batch_size:
            raise ConfigError(
                f"batch size {self.batch_size} is below the minimum {self.min_batch_size}: "
                "smaller batches weaken the permutation protection (App. C)"
            )
        if self.batches_per_round < 1:
            raise ConfigError(f"batches_per_round must be >= 1, got {self.batches_per_round}")
        if self.rank < 0:
            raise ConfigError(f"adapter rank must be >= 0, got {self.rank}")
        if self.lr <= 0:
            raise ConfigError(f"learning rate must be > 0, got {self.lr}")
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    def to_config(self) -> dict[str, Any]:
        """All settings as plain values (``None`` seed as -1), for checkpoints and logs."""
        values = asdict(self)
        values["seed"] = -1 if self.seed is None else self.seed
        return values

    def client_settings(self) -> dict[str, Any]:
        """What clients receive at setup: everything but the seed and the permutation switch.

        The seed drives the server's permutations; a client that knew it could recompute them.
        """
        return {k: v for k, v in self.to_config().items() if k not in SERVER_ONLY_SETTINGS}

    @classmethod
    def from_config(cls, values: dict[str, Any]) -> DoubleBlindConfig:
        known = {key: values[key] for key in cls.__dataclass_fields__ if key in values}
        if known.get("seed") == -1:
            known["seed"] = None
        return cls(**known)
