"""Batch permutations of the encrypted inference protocol (spec ``001`` §3.2-3.3, App. C).

Permutations are index arrays: a batch ``X`` in order ``pi`` is ``X[pi]`` (row ``i`` holds sample
``pi[i]``). The server draws, per batch and per round, ``pi_1 .. pi_{L+1}``; it permutes block
``l``'s output by ``pi_l`` and the labels by ``pi_{L+1}``. The client receives only *relative*
permutations ``relative(pi_a, pi_b) = pi_a^{-1} pi_b``, which re-order a batch held in order
``pi_a`` into order ``pi_b``: ``X[pi_a][relative(pi_a, pi_b)] == X[pi_b]``. Given all of them the
client still cannot tell any ``pi_l`` (Proposition 1: ``S pi_l`` gives the same relatives for every
permutation ``S``, so ``n!`` candidates remain).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedfm.crypto.randomness import RandomSource
from fedfm.errors import ConfigError


def relative(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """``first^{-1} second``: the re-ordering from order ``first`` to order ``second``."""
    return np.argsort(first)[second]


@dataclass(frozen=True)
class RoundPermutations:
    """``pi_1 .. pi_{L+1}`` of one batch in one round (``orders[l - 1]`` is ``pi_l``)."""

    orders: tuple[np.ndarray, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.orders) - 1

    def after_block(self, block: int) -> np.ndarray:
        """``pi_l`` for 1-based block ``l``; ``after_block(L + 1)`` is the label order."""
        return self.orders[block - 1]

    def client_view(self) -> dict[str, np.ndarray]:
        """What the client receives: only relative permutations.

        ``wrap`` is ``pi_L^{-1} pi_1`` (it moves ``B_L`` into order ``pi_1`` for ``H_0``) and
        ``step[l - 1]`` is ``pi_l^{-1} pi_{l+1}`` for ``l = 1 .. L``.
        """
        last = self.num_blocks
        steps = [relative(self.orders[i], self.orders[i + 1]) for i in range(last)]
        return {
            "wrap": relative(self.orders[last - 1], self.orders[0]),
            "steps": np.stack(steps),
        }


def draw_round_permutations(
    num_blocks: int, batch_size: int, rng: RandomSource, *, permute: bool = True
) -> RoundPermutations:
    """Fresh random ``pi_1 .. pi_{L+1}`` from the server's secret stream (identities when
    ``permute`` is off, a debug switch)."""
    if num_blocks < 1 or batch_size < 1:
        raise ConfigError("permutations need at least one block and one sample")
    if not permute:
        identity = np.arange(batch_size)
        return RoundPermutations(tuple(identity.copy() for _ in range(num_blocks + 1)))
    return RoundPermutations(tuple(rng.permutation(batch_size) for _ in range(num_blocks + 1)))
