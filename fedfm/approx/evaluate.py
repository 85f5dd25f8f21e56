"""Evaluators for the approximation specs, written against a tiny arithmetic interface.

Every function here uses only ``+``, ``-`` and ``*`` between values and with Python floats, so the
same code runs on torch tensors, numpy arrays and TenSEAL ``CKKSVector`` ciphertexts, and the
sequence of multiplications (hence the multiplicative depth) is the one each spec documents.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from fedfm.approx.specs import GoldschmidtInverseSpec, NewtonInvSqrtSpec, PolySpec
from fedfm.errors import ApproximationDomainError


class Arithmetic(Protocol):
    """What a value must support to be evaluated: ring operations with itself and with floats."""

    def __add__(self, other: Any) -> Any: ...
    def __radd__(self, other: Any) -> Any: ...
    def __sub__(self, other: Any) -> Any: ...
    def __rsub__(self, other: Any) -> Any: ...
    def __mul__(self, other: Any) -> Any: ...


T = TypeVar("T", bound=Arithmetic)


def powers(x: T, degree: int) -> dict[int, T]:
    """Powers ``x**1 .. x**degree`` by a balanced tree; ``x**k`` has depth ``ceil(log2 k)``.

    ``x**k = x**(2**m) * x**(k - 2**m)`` with ``2**m`` the largest power of two below ``k``.
    """
    table: dict[int, T] = {1: x}
    for k in range(2, degree + 1):
        half = 1 << ((k - 1).bit_length() - 1)
        table[k] = table[half] * table[k - half]
    return table


def polyval(spec: PolySpec, x: T) -> T:
    """Evaluate ``spec`` at ``x`` (element-wise for tensors and ciphertext slots)."""
    table = powers(x, spec.degree) if spec.degree else {}
    result: Any = None
    for k in range(1, spec.degree + 1):
        coefficient = spec.coefficients[k]
        if coefficient == 0.0:
            continue
        term = table[k] * coefficient
        result = term if result is None else result + term
    if result is None:  # a constant polynomial
        return x * 0.0 + spec.coefficients[0]
    return result + spec.coefficients[0]


def evaluate_inverse(spec: GoldschmidtInverseSpec, y: T) -> T:
    """Algorithm 1: ``1/y`` for ``y`` in ``(0, 2)``; the caller scales ``y`` into that domain."""
    a = 2.0 - y
    b = 1.0 - y
    for _ in range(spec.iterations):
        b = b * b
        a = a * (1.0 + b)
    return a


def evaluate_inv_sqrt(spec: NewtonInvSqrtSpec, u: T) -> T:
    """``1/sqrt(u)`` for ``u`` in ``spec.domain`` by Newton's iteration from a linear start."""
    c0, c1 = spec.initial
    y = u * c1 + c0
    half_u = u * 0.5
    for _ in range(spec.iterations):
        # 1.5 y - (0.5 u y) * y**2: the two factors are computed at the same level.
        y = y * 1.5 - (half_u * y) * (y * y)
    return y


def value_range(values: torch.Tensor | np.ndarray) -> tuple[float, float]:
    """Smallest and largest entry of a plaintext tensor or array."""
    if isinstance(values, torch.Tensor):
        return float(values.min()), float(values.max())
    return float(np.min(values)), float(np.max(values))


def check_domain(
    values: torch.Tensor | np.ndarray,
    domain: tuple[float, float],
    *,
    what: str,
    open_interval: bool = False,
) -> None:
    """Raise :class:`ApproximationDomainError` unless every plaintext value lies in ``domain``.

    ``open_interval`` excludes both ends (the Goldschmidt domain is the open interval ``(0, 2)``).
    """
    low, high = domain
    seen_low, seen_high = value_range(values)
    if open_interval:
        inside = low < seen_low and seen_high < high
    else:
        inside = low <= seen_low and seen_high <= high
    if not inside:
        left, right = ("(", ")") if open_interval else ("[", "]")
        raise ApproximationDomainError(
            f"{what}: inputs span [{seen_low:.4g}, {seen_high:.4g}], outside the valid domain "
            f"{left}{low:.4g}, {high:.4g}{right}; recalibrate its input bound on such data"
        )
