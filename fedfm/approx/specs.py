"""Descriptions of the FHE-friendly approximations: the one source of truth for their numbers.

A spec is a frozen, serialisable description (coefficients, iteration counts, input domain) of a
computation that uses only additions and multiplications, so that the same spec is evaluated by
torch during distillation, by numpy in tests and by CKKS on ciphertexts (``fedfm.approx.evaluate``).

Spec: ``001_9fca09e62d37909e.txt`` §3.1 (Eq. 1-3), App. "Approximation results" (Algorithm 1).

Multiplicative depth
    Each spec states the number of sequential multiplications its evaluator performs (the
    multiplicative depth an encrypted evaluation consumes), counting a multiplication by a
    plaintext constant as one level, as CKKS rescales after it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fedfm.errors import ConfigError


def _power_depth(power: int) -> int:
    """Depth of computing ``x**power`` by the balanced power tree of ``evaluate.polyval``."""
    return math.ceil(math.log2(power)) if power > 1 else 0


@dataclass(frozen=True)
class PolySpec:
    """A polynomial ``sum(coefficients[k] * x**k)`` with coefficients in ascending order.

    Parameters
    ----------
    name:
        What the polynomial approximates, e.g. ``"exp_taylor_6"``.
    coefficients:
        Ascending coefficients (as in TenSEAL's ``polyval``): ``coefficients[k]`` multiplies
        ``x**k``.
    domain:
        Closed input interval ``(low, high)`` on which ``max_abs_error`` holds. Outside it the
        polynomial is still evaluated (the encrypted evaluator computes the same polynomial), but
        the error bound no longer applies; ``evaluate.check_domain`` raises for callers that need
        it.
    max_abs_error:
        Proven or measured bound of ``|p(x) - f(x)|`` on ``domain`` (see each factory).
    """

    name: str
    coefficients: tuple[float, ...]
    domain: tuple[float, float]
    max_abs_error: float

    def __post_init__(self) -> None:
        if not self.coefficients:
            raise ConfigError(f"PolySpec {self.name!r} needs at least one coefficient")
        if not self.domain[0] < self.domain[1]:
            raise ConfigError(f"PolySpec {self.name!r}: domain {self.domain} is empty")

    @property
    def degree(self) -> int:
        """Highest power with a non-zero coefficient."""
        nonzero = [k for k, c in enumerate(self.coefficients) if c != 0.0]
        return max(nonzero, default=0)

    @property
    def depth(self) -> int:
        """Multiplicative depth: the deepest power plus one constant multiplication."""
        if self.degree == 0:
            return 0
        return _power_depth(self.degree) + 1


@dataclass(frozen=True)
class GoldschmidtInverseSpec:
    """Goldschmidt's iteration for ``1/y`` on ``y`` in ``(0, 2)`` (Eq. 3, Algorithm 1).

    ``a_0 = 2 - y``, ``b_0 = 1 - y``; for ``n < iterations``: ``b <- b**2``, ``a <- a * (1 + b)``.
    After ``d`` iterations ``a_d = (1 - (1 - y)**(2**(d+1))) / y``, so the relative error is
    ``|1 - y|**(2**(d+1))``: exact in the limit on ``(0, 2)``, divergent outside it. Callers scale
    their input by a bound fixed in plaintext from data so that it falls in this domain.
    """

    iterations: int
    domain: tuple[float, float] = (0.0, 2.0)
    # The input bound is the largest value seen in calibration: calibration data then lands in
    # (0, 1] and unseen data may be up to twice as large before the iteration stops converging.
    calibration_margin: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ConfigError(
                f"inverse iterations must be an integer >= 1, got {self.iterations!r}"
            )

    @property
    def depth(self) -> int:
        """``b_n`` is at level ``n`` and ``a_n`` at level ``n + 1``."""
        return self.iterations + 1

    def relative_error(self, y: float) -> float:
        """Exact relative error of the iteration at ``y`` (the closed form above)."""
        return abs(1.0 - y) ** (2 ** (self.iterations + 1))


@dataclass(frozen=True)
class NewtonInvSqrtSpec:
    """Newton's iteration for ``1/sqrt(u)`` on a domain ``(low, high]`` inside ``(0, 1]``.

    Start from the linear least-squares fit ``y_0 = c_0 + c_1 u`` of ``1/sqrt`` on the domain, then
    ``y <- 1.5 y - 0.5 u y**3`` (no division: only additions and multiplications). Each iteration
    costs two levels (``0.5 u * y`` and ``y**2`` in parallel, then their product). The iteration
    converges quadratically once close; on ``(0.01, 1]`` five iterations give a relative error
    below 2e-3 and six below 1e-5 (``tests/approx/test_approx.py`` checks the stated bound).
    Used for LayerNorm's ``1/sqrt(var + eps)`` after scaling the variance by a calibrated bound.
    """

    iterations: int
    domain: tuple[float, float]
    initial: tuple[float, float]
    max_rel_error: float
    # The input bound is 1.25x the largest variance seen in calibration, leaving 25% headroom
    # below the domain's top for unseen data.
    calibration_margin: float = 1.25

    def __post_init__(self) -> None:
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ConfigError(
                f"inverse-sqrt iterations must be an integer >= 1, got {self.iterations!r}"
            )
        low, high = self.domain
        if not 0.0 < low < high <= 1.0:
            raise ConfigError(
                f"inverse-sqrt domain must satisfy 0 < low < high <= 1, got {self.domain}"
            )

    @property
    def depth(self) -> int:
        """One level for the linear start, two per iteration."""
        return 1 + 2 * self.iterations


def taylor_exp(degree: int = 6, *, radius: float = 4.0) -> PolySpec:
    """Truncated Taylor series of ``exp`` (Eq. 1): ``sum_{k<=d} x**k / k!``.

    The error bound on ``[-radius, radius]`` is the Lagrange remainder
    ``e**radius * radius**(d+1) / (d+1)!``. Even degrees are positive everywhere, so the softmax
    built from them never produces negative weights; odd degrees are allowed but go negative for
    large negative inputs.
    """
    if not isinstance(degree, int) or degree < 1:
        raise ConfigError(f"exp degree must be an integer >= 1, got {degree!r}")
    if radius <= 0:
        raise ConfigError(f"exp radius must be > 0, got {radius}")
    coefficients = tuple(1.0 / math.factorial(k) for k in range(degree + 1))
    bound = math.exp(radius) * radius ** (degree + 1) / math.factorial(degree + 1)
    return PolySpec(f"exp_taylor_{degree}", coefficients, (-radius, radius), bound)


# GELU(x) ~ 0.125 x^2 + 0.25 x + 0.5 (Eq. 2, the "Quad" of MPCFormer). It is a replacement that
# distillation adapts the weights to, not a close approximation: |Quad - GELU| is 0.5 at x = 0
# and at most 0.561 on [-2, 2] (at x = -0.52; tests measure it).
QUAD_GELU = PolySpec("gelu_quad", (0.5, 0.25, 0.125), (-2.0, 2.0), 0.561)


def _gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU ``x * Phi(x)`` (erf form), in float64."""
    erf = np.vectorize(math.erf)
    return np.asarray(0.5 * x * (1.0 + erf(x / math.sqrt(2.0))), dtype=np.float64)


def gelu_least_squares(degree: int = 2, *, radius: float = 4.0) -> PolySpec:
    """The degree-``degree`` least-squares fit of GELU on ``[-radius, radius]`` (uniform grid).

    Unlike :data:`QUAD_GELU` (a fixed replacement the weights must adapt to), this is a close
    fit: on ``[-4, 4]`` the quadratic is within 0.26 of GELU and the quartic within 0.093
    (``max_abs_error`` is measured on the fitting grid; tests check it). A pretrained encoder's
    GELU inputs reach far beyond any such domain (MiniLM's: about -17 to +25), so the text
    model pairs the fit with a per-channel input scale (:class:`fedfm.approx.ChannelScaledGELU`)
    that brings each channel's calibrated range into ``[-radius, radius]``; the scale folds into
    the linear layers around the activation, so an encrypted evaluator sees only this polynomial.
    Depth: 2 for degree 2, 3 for degree 3 or 4 (:attr:`PolySpec.depth`).
    """
    if not isinstance(degree, int) or degree < 1:
        raise ConfigError(f"GELU fit degree must be an integer >= 1, got {degree!r}")
    if radius <= 0:
        raise ConfigError(f"GELU fit radius must be > 0, got {radius}")
    grid = np.linspace(-radius, radius, 4001)
    target = _gelu(grid)
    coefficients = np.polynomial.polynomial.polyfit(grid, target, degree)
    # GELU - x/2 is even: the fit's odd terms above the first vanish up to rounding; drop them
    # so that the stated degree (and depth) is the real one.
    coefficients[np.abs(coefficients) < 1e-12] = 0.0
    error = float(np.max(np.abs(np.polynomial.polynomial.polyval(grid, coefficients) - target)))
    return PolySpec(
        f"gelu_lsq_{degree}_r{radius:g}",
        tuple(float(c) for c in coefficients),
        (-radius, radius),
        error,
    )


def newton_inv_sqrt(iterations: int = 5, *, low: float = 0.01) -> NewtonInvSqrtSpec:
    """Build the inverse-square-root spec on ``(low, 1]`` with its least-squares starting line."""
    if not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"inverse-sqrt iterations must be an integer >= 1, got {iterations!r}")
    if not 0.0 < low < 1.0:
        raise ConfigError(f"inverse-sqrt domain low end must be in (0, 1), got {low}")
    grid = np.linspace(low, 1.0, 4001)
    design = np.stack([np.ones_like(grid), grid], axis=1)
    c0, c1 = np.linalg.lstsq(design, 1.0 / np.sqrt(grid), rcond=None)[0]
    y = c0 + c1 * grid
    for _ in range(iterations):
        y = 1.5 * y - 0.5 * grid * y**3
    error = float(np.max(np.abs(y * np.sqrt(grid) - 1.0)))
    return NewtonInvSqrtSpec(iterations, (low, 1.0), (float(c0), float(c1)), error)


@dataclass(frozen=True)
class ApproxConfig:
    """Which non-linearities of a ViT are replaced, and by what. ``None`` keeps the exact function.

    Defaults follow App. D.2: exp degree 6, 7 Goldschmidt iterations, quadratic GELU; LayerNorm's
    ``1/sqrt`` by Newton's method (:func:`newton_inv_sqrt`).
    """

    exp: PolySpec | None = field(default_factory=taylor_exp)
    inverse: GoldschmidtInverseSpec | None = field(
        default_factory=lambda: GoldschmidtInverseSpec(7)
    )
    gelu: PolySpec | None = QUAD_GELU
    inv_sqrt: NewtonInvSqrtSpec | None = field(default_factory=newton_inv_sqrt)
    # Per-channel calibrated input scale around the GELU polynomial (text encoders, see
    # gelu_least_squares); off for the ViT, whose default is the paper's Quad alone.
    gelu_channel_scale: bool = False

    @classmethod
    def exact(cls) -> ApproxConfig:
        """Every non-linearity exact: the student then computes exactly what the teacher does."""
        return cls(exp=None, inverse=None, gelu=None, inv_sqrt=None)

    @classmethod
    def build(
        cls,
        *,
        exp_degree: int | None = 6,
        inverse_iterations: int | None = 7,
        gelu: bool = True,
        inv_sqrt_iterations: int | None = 5,
        gelu_degree: int | None = None,
        gelu_radius: float = 4.0,
        gelu_channel_scale: bool = False,
    ) -> ApproxConfig:
        """Build from plain settings; ``None`` (or ``gelu=False``) keeps that function exact.

        ``gelu_degree`` ``None`` is the paper's :data:`QUAD_GELU`; a degree is the least-squares
        fit :func:`gelu_least_squares` on ``[-gelu_radius, gelu_radius]``.
        """
        if gelu_channel_scale and not gelu:
            raise ConfigError("gelu_channel_scale needs an approximated GELU (gelu=True)")
        if not gelu:
            gelu_spec = None
        elif gelu_degree is None:
            gelu_spec = QUAD_GELU
        else:
            gelu_spec = gelu_least_squares(gelu_degree, radius=gelu_radius)
        return cls(
            exp=None if exp_degree is None else taylor_exp(exp_degree),
            inverse=None
            if inverse_iterations is None
            else GoldschmidtInverseSpec(inverse_iterations),
            gelu=gelu_spec,
            inv_sqrt=None if inv_sqrt_iterations is None else newton_inv_sqrt(inv_sqrt_iterations),
            gelu_channel_scale=gelu_channel_scale,
        )

    def settings(self) -> dict[str, Any]:
        """The plain settings :meth:`build` takes; stored in checkpoints and reports.

        The GELU-fit keys appear only for a fitted GELU, so the paper's configuration keeps the
        four keys ViT checkpoints store.
        """
        out: dict[str, Any] = {
            "exp_degree": None if self.exp is None else self.exp.degree,
            "inverse_iterations": None if self.inverse is None else self.inverse.iterations,
            "gelu": self.gelu is not None,
            "inv_sqrt_iterations": None if self.inv_sqrt is None else self.inv_sqrt.iterations,
        }
        if self.gelu is not None and self.gelu != QUAD_GELU:
            out["gelu_degree"] = self.gelu.degree
            out["gelu_radius"] = self.gelu.domain[1]
        if self.gelu_channel_scale:
            out["gelu_channel_scale"] = True
        return out

    def describe(self) -> dict[str, Any]:
        """Full description (coefficients, domains, depths) for reports and encrypted backends."""
        out: dict[str, Any] = {}
        for key in ("exp", "inverse", "gelu", "inv_sqrt"):
            spec = getattr(self, key)
            out[key] = None if spec is None else {**asdict(spec), "depth": spec.depth}
        if self.gelu_channel_scale:
            out["gelu_channel_scale"] = True
        return out
