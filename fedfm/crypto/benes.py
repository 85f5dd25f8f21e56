"""Beneš permutation networks: route any permutation through masked swaps at power-of-two distances.

A CKKS evaluator can move a slot only by rotating the whole ciphertext, so an arbitrary
permutation of positions is applied as a Beneš network: a sequence of stages, each of which
exchanges the pairs ``(p, p + distance)`` selected by a plaintext mask (two masked products and a
rotation each way). This module computes the masks in plain numpy; applying them homomorphically
is another module's job. :func:`apply_layers` is the reference application on a numpy array.

Layout of the network built by :func:`benes_layers` for ``size = 2**k`` positions: the first and
the last stage pair positions ``p`` and ``p + size/2``; between them two independent networks of
half the size act on ``[0, size/2)`` and ``[size/2, size)``, built the same way. The distances
are therefore ``size/2, size/4, ..., 2, 1, 2, ..., size/4, size/2`` (``2k - 1`` stages; the
middle stage at distance 1 is shared by the innermost networks of two positions). The swaps are
found with the classic looping algorithm (a two-colouring of the constraint cycles).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fedfm.errors import ConfigError


@dataclass(frozen=True)
class SwapLayer:
    """One stage: for every position p whose bit log2(distance) is 0, the pair (p, p + distance)
    is exchanged when swap[p] is True. swap has one entry per position; entries at positions
    whose bit is 1 are always False.

    ``swap`` is stored as a read-only copy; construction checks that ``distance`` is a power of
    two, that the number of positions is a multiple of ``2 * distance`` and that no entry at a
    position whose bit is 1 is set (:class:`~fedfm.errors.ConfigError` otherwise).
    """

    distance: int
    swap: np.ndarray  # bool, shape (size,)

    def __post_init__(self) -> None:
        distance = self.distance
        if isinstance(distance, bool) or not isinstance(distance, int | np.integer):
            raise ConfigError(f"swap layer distance must be an int, got {distance!r}")
        distance = int(distance)
        if distance < 1 or distance & (distance - 1):
            raise ConfigError(f"swap layer distance must be a power of two >= 1, got {distance}")
        swap = np.asarray(self.swap)
        if swap.ndim != 1 or swap.dtype != np.bool_:
            raise ConfigError(
                f"swap layer mask must be a 1-D bool array, got dtype {swap.dtype} "
                f"and shape {swap.shape}"
            )
        if swap.size % (2 * distance):
            raise ConfigError(
                f"swap layer mask has {swap.size} positions, not a multiple of "
                f"2 * distance = {2 * distance}"
            )
        if swap[(np.arange(swap.size) & distance) != 0].any():
            raise ConfigError(
                f"swap layer at distance {distance} sets positions whose bit {distance} is 1; "
                "only the lower position p of each pair (p, p + distance) may be set"
            )
        swap = swap.copy()
        swap.setflags(write=False)
        object.__setattr__(self, "distance", distance)
        object.__setattr__(self, "swap", swap)

    @property
    def size(self) -> int:
        """Number of positions the layer acts on."""
        return int(self.swap.size)

    @property
    def is_identity(self) -> bool:
        """True when the layer exchanges no pair."""
        return not bool(self.swap.any())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SwapLayer):
            return NotImplemented
        return self.distance == other.distance and np.array_equal(self.swap, other.swap)

    def __hash__(self) -> int:
        return hash((self.distance, self.swap.size, self.swap.tobytes()))


def _as_index_array(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` as a 1-D int64 array; ConfigError for other shapes or non-integer dtypes."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ConfigError(f"{what} must be a 1-D array, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(f"{what} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def _check_permutation(permutation: np.ndarray, what: str = "permutation") -> np.ndarray:
    """``permutation`` as int64 after checking it is a permutation of range(len(permutation))."""
    perm = _as_index_array(permutation, what)
    n = perm.size
    out_of_range = (perm < 0) | (perm >= n)
    if out_of_range.any():
        bad = perm[out_of_range][:5].tolist()
        raise ConfigError(f"{what} of length {n} has entries outside range({n}): {bad}")
    counts = np.bincount(perm, minlength=n)
    if (counts > 1).any():
        repeated = np.flatnonzero(counts > 1)[:5].tolist()
        raise ConfigError(f"{what} is not a permutation: repeated entries {repeated}")
    return perm


def _route(perm: np.ndarray, offset: int, depth: int, stages: list[np.ndarray]) -> None:
    """Write the swaps routing the block ``[offset, offset + len(perm))`` into ``stages``.

    ``perm`` is the block's permutation in local coordinates (gather semantics). Its outer layers
    go to stages ``depth`` and ``len(stages) - 1 - depth``; its two halves recurse one level
    deeper.
    """
    n = perm.size
    if n == 1:
        return
    if n == 2:
        # one stage at distance 1: swap exactly when the output wants the other value first
        stages[depth][offset] = bool(perm[0] == 1)
        return
    half = n // 2
    perm_list = perm.tolist()
    dest = [0] * n  # dest[j]: the output position the input value at j must reach
    for i, j in enumerate(perm_list):
        dest[j] = i
    # colour[j] = 0: input j goes through the top half network, 1: through the bottom one.
    # The two inputs of a pair (j, j + half) need different colours (the first stage sends one
    # of them each way), and so do the two sources of an output pair (i, i + half) (the last
    # stage takes one from each half). These constraints form even cycles; walk each one.
    colour = [-1] * n
    for start in range(half):
        if colour[start] >= 0:
            continue
        j = start
        while colour[j] < 0:
            colour[j] = 0
            partner = j + half if j < half else j - half
            colour[partner] = 1
            out = dest[partner]
            out_partner = out + half if out < half else out - half
            j = perm_list[out_partner]  # the other source of that output pair: colour 0
    colours = np.asarray(colour, dtype=np.int8)
    first, last = depth, len(stages) - 1 - depth
    # first stage: position j < half keeps its value in the top half when its colour is 0
    stages[first][offset : offset + half] = colours[:half] == 1
    low, high = perm[:half], perm[half:]
    low_in_bottom = colours[low] == 1
    # last stage: output i takes the top network's output i unless its source went through the
    # bottom network
    stages[last][offset : offset + half] = low_in_bottom
    top_sources = np.where(low_in_bottom, high, low)
    bottom_sources = np.where(low_in_bottom, low, high)
    # after the first stage the top half holds, at k, the colour-0 input of pair k (k or
    # k + half); the bottom half the colour-1 one: so sources map to local index source % half
    _route(top_sources % half, offset, depth + 1, stages)
    _route(bottom_sources % half, offset + half, depth + 1, stages)


def benes_layers(permutation: np.ndarray) -> list[SwapLayer]:
    """Layers that turn values x (length size) into x[permutation] (gather semantics:
    output[i] = x[permutation[i]]). size = len(permutation) must be a power of two >= 1;
    raise fedfm.errors.ConfigError (from fedfm.errors import ConfigError) with a clear message
    otherwise, or if permutation is not a permutation of range(size).

    Returns ``2*log2(size) - 1`` layers (none for size 1) with distances
    ``size/2, size/4, ..., 2, 1, 2, ..., size/4, size/2`` in this order (largest distance first
    and last), each layer's swap computed by the looping algorithm. Many layers may swap nothing;
    :func:`drop_identity_layers` removes them.
    """
    perm = _as_index_array(permutation, "permutation")
    size = perm.size
    if not _is_power_of_two(size):
        raise ConfigError(
            f"permutation length must be a power of two >= 1 for a Beneš network, got {size}; "
            "extend it with pad_permutation or gather_permutation first"
        )
    perm = _check_permutation(perm)
    if size == 1:
        return []
    log_size = size.bit_length() - 1
    distances = [size >> (k + 1) for k in range(log_size)]
    distances += distances[-2::-1]
    stages = [np.zeros(size, dtype=bool) for _ in distances]
    _route(perm, 0, 0, stages)
    return [SwapLayer(distance, swap) for distance, swap in zip(distances, stages, strict=True)]


def pad_permutation(permutation: np.ndarray, size: int) -> np.ndarray:
    """Extend a permutation of range(n) to range(size) (size >= n) by fixing n..size-1.

    ConfigError when ``permutation`` is not a permutation or ``size`` is smaller than ``n``.
    ``size`` need not be a power of two here (:func:`benes_layers` checks that).
    """
    perm = _check_permutation(permutation)
    size = int(size)
    if size < perm.size:
        raise ConfigError(f"cannot pad a permutation of length {perm.size} to size {size}")
    return np.concatenate([perm, np.arange(perm.size, size, dtype=np.int64)])


def gather_permutation(indices: np.ndarray, source_size: int, size: int) -> np.ndarray:
    """A permutation of range(size) (size a power of two >= source_size) whose first
    len(indices) outputs are x[indices] (indices distinct, in range(source_size)); the remaining
    outputs are the unused positions in increasing order. Clear ConfigError for repeats or
    out-of-range indices."""
    idx = _as_index_array(indices, "indices")
    source_size, size = int(source_size), int(size)
    if source_size < 0:
        raise ConfigError(f"source_size must be >= 0, got {source_size}")
    if not _is_power_of_two(size) or size < source_size:
        raise ConfigError(f"size must be a power of two >= source_size = {source_size}, got {size}")
    out_of_range = (idx < 0) | (idx >= source_size)
    if out_of_range.any():
        bad = idx[out_of_range][:5].tolist()
        raise ConfigError(f"indices outside range({source_size}): {bad}")
    counts = np.bincount(idx, minlength=size)
    if (counts > 1).any():
        repeated = np.flatnonzero(counts > 1)[:5].tolist()
        raise ConfigError(f"indices must be distinct; repeated: {repeated}")
    return np.concatenate([idx, np.flatnonzero(counts == 0)]).astype(np.int64)


def apply_layers(values: np.ndarray, layers: list[SwapLayer]) -> np.ndarray:
    """Reference application on a numpy array (first axis = positions): for each layer in
    order, exchange values[p] and values[p + distance] where swap[p]. Returns a new array."""
    out = np.array(values, copy=True)
    for layer in layers:
        if out.ndim == 0 or out.shape[0] != layer.size:
            raise ConfigError(
                f"layer acts on {layer.size} positions but values have shape {out.shape}"
            )
        low = np.flatnonzero(layer.swap)
        if low.size == 0:
            continue
        high = low + layer.distance
        saved = out[low].copy()
        out[low] = out[high]
        out[high] = saved
    return out


def drop_identity_layers(layers: Iterable[SwapLayer]) -> list[SwapLayer]:
    """The layers that swap at least one pair (the others cost nothing to skip)."""
    return [layer for layer in layers if not layer.is_identity]


__all__ = [
    "SwapLayer",
    "apply_layers",
    "benes_layers",
    "drop_identity_layers",
    "gather_permutation",
    "pad_permutation",
]
