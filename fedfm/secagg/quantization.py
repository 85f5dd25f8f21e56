"""Fixed-point encoding of float updates for aggregation in ``uint64``.

A value ``x`` is clipped to ``[-c, c]`` and mapped to ``[0, 2**bits - 1]`` with stochastic
rounding: ``q = floor(s) + [u < s - floor(s)]`` for ``s = (clip(x) + c) * (2**bits - 1) / (2c)``
and ``u`` uniform in ``[0, 1)``. Decoding is ``q * 2c / (2**bits - 1) - c``.

Error bound. Write ``step = 2c / (2**bits - 1)``. For every value the decoded result differs from
``clip(x, -c, c)`` by less than one ``step``, and the difference has expectation zero (stochastic
rounding is unbiased). A weighted average of decoded values is a convex combination, so it too is
within one ``step`` of the weighted average of the clipped inputs, with zero expected error.
Values outside ``[-c, c]`` lose ``|x| - c`` to clipping, which is not bounded by the encoding:
:meth:`Quantizer.quantize` returns how many values it clipped so the client can notice.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from fedfm.errors import ConfigError

# Quantized values and their sums must stay exact in float64 (53-bit significand).
MAX_QUANTIZATION_BITS = 52


def rounding_generator() -> np.random.Generator:
    """A generator for stochastic rounding, seeded from the operating system.

    Rounding needs unpredictability, not secrecy; a private generator keeps the global numpy
    state (which other code may seed) out of it.
    """
    return np.random.default_rng(int.from_bytes(os.urandom(32), "little"))


@dataclass(frozen=True)
class Quantizer:
    """Stochastic fixed-point encoding of ``[-clipping_range, clipping_range]`` in ``bits`` bits."""

    clipping_range: float
    bits: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clipping_range) and self.clipping_range > 0):
            raise ConfigError(
                f"clipping_range must be a positive finite number, got {self.clipping_range}"
            )
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise ConfigError(f"quantization_bits must be an int, got {self.bits!r}")
        if not 1 <= self.bits <= MAX_QUANTIZATION_BITS:
            raise ConfigError(
                f"quantization_bits must be in 1..{MAX_QUANTIZATION_BITS} (quantized sums must "
                f"stay exact in float64), got {self.bits}"
            )

    @property
    def max_level(self) -> int:
        """The largest quantized value, ``2**bits - 1``."""
        return (1 << self.bits) - 1

    @property
    def step(self) -> float:
        """One step ``2c / (2**bits - 1)``: the bound on each value's rounding error."""
        return 2 * self.clipping_range / self.max_level

    def quantize(self, values: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        """Encode ``values`` as ``uint64`` in ``[0, 2**bits - 1]``, and count the clipped ones.

        Callers must pass finite values (NaN has no place in the range).
        """
        values = np.asarray(values, dtype=np.float64)
        c = self.clipping_range
        clipped = int(np.count_nonzero(np.abs(values) > c))
        scaled = (np.clip(values, -c, c) + c) * (self.max_level / (2 * c))
        floor = np.floor(scaled)
        rounded = floor + (rng.random(scaled.shape) < scaled - floor)
        # float rounding of ``scaled`` may land a hair above max_level at x == c
        return np.minimum(rounded, self.max_level).astype(np.uint64), clipped

    def dequantize(self, levels: np.ndarray) -> np.ndarray:
        """Decode (possibly fractional, e.g. averaged) levels back to ``[-c, c]`` in float64."""
        return np.asarray(levels, dtype=np.float64) * self.step - self.clipping_range
