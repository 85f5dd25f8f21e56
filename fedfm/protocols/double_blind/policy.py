"""A data owner's privacy policy: what it accepts from the server, set by the data owner alone.

The server's setup message proposes the run (backend, secure aggregation, blocks revealed,
rounds); the data owner checks it against its own policy and refuses, naming the rule, a run that
asks for less protection than it requires. The policy comes from the data owner's node config
(Flower: ``--node-config`` of its SuperNode, or ``FEDFM_NODE_CONFIG`` in its environment for
simulated nodes; see :func:`fedfm.flower.apps.node_config`) or, in one process, from the client
settings the caller passes; never from the run config, which the server hands out.

================================  =========  =================================================
node config key                   default    meaning
================================  =========  =================================================
``allow-plaintext``               false      accept the ``simulate`` backend (images leave in
                                             plaintext): an explicit local opt-in for tests
                                             and simulations
``require-secure-aggregation``    true       refuse to send an update outside SecAgg+
``min-aggregate``                 2          fewest updates (its own included) in any
                                             aggregate the data owner contributes to
``max-revealed-blocks``           0          most block outputs decrypted per batch (0: any)
``max-rounds``                    0          most rounds trained or evaluated in (0: any)
``backends``                      ""         the backends accepted, comma-separated (empty:
                                             any encrypted one, and ``simulate`` if
                                             ``allow-plaintext``); e.g. ``ckks`` refuses
                                             ``ckks-8192``, whose refresh budget is 2^-30 per
                                             run instead of 2^-40 (``docs/ckks.md``)
``hide-text-lengths``             false      a text model: upload all-true key masks, so the
                                             server learns no text's length (the model then
                                             attends to padding as to text: its outputs, and
                                             the accuracy, change)
================================  =========  =================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from fedfm.errors import ConfigError, ProtocolError

PLAINTEXT_BACKENDS = frozenset({"simulate"})
# An aggregate of one update is that update: no policy may ask for less than two.
SMALLEST_AGGREGATE = 2


@dataclass(frozen=True)
class DataOwnerPolicy:
    """What a data owner accepts; see the module docstring for the node config keys."""

    allow_plaintext: bool = False
    require_secure_aggregation: bool = True
    min_aggregate: int = SMALLEST_AGGREGATE
    max_revealed_blocks: int = 0
    max_rounds: int = 0
    backends: str = ""
    hide_text_lengths: bool = False

    @property
    def accepted_backends(self) -> frozenset[str]:
        """The backend names of ``backends`` (empty: no restriction beyond plaintext)."""
        return frozenset(name.strip() for name in self.backends.split(",") if name.strip())

    def __post_init__(self) -> None:
        if self.min_aggregate < SMALLEST_AGGREGATE:
            raise ConfigError(
                f"min-aggregate must be >= {SMALLEST_AGGREGATE} (an aggregate of one update is "
                f"that update), got {self.min_aggregate}"
            )
        for name in ("max_revealed_blocks", "max_rounds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{_kebab(name)} must be >= 0 (0: no limit)")

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> DataOwnerPolicy:
        """The policy in a node config (keys of the module docstring; others are ignored)."""
        values: dict[str, Any] = {}
        for field in fields(cls):
            key = _kebab(field.name)
            if key not in node_config:
                continue
            value = node_config[key]
            default = getattr(cls, field.name)
            if isinstance(default, bool):
                value = _boolean(key, value)
            elif isinstance(default, str):
                if not isinstance(value, str):
                    raise ConfigError(f"node config {key!r} must be a string, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"node config {key!r} must be an integer, got {value!r}")
            values[field.name] = value
        return cls(**values)

    def check_setup(self, *, backend: str, secure_aggregation: bool, rounds: int) -> None:
        """Refuse a run whose settings break this policy.

        Raises
        ------
        ProtocolError
            Naming the rule and the node config key that would allow the run.
        """
        if backend in PLAINTEXT_BACKENDS and not self.allow_plaintext:
            raise ProtocolError(
                f"the server asks for backend {backend!r}, which sends this data owner's images "
                "in plaintext; refused by policy (node config allow-plaintext=true to allow it)"
            )
        accepted = self.accepted_backends
        if accepted and backend not in accepted:
            raise ProtocolError(
                f"the server asks for backend {backend!r}; this data owner's policy accepts "
                f"only {sorted(accepted)} (node config backends)"
            )
        if self.require_secure_aggregation and not secure_aggregation:
            raise ProtocolError(
                "the server asks for updates outside secure aggregation; refused by policy "
                "(node config require-secure-aggregation=false to allow it)"
            )
        if self.max_rounds and rounds > self.max_rounds:
            raise ProtocolError(
                f"the server plans {rounds} rounds, more than the policy's "
                f"max-rounds={self.max_rounds}"
            )

    def check_blocks(self, revealed_blocks: int) -> None:
        """Refuse a round that reveals more block outputs than ``max-revealed-blocks``."""
        if self.max_revealed_blocks and revealed_blocks > self.max_revealed_blocks:
            raise ProtocolError(
                f"the server reveals {revealed_blocks} block outputs per batch, more than the "
                f"policy's max-revealed-blocks={self.max_revealed_blocks}"
            )

    def check_round(self, server_round: int) -> None:
        """Refuse a training or evaluation round past ``max-rounds`` (an evaluation on kept
        outputs costs the server nothing, so the policy bounds how many it may ask for)."""
        if self.max_rounds and server_round > self.max_rounds:
            raise ProtocolError(
                f"round {server_round} is past the policy's max-rounds={self.max_rounds}"
            )

    def check_aggregate(self, contributors: int) -> None:
        """Refuse to unmask into an aggregate of fewer than ``min-aggregate`` updates."""
        if contributors < self.min_aggregate:
            raise ProtocolError(
                f"the aggregate would hold {contributors} updates, fewer than the policy's "
                f"min-aggregate={self.min_aggregate}"
            )


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _boolean(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"node config {key!r} must be true or false, got {value!r}")
