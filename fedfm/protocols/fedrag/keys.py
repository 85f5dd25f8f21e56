"""Key sets in a role's state, and the runtime's pair randomness as :class:`PairRandomness`.

An inquirer derives a pair's key set for a layer once (claimed in its :class:`KeyLedger`) and
keeps it in its role state for the later tokens of the request, which reuse the layer's ``S``
by design (the compute node already holds the keys scrambled under it); a context owner derives
it once, to scramble its keys and values, and forgets it.
"""

from __future__ import annotations

import numpy as np

from fedfm.errors import ProtocolError
from fedfm.protocols.fedrag.scrambler import (
    AttentionKeys,
    KeyLedger,
    Scrambler,
    draw_attention_keys,
)
from fedfm.runtime.protocol import RoleContext

LEDGER = "ledger"


class RuntimeRandomness:
    """The randomness ``context.role`` shares with ``peer`` on the runtime (keyed from the
    pair's X25519 agreement; the relay and every other role cannot derive it)."""

    def __init__(self, context: RoleContext, peer: str) -> None:
        self._context, self._peer = context, peer

    def generator(self, purpose: str) -> np.random.Generator:
        return self._context.shared_generator(self._peer, purpose)

    def words(self, purpose: str, count: int) -> np.ndarray:
        return self._context.shared_mask(self._peer, purpose, count)


def claim(context: RoleContext, purpose: str) -> None:
    """Record ``purpose`` in the role's ledger; :class:`ScramblerKeyReuse` if it is there."""
    ledger = KeyLedger.from_array(context.state.get(LEDGER))
    ledger.claim(purpose)
    context.state[LEDGER] = ledger.to_array()


def derive(
    context: RoleContext,
    peer: str,
    purpose: str,
    *,
    heads: int,
    head_dim: int,
    kind: str,
    scaling_range: float,
) -> AttentionKeys:
    """Claim ``purpose`` and derive its key set with ``peer``."""
    claim(context, purpose)
    return draw_attention_keys(
        RuntimeRandomness(context, peer),
        purpose,
        heads=heads,
        head_dim=head_dim,
        kind=kind,
        scaling_range=scaling_range,
    )


def _scrambler_array(key: Scrambler) -> np.ndarray:
    if key.dense is not None:
        return np.stack([key.dense[0], key.dense[1]])
    return np.stack(
        [key.first.astype(np.float64), key.second.astype(np.float64), key.scale1, key.scale2]
    )


def _scrambler_from(kind: str, array: np.ndarray) -> Scrambler:
    d = array.shape[-1]
    if kind == "dense":
        ones = np.ones(d)
        order = np.arange(d)
        return Scrambler(kind, d, order, order, ones, ones, (array[0], array[1]))
    return Scrambler(
        kind, d, array[0].astype(np.int64), array[1].astype(np.int64), array[2], array[3]
    )


def keys_to_arrays(prefix: str, keys: AttentionKeys) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.qk": np.stack([_scrambler_array(k) for k in keys.qk]),
        f"{prefix}.v": np.stack([_scrambler_array(k) for k in keys.v]),
    }


def keys_from_state(state: dict[str, np.ndarray], prefix: str, kind: str) -> AttentionKeys:
    if f"{prefix}.qk" not in state:
        raise ProtocolError(f"no key set {prefix!r} in this role's state")
    return AttentionKeys(
        tuple(_scrambler_from(kind, a) for a in state[f"{prefix}.qk"]),
        tuple(_scrambler_from(kind, a) for a in state[f"{prefix}.v"]),
    )
