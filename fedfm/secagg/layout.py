"""Names and shapes of the arrays being aggregated, and their flattening into one vector."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedfm.errors import ConfigError, ProtocolError


@dataclass(frozen=True)
class ArrayLayout:
    """Ordered ``(name, shape)`` pairs; the order fixes where each array sits in the vector.

    The server announces the layout in the first message so that every client flattens its
    update the same way and the server can give the average back under the same names.
    """

    entries: tuple[tuple[str, tuple[int, ...]], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.entries]
        if not names:
            raise ConfigError("the layout holds no arrays")
        if len(set(names)) != len(names):
            raise ConfigError(f"the layout repeats array names: {names}")
        for name, shape in self.entries:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"array name {name!r} is not a non-empty string")
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
                raise ConfigError(f"array {name!r} has an invalid shape {shape!r}")
        if self.size == 0:
            raise ConfigError("the layout's arrays hold no values")

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray]) -> ArrayLayout:
        """The layout of ``arrays`` in their mapping order."""
        return cls(tuple((name, tuple(int(d) for d in np.shape(a))) for name, a in arrays.items()))

    @property
    def size(self) -> int:
        """Number of values across all arrays."""
        return sum(math.prod(shape) for _, shape in self.entries)

    def flatten(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """``arrays`` as one float64 vector in layout order; names and shapes must match exactly."""
        expected = {name: shape for name, shape in self.entries}
        if set(arrays) != set(expected):
            missing = sorted(set(expected) - set(arrays))
            extra = sorted(set(arrays) - set(expected))
            raise ProtocolError(
                f"update does not match the announced layout: missing {missing}, extra {extra}"
            )
        parts = []
        for name, shape in self.entries:
            array = np.asarray(arrays[name])
            if array.shape != shape:
                raise ProtocolError(
                    f"update array {name!r} has shape {array.shape}, the layout says {shape}"
                )
            if not np.issubdtype(array.dtype, np.floating):
                raise ProtocolError(f"update array {name!r} has dtype {array.dtype}, not float")
            parts.append(array.astype(np.float64).reshape(-1))
        return np.concatenate(parts)

    def unflatten(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        """Split a vector of :attr:`size` values into float32 arrays under the layout's names."""
        if vector.shape != (self.size,):
            raise ProtocolError(f"vector has shape {vector.shape}, the layout needs ({self.size},)")
        arrays, offset = {}, 0
        for name, shape in self.entries:
            count = math.prod(shape)
            arrays[name] = vector[offset : offset + count].astype(np.float32).reshape(shape)
            offset += count
        return arrays

    def to_json(self) -> str:
        return json.dumps([[name, list(shape)] for name, shape in self.entries])

    @classmethod
    def from_json(cls, text: str) -> ArrayLayout:
        """Parse :meth:`to_json` output; raises :class:`ProtocolError` if it is malformed."""
        try:
            entries = json.loads(text)
            layout = cls(tuple((name, tuple(shape)) for name, shape in entries))
        except (ValueError, TypeError, ConfigError) as error:
            raise ProtocolError(f"malformed array layout: {error}") from error
        return layout
