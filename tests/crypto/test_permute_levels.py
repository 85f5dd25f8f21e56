"""The Benes permutation of encrypted samples with several layers per level
(:func:`fedfm.crypto.ckks_vit.permute`), checked exactly on plaintext slot vectors: a stand-in
circuit rotates with ``np.roll`` and multiplies by the masks, and counts levels and rotations.
The real CKKS path runs the same code (``tests/crypto/test_ckks.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from fedfm.crypto import ckks_vit
from fedfm.crypto.backend import drive
from fedfm.crypto.benes import benes_layers, drop_identity_layers, pad_permutation
from fedfm.crypto.packing import SlotLayout


class SlotCircuit:
    """Ciphertexts as slot vectors; every masked sum is one level."""

    def __init__(self) -> None:
        self.levels = 0  # masked sums in sequence (what one refresh per level would cost)
        self.rotations = 0
        self.refreshes = 0
        self.forgotten = 0

    def rotate(self, ct: np.ndarray, steps: int) -> np.ndarray:
        self.rotations += 1
        return np.roll(ct, -steps)  # left by ``steps``, as SEAL's rotate_vector

    def masked_sum(self, terms: Sequence[tuple[np.ndarray, Any, np.ndarray]]) -> np.ndarray:
        return sum((ct * mask for ct, _, mask in terms), np.zeros_like(terms[0][0]))

    def ensure(self, tensors: list[list[np.ndarray]], levels: int, place: str) -> Any:
        self.refreshes += 1  # one level per refresh, as ckks-8192
        return tensors
        yield  # a generator, as Circuit.ensure

    def forget_vectors(self, drop: Callable[[Any], bool]) -> None:
        self.forgotten += 1


def encrypt(layout: SlotLayout, values: np.ndarray) -> list[list[np.ndarray]]:
    """``(samples, tokens, features)`` as one list of slot vectors per feature."""
    samples = values.shape[0]
    count = -(-samples // layout.capacity)
    out = []
    for f in range(values.shape[2]):
        slots = np.zeros(count * layout.slots)
        for s in range(samples):
            start = s * layout.group
            slots[start : start + layout.tokens] = values[s, :, f]
        out.append(list(slots.reshape(count, layout.slots)))
    return out


def decrypt(layout: SlotLayout, tensor: list[list[np.ndarray]], samples: int) -> np.ndarray:
    flat = [np.concatenate(feature) for feature in tensor]
    return np.stack(
        [
            np.stack([f[s * layout.group : s * layout.group + layout.tokens] for f in flat], -1)
            for s in range(samples)
        ]
    )


LAYOUT = SlotLayout(slots=64, tokens=3, group=4, duplicate=False)  # 16 samples per ciphertext


@pytest.mark.parametrize("per_level", [1, 2, 3])
@pytest.mark.parametrize(
    ("samples", "chosen"),
    [
        (16, np.random.default_rng(0).permutation(16)),  # one ciphertext: rotations only
        (50, np.random.default_rng(1).permutation(50)[:20]),  # four: masks across them too
        (64, np.random.default_rng(2).permutation(64)),
    ],
    ids=["one-ciphertext", "select-20-of-50", "four-ciphertexts"],
)
def test_layers_merged_per_level_give_the_same_permutation(
    monkeypatch: pytest.MonkeyPatch, per_level: int, samples: int, chosen: np.ndarray
) -> None:
    monkeypatch.setattr(ckks_vit, "PERMUTE_LAYERS_PER_LEVEL", per_level)
    values = np.random.default_rng(3).normal(size=(samples, LAYOUT.tokens, 2))
    circuit = SlotCircuit()
    out = drive(
        ckks_vit.permute(circuit, LAYOUT, encrypt(LAYOUT, values), samples, chosen),  # type: ignore[arg-type]
        lambda items: items,
    )
    np.testing.assert_allclose(decrypt(LAYOUT, out, chosen.size), values[chosen], atol=1e-12)
    size = max(2, 1 << (samples - 1).bit_length())
    unused = np.setdiff1d(np.arange(size), chosen)
    full = pad_permutation(np.concatenate([chosen, unused]), size)
    layers = drop_identity_layers(benes_layers(full))
    kept = -(-chosen.size // LAYOUT.capacity)
    stray = int((full[chosen.size : kept * LAYOUT.capacity] < samples).any())  # zeroed after
    assert circuit.refreshes == -(-len(layers) // per_level) + stray
    assert circuit.forgotten == 1  # the call's one-off masks leave the plaintext cache


def test_two_layers_per_level_halve_the_levels_for_more_rotations() -> None:
    chosen = np.random.default_rng(4).permutation(64)
    values = np.random.default_rng(5).normal(size=(64, LAYOUT.tokens, 1))
    counts = {}
    for per_level in (1, 2):
        circuit = SlotCircuit()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ckks_vit, "PERMUTE_LAYERS_PER_LEVEL", per_level)
            drive(
                ckks_vit.permute(circuit, LAYOUT, encrypt(LAYOUT, values), 64, chosen),  # type: ignore[arg-type]
                lambda items: items,
            )
        counts[per_level] = (circuit.refreshes, circuit.rotations)
    (one_level, one_rot), (two_level, two_rot) = counts[1], counts[2]
    assert two_level == -(-one_level // 2)
    assert one_rot < two_rot <= 3 * one_rot
