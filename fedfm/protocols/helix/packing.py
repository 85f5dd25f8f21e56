"""Where HELIX puts numbers in CKKS slots (pure numpy; :mod:`~.ckks` encrypts them).

A ciphertext has ``S = N/2`` slots (4,096 at N = 8192). Three layouts, each chosen so that the
provider's work is plaintext multiply-accumulate plus, at most, rotations whose result holds only
the values the client is meant to learn:

:class:`RowBlocks` (alignment upload)
    ``s = S / B`` public samples per ciphertext, sample ``b`` in the block of ``B`` slots
    starting at ``b * B`` (``B``: the client's feature count rounded up to a power of two). The
    provider computes ``Z_A^T Z_B`` for ``s`` of its features per output ciphertext: for every
    shift ``u`` it multiplies each upload by a block-constant plaintext of its own embeddings and
    accumulates, then folds the ``s`` accumulators together with ``s - 1`` rotations by one block
    (Horner). Output block ``b`` of group ``g`` is row ``g s + b`` of ``Z_A^T Z_B``; every other
    slot is zero. ``N d_A d_B' / S`` plaintext products, ``d_A`` rotations, one Galois key.
:class:`FeatureMajor` (batched inference)
    One ciphertext per feature, queries in the slots (up to ``S`` per ciphertext). The head
    ``E(z) V + c`` is a scalar multiply-accumulate per class: no rotation, no Galois key; ``K``
    ciphertexts come back per ``S`` queries.
:class:`ReplicatedRows` (one or a few queries)
    One query per ciphertext, feature-major inside it: feature ``i`` fills slots
    ``i R .. i R + R - 1`` (``R = S / B`` copies). The provider multiplies by a plaintext with
    ``V[i, g R + r]`` in slot ``i R + r`` and sums over features with ``log2 B`` rotations by
    ``R, 2R, ...``: the sum over ``i`` is cyclic, so every slot ends up holding its class's
    complete logit and no partial sum survives. ``ceil(K / R)`` ciphertexts come back per query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedfm.errors import ConfigError, ProtocolError

LayoutName = Literal["features", "rows"]
LAYOUT_CODES: dict[str, int] = {"features": 0, "rows": 1}


def block_size(features: int, slots: int) -> int:
    """``features`` rounded up to a power of two; :class:`ConfigError` if it exceeds ``slots``."""
    if features < 1:
        raise ConfigError(f"a layout needs at least one feature, got {features}")
    block = 1 << (features - 1).bit_length()
    if block > slots:
        raise ConfigError(
            f"{features} features do not fit the {slots} slots of one ciphertext; use a "
            "larger ring or fewer embedding dimensions"
        )
    return block


def _pad_columns(values: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((values.shape[0], width))
    out[:, : values.shape[1]] = values
    return out


@dataclass(frozen=True)
class RowBlocks:
    """The alignment upload: samples as rows, ``per_ciphertext`` of them per ciphertext."""

    features: int
    slots: int

    @property
    def block(self) -> int:
        return block_size(self.features, self.slots)

    @property
    def per_ciphertext(self) -> int:
        return self.slots // self.block

    def ciphertexts(self, samples: int) -> int:
        return -(-samples // self.per_ciphertext)

    def rotation_steps(self) -> list[int]:
        """The one rotation the provider's Horner fold needs (none with one sample per block)."""
        return [self.block] if self.per_ciphertext > 1 else []

    def groups(self, provider_features: int) -> int:
        """Output ciphertexts: ``per_ciphertext`` provider features each."""
        return -(-provider_features // self.per_ciphertext)

    def pack(self, rows: np.ndarray) -> np.ndarray:
        """``(N, features)`` rows as ``(ciphertexts, slots)`` slot vectors."""
        if rows.ndim != 2 or rows.shape[1] != self.features:
            raise ConfigError(f"expected rows of {self.features} features, got {rows.shape}")
        count, s = self.ciphertexts(rows.shape[0]), self.per_ciphertext
        padded = np.zeros((count * s, self.block))
        padded[: rows.shape[0], : self.features] = rows
        return padded.reshape(count, self.slots)

    def provider_plaintexts(self, provider_rows: np.ndarray, ciphertext: int) -> np.ndarray:
        """``(groups, s, slots)``: the plaintext for upload ``ciphertext``, group ``g``, shift
        ``u``; block ``b`` holds ``Z_A[ciphertext s + b, g s + (b - u) mod s]``."""
        s = self.per_ciphertext
        groups = self.groups(provider_rows.shape[1])
        rows = np.zeros((s, groups * s))
        chunk = provider_rows[ciphertext * s : (ciphertext + 1) * s]
        rows[: chunk.shape[0], : chunk.shape[1]] = chunk
        b = np.arange(s)
        shifts = np.arange(s)[:, None]
        columns = np.arange(groups)[:, None, None] * s + (b - shifts) % s  # (groups, s, s)
        values = rows[b, columns]  # (groups, u, b)
        blocks = np.zeros((groups, s, s, self.block))
        blocks[..., : self.features] = values[..., None]
        return blocks.reshape(groups, s, self.slots)

    def unpack(self, decrypted: np.ndarray, provider_features: int) -> np.ndarray:
        """``Z_A^T Z_B`` (``provider_features x features``) from the decrypted output slots."""
        groups = self.groups(provider_features)
        if decrypted.shape != (groups, self.slots):
            raise ProtocolError(
                f"expected {groups} cross-covariance ciphertexts, got {decrypted.shape[0]}"
            )
        blocks = decrypted.reshape(groups * self.per_ciphertext, self.block)
        return blocks[:provider_features, : self.features]


@dataclass(frozen=True)
class FeatureMajor:
    """Batched inference: one ciphertext per feature per ``slots`` queries."""

    features: int
    slots: int
    name: LayoutName = "features"

    def chunks(self, queries: int) -> int:
        return -(-queries // self.slots)

    def ciphertexts(self, queries: int) -> int:
        return self.features * self.chunks(queries)

    def rotation_steps(self) -> list[int]:
        return []

    def pack(self, queries: np.ndarray) -> np.ndarray:
        """``(n, features)`` as ``(chunks * features, slots)``, chunk-major."""
        n = queries.shape[0]
        padded = np.zeros((self.chunks(n) * self.slots, self.features))
        padded[:n] = queries
        return (
            padded.reshape(self.chunks(n), self.slots, self.features)
            .transpose(0, 2, 1)
            .reshape(-1, self.slots)
        )

    def outputs(self, queries: int, classes: int) -> int:
        return self.chunks(queries) * classes

    def unpack(self, decrypted: np.ndarray, queries: int, classes: int) -> np.ndarray:
        """Logits ``(n, classes)`` from ``(chunks * classes, slots)``."""
        chunks = self.chunks(queries)
        grid = decrypted.reshape(chunks, classes, self.slots).transpose(0, 2, 1)
        return grid.reshape(chunks * self.slots, classes)[:queries]


@dataclass(frozen=True)
class ReplicatedRows:
    """One query per ciphertext, feature ``i`` copied into slots ``i R .. i R + R - 1``."""

    features: int
    slots: int
    name: LayoutName = "rows"

    @property
    def block(self) -> int:
        return block_size(self.features, self.slots)

    @property
    def copies(self) -> int:
        return self.slots // self.block

    def ciphertexts(self, queries: int) -> int:
        return queries

    def rotation_steps(self) -> list[int]:
        """``R, 2R, 4R, ...``: summing the ``B`` feature rows cyclically."""
        return [self.copies << e for e in range(int(math.log2(self.block)))]

    def groups(self, classes: int) -> int:
        return -(-classes // self.copies)

    def outputs(self, queries: int, classes: int) -> int:
        return queries * self.groups(classes)

    def pack(self, queries: np.ndarray) -> np.ndarray:
        return np.repeat(_pad_columns(queries, self.block), self.copies, axis=1)

    def _class_grid(self, values: np.ndarray, group: int) -> np.ndarray:
        """``values[..., g R + r]`` laid out for group ``g``: ``(..., R)``, zero past the end."""
        chosen = np.zeros((*values.shape[:-1], self.copies))
        part = values[..., group * self.copies : (group + 1) * self.copies]
        chosen[..., : part.shape[-1]] = part
        return chosen

    def weight_plaintext(self, weight: np.ndarray, group: int) -> np.ndarray:
        """Slot ``i R + r`` holds ``weight[i, g R + r]``."""
        grid = np.zeros((self.block, self.copies))
        grid[: weight.shape[0]] = self._class_grid(weight, group)
        return grid.reshape(self.slots)

    def bias_plaintext(self, bias: np.ndarray, group: int) -> np.ndarray:
        """Every feature row holds ``bias[g R + r]`` in column ``r``."""
        return np.tile(self._class_grid(bias, group), self.block)

    def unpack(self, decrypted: np.ndarray, queries: int, classes: int) -> np.ndarray:
        """Logits ``(n, classes)`` from ``(n * groups, slots)``: row 0 of each output."""
        groups = self.groups(classes)
        first_row = decrypted.reshape(queries, groups, self.slots)[:, :, : self.copies]
        return first_row.reshape(queries, groups * self.copies)[:, :classes]


InferenceLayout = FeatureMajor | ReplicatedRows


def inference_layout(name: str, queries: int, features: int, slots: int) -> InferenceLayout:
    """The layout ``name`` (``features``, ``rows`` or ``auto``) for ``queries`` queries.

    ``auto`` takes ``rows`` while the batch is small: a row ciphertext costs the provider about
    ``log2 B`` rotations, and ``features`` sends ``features`` ciphertexts whatever the batch, so
    ``rows`` wins while ``queries * log2 B < features * chunks``.
    """
    if queries < 1:
        raise ConfigError("inference needs at least one query")
    features_layout, rows_layout = FeatureMajor(features, slots), ReplicatedRows(features, slots)
    if name == "features":
        return features_layout
    if name == "rows":
        return rows_layout
    if name != "auto":
        raise ConfigError(f"packing must be 'auto', 'features' or 'rows', got {name!r}")
    rows_cost = queries * max(1, int(math.log2(rows_layout.block)))
    return rows_layout if rows_cost < features_layout.ciphertexts(queries) else features_layout


def layout_from_code(code: int, features: int, slots: int) -> InferenceLayout:
    """The layout a message names by its :data:`LAYOUT_CODES` value."""
    if code == LAYOUT_CODES["features"]:
        return FeatureMajor(features, slots)
    if code == LAYOUT_CODES["rows"]:
        return ReplicatedRows(features, slots)
    raise ProtocolError(f"unknown inference layout code {code}")
