"""Slot layout of the CKKS backend: one ciphertext per feature, samples x tokens in the slots.

A ciphertext has ``S = N/2`` slots. Sample ``s`` of a batch lives in ciphertext ``s // capacity``,
*group* ``s % capacity``; a group is ``group`` consecutive slots starting at
``(s % capacity) * group``. Inside a group, slot ``t`` holds token ``t`` (``t < tokens``) and,
when ``duplicate`` is set, slot ``tokens + t`` holds token ``t`` again for ``t < copies``::

    group = 2T - 2:  | t0 t1 ... t(T-1) | t0 t1 ... t(T-3) |

With that copy, rotating a whole ciphertext left by ``d < T`` brings token ``(t + d) mod T`` of the
*same* sample to slot ``t`` for every pair but one: the last token shifted by ``T - 1`` lands in
the next group (a copy of token ``T - 2`` would need a ``2T - 1``-th slot). Attention takes that
one value from the shift by ``-1`` instead, inside plaintext masks it applies anyway
(:attr:`wraps`); in exchange the group of 17 tokens is 32 slots, not 33, and twice as many
samples fit (the capacity is a power of two). Every feature (model width ``D``) is its own
ciphertext, so linear layers are sums of scalar x ciphertext products and need no rotation; only
attention (token shifts), permutations of samples (shifts by multiples of ``group``) and the
loss's sum over samples rotate.

``capacity`` is the largest power of two of groups that fits, so that a Benes network over the
samples moves groups by power-of-two distances (one rotation key per distance and direction).
Rows of shape ``(n, C)`` (labels, probabilities) use the same ``group`` with one token, so they
share the hidden states' rotation keys. Cost per sample falls as the batch fills a ciphertext:
``capacity`` samples share every operation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedfm.crypto.params import group_slots, samples_per_ciphertext
from fedfm.errors import ConfigError, ProtocolError


@dataclass(frozen=True)
class SlotLayout:
    """Where each (sample, token) value of one feature sits in the slots of its ciphertexts."""

    slots: int
    tokens: int
    group: int
    duplicate: bool

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.group < self.tokens:
            raise ConfigError(f"a group of {self.group} slots cannot hold {self.tokens} tokens")
        if self.duplicate and self.group < 2 * self.tokens - 2:
            raise ConfigError(
                f"duplicated tokens need a group of at least {2 * self.tokens - 2} slots"
            )
        if self.group > self.slots:
            raise ConfigError(f"a group of {self.group} slots exceeds the {self.slots} slots")

    @classmethod
    def for_tokens(cls, slots: int, tokens: int) -> SlotLayout:
        """The layout of hidden states (and images as patches) with ``tokens`` tokens: groups of
        ``2T - 2`` slots (``2T - 1`` for two tokens, which would have no copy otherwise)."""
        return cls(slots, tokens, group_slots(tokens), tokens > 1)

    @property
    def copies(self) -> int:
        """Tokens ``0 .. copies - 1`` are repeated after the real ones."""
        return min(self.group - self.tokens, self.tokens - 1) if self.duplicate else 0

    @property
    def wraps(self) -> bool:
        """Whether the last token's shift by ``tokens - 1`` leaves its group (no copy of token
        ``tokens - 2``): that value is taken from the shift by ``-1``."""
        return self.duplicate and self.copies < self.tokens - 1

    def rows(self) -> SlotLayout:
        """The layout of ``(n, C)`` rows that shares this layout's groups (one token each)."""
        return SlotLayout(self.slots, 1, self.group, False)

    @property
    def capacity(self) -> int:
        """Samples per ciphertext (a power of two)."""
        return samples_per_ciphertext(self.slots, self.tokens, self.group)

    def ciphertexts_for(self, samples: int) -> int:
        return -(-samples // self.capacity)

    def folds(self, samples: int) -> bool:
        """Whether a batch of ``samples`` leaves the upper half of the groups empty, so that a
        ciphertext can carry two features (one per half; :attr:`half_shift` apart)."""
        return self.capacity >= 2 and 2 * samples <= self.capacity

    @property
    def half_shift(self) -> int:
        """The rotation that moves the lower half of the groups onto the upper half (a keyed
        step: :meth:`rotation_steps` has ``group * capacity / 2``)."""
        return self.group * (self.capacity // 2)

    @property
    def baby_steps(self) -> int:
        """``b = ceil(sqrt(tokens))``: attention splits a token shift ``d`` into ``d % b`` (a baby
        step, made by repeated shifts by one) and ``b * (d // b)`` (a giant step), so that a
        feature needs ``b - 1 + ceil(tokens / b) - 1`` rotations instead of ``tokens - 1``."""
        return math.isqrt(self.tokens - 1) + 1 if self.tokens > 1 else 1

    def giant_steps(self) -> list[int]:
        """The giant token shifts ``b * j`` for ``0 < b * j < tokens``."""
        baby = self.baby_steps
        return list(range(baby, self.tokens, baby))

    def rotation_steps(self) -> list[int]:
        """Rotation steps (positive: left) that evaluation uses: keys are made for these only.

        Token shifts by one and by plus or minus each giant step (:attr:`baby_steps`), the right
        shift by ``tokens`` that rebuilds the token copy, by ``-1`` if the layout :attr:`wraps`,
        and left and right shifts by
        ``group * 2**j`` (``2**j < capacity``) for permutations of samples and sums over samples.
        """
        steps: set[int] = set()
        if self.tokens > 1:
            steps.add(1)
        for giant in self.giant_steps():
            steps.update((giant, -giant))
        if self.duplicate:
            steps.add(-self.tokens)
        if self.wraps:
            steps.add(-1)
        distance = 1
        while distance < self.capacity:
            steps.update((distance * self.group, -distance * self.group))
            distance *= 2
        return sorted(steps)

    # -- values <-> slots ------------------------------------------------------------------------
    def pack(self, values: np.ndarray) -> np.ndarray:
        """``(n, tokens, F)`` values to ``(F, ciphertexts, slots)`` slot vectors."""
        if values.ndim != 3 or values.shape[1] != self.tokens or values.shape[0] < 1:
            raise ProtocolError(
                f"cannot pack values of shape {values.shape} into {self.tokens}-token groups"
            )
        samples, _, features = values.shape
        count = self.ciphertexts_for(samples)
        out = np.zeros((features, count * self.capacity, self.group), dtype=np.float64)
        per_feature = np.transpose(values, (2, 0, 1))  # (F, n, T)
        out[:, :samples, : self.tokens] = per_feature
        if self.duplicate:
            end = self.tokens + self.copies
            out[:, :samples, self.tokens : end] = per_feature[:, :, : self.copies]
        out = out.reshape(features, count, self.capacity * self.group)
        padded = np.zeros((features, count, self.slots), dtype=np.float64)
        padded[:, :, : self.capacity * self.group] = out
        return padded

    def unpack(self, slots: np.ndarray, samples: int) -> np.ndarray:
        """``(F, ciphertexts, slots)`` slot vectors to ``(samples, tokens, F)`` values."""
        features, count, width = slots.shape
        if width != self.slots or count != self.ciphertexts_for(samples):
            raise ProtocolError(
                f"{count} ciphertexts of {width} slots do not hold {samples} samples"
            )
        used = slots[:, :, : self.capacity * self.group].reshape(
            features, count * self.capacity, self.group
        )
        return np.transpose(used[:, :samples, : self.tokens], (1, 2, 0)).copy()

    # -- masks (plaintext slot vectors, one per ciphertext of a batch) ---------------------------
    def group_mask(self, present: np.ndarray, width: int) -> np.ndarray:
        """1 on the first ``width`` slots of every group whose entry in ``present`` is true.

        ``present`` has one boolean per group of all the batch's ciphertexts; returns
        ``(ciphertexts, slots)``.
        """
        count = -(-len(present) // self.capacity)
        groups = np.zeros(count * self.capacity, dtype=bool)
        groups[: len(present)] = present
        mask = np.zeros((count, self.capacity, self.group))
        mask[:, :, :width] = groups.reshape(count, self.capacity, 1)
        out = np.zeros((count, self.slots))
        out[:, : self.capacity * self.group] = mask.reshape(count, -1)
        return out

    def occupied(self, samples: int) -> np.ndarray:
        """1 on every slot of the groups of the ``samples`` samples (token copies included)."""
        count = self.ciphertexts_for(samples)
        return self.group_mask(np.arange(count * self.capacity) < samples, self.group)

    def valid(self, samples: int) -> np.ndarray:
        """1 on the slots of real tokens (not their copies) of the ``samples`` samples."""
        count = self.ciphertexts_for(samples)
        return self.group_mask(np.arange(count * self.capacity) < samples, self.tokens)

    def copied(self, samples: int) -> np.ndarray:
        """1 on the tokens ``0 .. copies - 1`` whose copy sits ``tokens`` slots further."""
        count = self.ciphertexts_for(samples)
        return self.group_mask(np.arange(count * self.capacity) < samples, self.copies)

    def last_token(self, samples: int) -> np.ndarray:
        """1 on the slot of the last token (``tokens - 1``) of each of the ``samples`` samples."""
        count = self.ciphertexts_for(samples)
        present = np.arange(count * self.capacity) < samples
        return self.valid(samples) - self.group_mask(present, self.tokens - 1)
