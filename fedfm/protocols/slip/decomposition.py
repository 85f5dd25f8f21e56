"""Model decomposition by SVD (spec 003 §3, Definitions 1, 4; App. B.2).

A weight ``W`` (``m x n``) with SVD ``U S V^T`` splits into Charlie's top-``k`` part
``W_C = U_k S_k V_k^T``, kept factored as ``(U_k S_k, V_k)`` so that ``W_C a`` costs
``k (m + n)`` multiply-adds, and David's remainder ``W_D = W - W_C`` (the other singular
components), a full ``m x n`` matrix. A *plan* names the split layers and ``k`` for each; every
other linear layer of the model is David's whole (``W_D = W``).

Layers are a model's ``torch.nn.Linear`` modules, named as ``model.named_modules()`` names them;
a layer's *block* is the number after ``layers.``/``layer.``/``h.``/``blocks.`` in its name and
its *type* the rest of the name after the block (``self_attn.q_proj``, ``attention.self.query``,
``mlp.down_proj``...). The default plan splits every linear layer of the first and the last
block (the seed's B.2: "we propose decomposing all layers in a selected block").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fedfm.errors import ConfigError

_BLOCK = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class SplitWeight:
    """One split layer: Charlie's factors and David's remainder (float64)."""

    left: np.ndarray  # U_k S_k, (m, k)
    right: np.ndarray  # V_k, (n, k)
    david: np.ndarray  # W_D = W - U_k S_k V_k^T, (m, n)
    singular_values: np.ndarray  # all of W's, descending

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    def charlie(self) -> np.ndarray:
        """``W_C`` as a full matrix (tests and attacks; the protocol keeps it factored)."""
        return self.left @ self.right.T

    @property
    def charlie_parameters(self) -> int:
        return int(self.left.size + self.right.size)


def numerical_rank(singular_values: np.ndarray, shape: tuple[int, int]) -> int:
    """numpy's ``matrix_rank`` tolerance applied to ``singular_values``."""
    if not singular_values.size:
        return 0
    tolerance = singular_values[0] * max(shape) * np.finfo(np.float64).eps
    return int((singular_values > tolerance).sum())


def split_weight(weight: np.ndarray, k: int, *, name: str = "weight") -> SplitWeight:
    """``W = W_C + W_D`` with ``W_C`` the top ``k`` singular components (Eq. 4).

    Raises
    ------
    ConfigError
        ``k`` is not a positive integer or exceeds the rank of ``W``.
    """
    matrix = np.asarray(weight, dtype=np.float64)
    if matrix.ndim != 2:
        raise ConfigError(f"{name}: a split needs a matrix, got shape {matrix.shape}")
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ConfigError(f"{name}: k must be a positive integer, got {k!r}")
    u, s, vt = np.linalg.svd(matrix, full_matrices=False)
    rank = numerical_rank(s, matrix.shape)
    if k > rank:
        raise ConfigError(
            f"{name}: k = {k} is larger than the rank of its {matrix.shape[0]}x"
            f"{matrix.shape[1]} weight ({rank})"
        )
    left = u[:, :k] * s[:k]
    right = vt[:k].T.copy()
    return SplitWeight(left=left, right=right, david=matrix - left @ right.T, singular_values=s)


def block_of(name: str) -> tuple[int, str] | None:
    """``(block, layer type)`` of a layer name, or ``None`` outside the numbered blocks."""
    match = _BLOCK.search(name)
    return (int(match.group(1)), match.group(2)) if match else None


def block_count(names: Iterable[str]) -> int:
    blocks = [found[0] for found in map(block_of, names) if found is not None]
    return max(blocks) + 1 if blocks else 0


def parse_blocks(spec: str, blocks: int) -> tuple[int, ...]:
    """``"first-last"``, ``"first"``, ``"last"``, ``"all"``, ``"none"`` or indices ``"0,3"``
    (negative from the end); :class:`ConfigError` for a block that does not exist."""
    text = spec.strip().lower()
    named = {
        "first-last": (0, blocks - 1),
        "first": (0,),
        "last": (blocks - 1,),
        "all": tuple(range(blocks)),
        "none": (),
    }
    if text in named:
        chosen = named[text]
    else:
        try:
            chosen = tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise ConfigError(
                f"split blocks {spec!r}: use first-last, first, last, all, none or indices"
            ) from None
        chosen = tuple(b + blocks if b < 0 else b for b in chosen)
    if blocks == 0 and chosen:
        raise ConfigError("the model has no numbered blocks to split")
    bad = [b for b in chosen if not 0 <= b < blocks]
    if bad:
        raise ConfigError(f"split blocks {spec!r}: the model has blocks 0..{blocks - 1}")
    return tuple(sorted(set(chosen)))


def build_plan(
    layers: Iterable[str], *, blocks: str = "first-last", types: str = "all", rank: int = 16
) -> dict[str, int]:
    """The split layers and their ``k``: every layer of the chosen ``blocks`` whose type is in
    ``types`` (``"all"`` or comma-separated types). :class:`ConfigError` for a type no chosen
    block has."""
    names = list(layers)
    chosen = set(parse_blocks(blocks, block_count(names)))
    wanted = None if types.strip().lower() == "all" else {t.strip() for t in types.split(",")}
    plan: dict[str, int] = {}
    seen: set[str] = set()
    for name in names:
        found = block_of(name)
        if found is None or found[0] not in chosen:
            continue
        seen.add(found[1])
        if wanted is None or found[1] in wanted:
            plan[name] = rank
    if wanted is not None and wanted - seen:
        raise ConfigError(
            f"no layer of type {sorted(wanted - seen)} in the chosen blocks; types: {sorted(seen)}"
        )
    return plan


def check_plan(plan: Iterable[str], layers: Iterable[str]) -> None:
    """:class:`ConfigError` for a planned layer (a name of ``plan``) the model does not have."""
    known = set(layers)
    missing = sorted(set(plan) - known)
    if missing:
        sample = ", ".join(sorted(known)[:4])
        raise ConfigError(
            f"the model has no linear layer {missing[0]!r} (it has {len(known)}, e.g. {sample})"
        )
