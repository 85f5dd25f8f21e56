"""Settings of a double-blind adaptation run, and the message types of the protocol."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fedfm.errors import ConfigError
from fedfm.protocols.double_blind.defaults import PROTOCOL
from fedfm.secagg import SecAggConfig

_DEFAULT = PROTOCOL  # the one table of defaults

# Message types (Flower form: category.action). One source of truth for both ends.
SETUP = "query.setup"
TRAIN_BLOCK = "train.block"
TRAIN_LOSS = "train.loss"
# The four stages of secure aggregation after training (the stage is in the message's config).
TRAIN_SECAGG = "train.secagg"
EVALUATE_BLOCK = "evaluate.block"
# A later evaluation on the outputs the client kept from its first one: the server's blocks are
# frozen, so their outputs on the held-out set never change; only the adapter and head do.
EVALUATE_CACHED = "evaluate.cached"
# Client-assisted refresh of masked ciphertexts in the middle of the server's evaluation (CKKS).
REFRESH = "query.refresh"
# Every message a data owner answers (its ClientApp registers one handler per type).
MESSAGE_TYPES = (
    SETUP,
    TRAIN_BLOCK,
    TRAIN_LOSS,
    TRAIN_SECAGG,
    EVALUATE_BLOCK,
    EVALUATE_CACHED,
    REFRESH,
)

# App. C: with n samples per batch a curious client faces n! candidate permutations; below 16
# (16! ~ 2e13) the protocol refuses to run.
DEFAULT_MIN_BATCH_SIZE = 16
# The permutation switch is the server's debug setting; the SecAgg parameters reach the client in
# the first SecAgg stage, which is their one source of truth. (The server's randomness is no
# setting at all: :class:`~fedfm.crypto.randomness.SecretStream`.)
SERVER_ONLY_SETTINGS = (
    "permute",
    "evaluate_every",
    "secagg_clipping_range",
    "secagg_bits",
    "secagg_neighbours",
    "secagg_threshold",
)
# An aggregate of one client is that client's update: secure aggregation needs two at least.
MIN_SECURE_AGGREGATE = 2


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
    lr_decay:
        App. D.2's schedule: the learning rate times 0.1 from 50% of the rounds and times 0.01
        from 80% (:data:`LR_MILESTONES`, :meth:`lr_factor`); full fine-tuning follows it too.
    min_batch_size:
        Smallest ``n`` accepted (App. C).
    permute:
        Debug switch: ``False`` sends block outputs unpermuted (for the extraction tests only).
    backend:
        Crypto backend name: ``simulate`` (plaintext stand-in) or ``ckks`` (TenSEAL).
    eval_fraction:
        Share of each client's data held out for evaluation.
    evaluate_every:
        Evaluate the global model every this many rounds (and after the last round): an
        encrypted evaluation costs as much as a round's training, so a long run may evaluate
        less often. The server's own schedule; clients never receive it.
    reveal:
        Which blocks' (permuted) outputs the client receives: ``all`` (the paper), ``every-other``
        (the last block and every second one before it), ``last-two``, ``last``, or 1-based block
        numbers such as ``"2,4"``. The server chains the other blocks on ciphertexts without the
        client ever seeing their outputs; the client's side adapter taps only the revealed ones.
        The last block is always revealed (the head reads it).
    secure_aggregation:
        The server learns only the weighted average of the clients' updates (SecAgg+,
        :mod:`fedfm.secagg`): a client's ``train.loss`` reply carries no parameters, the client
        keeps its update (new minus received adapter and head) and masks it in four
        ``train.secagg`` stages. ``False`` sends each client's parameters in the clear.
    secagg_clipping_range:
        ``c``: every value of an update (a difference of parameters) is clipped to ``[-c, c]``
        before quantization; see ``docs/secure_aggregation.md`` for the default's reasoning.
    secagg_bits:
        Quantization bits; each averaged value is within ``2c / (2**bits - 1)`` of the exact
        weighted average of the clipped updates.
    secagg_neighbours:
        SecAgg+ neighbours per client; 0 for the complete graph (Bonawitz et al.).
    secagg_threshold:
        Shares needed to rebuild a client's secrets; 0 for ``floor(k/2) + 1`` with ``k``
        neighbours.
    """

    rounds: int = _DEFAULT.rounds
    batch_size: int = _DEFAULT.batch_size
    batches_per_round: int = _DEFAULT.batches_per_round
    rank: int = _DEFAULT.rank
    alpha: float = _DEFAULT.alpha
    lr: float = _DEFAULT.lr
    momentum: float = _DEFAULT.momentum
    lr_decay: bool = _DEFAULT.lr_decay
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE
    permute: bool = True
    backend: str = _DEFAULT.backend
    eval_fraction: float = _DEFAULT.eval_fraction
    evaluate_every: int = _DEFAULT.evaluate_every
    reveal: str = _DEFAULT.reveal
    secure_aggregation: bool = _DEFAULT.secure_aggregation
    secagg_clipping_range: float = _DEFAULT.secagg_clipping_range
    secagg_bits: int = _DEFAULT.secagg_bits
    secagg_neighbours: int = _DEFAULT.secagg_neighbours
    secagg_threshold: int = _DEFAULT.secagg_threshold

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
        from fedfm.crypto import BACKENDS  # here: the crypto package imports TenSEAL

        if self.backend not in BACKENDS:
            raise ConfigError(
                f"unknown crypto backend {self.backend!r}; available: {sorted(BACKENDS)}"
            )
        _reveal_numbers(self.reveal)  # the spelling; the range is checked against the model
        if self.evaluate_every < 1:
            raise ConfigError(f"evaluate_every must be >= 1, got {self.evaluate_every}")
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        for name in ("secagg_neighbours", "secagg_threshold"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: automatic), got {getattr(self, name)}")
        self.secagg_config(MIN_SECURE_AGGREGATE)  # the SecAgg settings' own checks

    def evaluates(self, server_round: int) -> bool:
        """Whether the global model is evaluated after 1-based ``server_round``."""
        return server_round % self.evaluate_every == 0 or server_round == self.rounds

    def lr_factor(self, server_round: int) -> float:
        """The learning-rate multiplier in 1-based ``server_round`` (1.0 without ``lr_decay``)."""
        if not self.lr_decay:
            return 1.0
        done = (server_round - 1) / self.rounds
        return 0.1 ** sum(done >= milestone for milestone in LR_MILESTONES)

    def secagg_config(self, min_clients: int) -> SecAggConfig:
        """Secure aggregation's settings for a round that needs ``min_clients`` clients.

        A client's weight is its number of training examples in the round, at most
        ``batches_per_round * batch_size``; that is the largest weight clients may claim.
        """
        return SecAggConfig(
            clipping_range=self.secagg_clipping_range,
            quantization_bits=self.secagg_bits,
            max_weight=self.batches_per_round * self.batch_size,
            num_neighbours=self.secagg_neighbours or None,
            reconstruction_threshold=self.secagg_threshold or None,
            min_clients=max(min_clients, MIN_SECURE_AGGREGATE),
        )

    def to_config(self) -> dict[str, Any]:
        """All settings as plain values, for checkpoints and logs."""
        return asdict(self)

    def client_settings(self) -> dict[str, Any]:
        """What clients receive at setup: everything but :data:`SERVER_ONLY_SETTINGS`.

        The SecAgg parameters come with the first SecAgg stage instead.
        """
        return {k: v for k, v in self.to_config().items() if k not in SERVER_ONLY_SETTINGS}

    @classmethod
    def from_config(cls, values: dict[str, Any]) -> DoubleBlindConfig:
        known = {key: values[key] for key in cls.__dataclass_fields__ if key in values}
        return cls(**known)


REVEAL_CHOICES = ("all", "every-other", "last-two", "last")
# Fractions of the rounds after which ``lr_decay`` divides the learning rate by 10 (App. D.2).
LR_MILESTONES = (0.5, 0.8)


def revealed_blocks(reveal: str, num_blocks: int) -> list[int]:
    """The 1-based blocks whose outputs the client receives, for a model of ``num_blocks``."""
    last = num_blocks
    if reveal == "all":
        return list(range(1, last + 1))
    if reveal == "every-other":
        return [b for b in range(1, last + 1) if (last - b) % 2 == 0]
    if reveal == "last-two":
        return [b for b in (last - 1, last) if b >= 1]
    if reveal == "last":
        return [last]
    blocks = _reveal_numbers(reveal)
    if blocks[0] < 1 or blocks[-1] != last:
        raise ConfigError(
            f"revealed blocks {blocks} must lie in 1..{last} and include the last block {last}"
        )
    return blocks


def _reveal_numbers(reveal: str) -> list[int]:
    """Block numbers of a ``reveal`` setting that lists them (``[]`` for a named choice)."""
    if reveal in REVEAL_CHOICES:
        return []
    try:
        return sorted({int(part) for part in reveal.split(",")})
    except ValueError:
        raise ConfigError(
            f"reveal must be one of {REVEAL_CHOICES} or block numbers like '2,4', got {reveal!r}"
        ) from None
