"""The usual MPC approximations, as instruction sequences on shares (the full secret-sharing
baseline, and the hardened CENTAUR's embedding LayerNorm).

Each function appends instructions to a :class:`Builder` and states method, rounds and domain:

* :func:`exp` — CrypTen's limit approximation ``(1 + x / 2^8)^(2^8)``: 8 squarings (8 rounds);
  accurate for ``x`` in about ``[-16, 8]`` (relative error below 3 % at ``x = -8``; below
  ``-256`` the base turns negative and the result is meaningless).
* :func:`reciprocal` — CrypTen's Newton-Raphson ``y <- y (2 - x y)`` from
  ``y_0 = 3 exp(0.5 - x) + 0.003``, 10 iterations (8 + 20 rounds); converges for ``x`` in about
  ``(0, 600)``.
* :func:`inverse_sqrt` — CrypTen's Newton ``y <- y (3 - x y^2) / 2`` from
  ``y_0 = 2.2 exp(-(x/2 + 0.2)) + 0.2 - x/1024``, after scaling the input by a public
  calibration constant ``c`` (``rsqrt(x) = rsqrt(x / c) / sqrt(c)``); 6 iterations (8 + 18
  rounds); accurate for ``x / c`` in about ``[0.05, 50]``.
* :func:`polynomial` — a least-squares Chebyshev fit of a function on ``[-bound, bound]``
  evaluated on ``x / bound`` by a power tree (``ceil(log2 degree)`` rounds); used for SiLU and
  tanh, which CrypTen approximates through erf/sigmoid with narrower domains.
* :func:`absolute` — ``|x| = x^2 rsqrt(x^2)`` (:func:`inverse_sqrt`, ``2 + 26`` rounds) and
  :func:`rectified_polynomial` — GeLU as ``relu(x)`` plus a polynomial of the small bump
  ``gelu - relu``: a polynomial of GeLU itself over MiniLM's ``[-27, 27]`` errs by 0.7 per
  entry (the kink at 0), too much for six layers.

CrypTen's softmax subtracts the row maximum, found with secure comparisons (binary circuits:
tens of rounds per comparison tree level, ``log2 n`` levels). The baseline here subtracts the
row *mean* instead (local and exact; by Jensen the mean of ``exp(x - mean)`` is at least 1, so
the reciprocal's input stays in its domain while ``max - mean`` is below about 6, 17 with the
public margin), at temperature 4 (scores / 4) and sharpens back by two squarings, each
renormalised by a reciprocal (30 rounds each): trained encoders have rows spread by 40 and
more (MiniLM's layer 0), beyond what the 16-bit fixed point holds in one exponential. The
sharpening's 60 rounds per layer take the place of CrypTen's ``log2 n`` comparison levels
(about as many rounds at 32 tokens, fewer bytes: no binary circuits), so the baseline is no
longer clearly cheaper than CrypTen's softmax, only comparable: speedups measured against it
are estimates of CrypTen's, not lower bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fedfm.protocols.centaur.engine import (
    CloudApply,
    Instruction,
    Local,
    OpenToClient,
    Parallel,
    Party,
    Product,
    Program,
    value,
)

EXP_ITERATIONS = 8
RECIPROCAL_ITERATIONS = 10
INVERSE_SQRT_ITERATIONS = 6
POLYNOMIAL_DEGREE = 10


@dataclass
class Builder:
    """Appends uniquely named instructions to a :class:`Program`."""

    fraction: int
    program: Program = field(default_factory=Program)
    scope: str = ""  # the layer type the next instructions belong to (for per-type costs)
    _count: int = 0

    def fresh(self, base: str) -> str:
        self._count += 1
        return f"{base}#{self._count}@{self.scope}" if self.scope else f"{base}#{self._count}"

    def add(self, instruction: Instruction) -> None:
        self.program.add(instruction)

    def local(self, base: str, action: Callable[[Party], None]) -> None:
        self.add(Local(self.fresh(base), action))

    def product(
        self,
        base: str,
        out: str,
        x: Callable[[Party], np.ndarray] | str,
        y: Callable[[Party], np.ndarray] | str,
        x_shape: tuple[int, ...],
        y_shape: tuple[int, ...],
        *,
        op: str = "matmul",
        truncate: bool = True,
    ) -> Product:
        return Product(
            self.fresh(base),
            out,
            value(x) if isinstance(x, str) else x,
            value(y) if isinstance(y, str) else y,
            tuple(x_shape),
            tuple(y_shape),
            op,
            self.fraction if truncate else 0,
        )

    def multiply(
        self,
        base: str,
        out: str,
        x: str,
        y: str,
        shape: tuple[int, ...],
        y_shape: tuple[int, ...] | None = None,
    ) -> None:
        """``out = x * y`` elementwise (``y`` may broadcast), truncated."""
        self.add(self.product(base, out, x, y, shape, y_shape or shape, op="mul"))

    def parallel(self, base: str, parts: list[Instruction]) -> None:
        self.add(Parallel(self.fresh(base), parts))

    def cloud(
        self,
        base: str,
        out: str,
        x: str,
        function: Callable[[Party, np.ndarray], np.ndarray],
        in_fraction: int,
    ) -> None:
        self.add(CloudApply(self.fresh(base), out, x, function, in_fraction, self.fraction))

    def open(self, x: str) -> None:
        self.add(OpenToClient(self.fresh("open"), x))

    # -- local arithmetic helpers -------------------------------------------------------------

    def scale(self, out: str, x: str, factor: float) -> None:
        """``out = x * factor`` (a public real), truncated."""
        f = self.fraction

        def action(party: Party) -> None:
            party.put(out, party.truncate(party.get(x) * _encoded(factor, f)))

        self.local("scale", action)

    def affine(self, out: str, x: str, factor: float, offset: float) -> None:
        """``out = x * factor + offset`` (public reals)."""
        f = self.fraction

        def action(party: Party) -> None:
            scaled = party.truncate(party.get(x) * _encoded(factor, f))
            party.put(out, scaled + party.constant(offset, f))

        self.local("affine", action)


def _encoded(real: float, fraction: int) -> np.uint64:
    return np.uint64(np.asarray(round(real * (1 << fraction)), dtype=np.int64).view(np.uint64))


# -- the approximations -------------------------------------------------------------------------


def exp(builder: Builder, out: str, x: str, shape: tuple[int, ...]) -> None:
    """``out = exp(x)`` by the limit approximation (module docstring)."""
    name = builder.fresh("exp")

    def start(party: Party) -> None:
        base = party.truncate(party.get(x), EXP_ITERATIONS)  # x / 2^8
        party.put(name, base + party.constant(1.0, builder.fraction))

    builder.local("exp", start)
    for _ in range(EXP_ITERATIONS):
        builder.multiply("exp.square", name, name, name, shape)
    builder.local("exp.done", lambda party: party.put(out, party.get(name)))


def reciprocal(
    builder: Builder,
    out: str,
    x: str,
    shape: tuple[int, ...],
    iterations: int = RECIPROCAL_ITERATIONS,
) -> None:
    """``out = 1 / x`` by Newton-Raphson (module docstring); from CrypTen's initial guess the
    iterate about doubles per iteration while ``x y`` is small, so an input down to ``e^-m``
    needs about ``1.45 m + 4`` iterations."""
    guess, y, xy = builder.fresh("recip.t"), builder.fresh("recip.y"), builder.fresh("recip.xy")
    builder.affine(guess, x, -1.0, 0.5)
    exp(builder, guess, guess, shape)
    builder.affine(y, guess, 3.0, 0.003)
    for _ in range(iterations):
        builder.multiply("recip.xy", xy, x, y, shape)
        builder.affine(xy, xy, -1.0, 2.0)
        builder.multiply("recip.y", y, y, xy, shape)
    builder.local("recip.done", lambda party: party.put(out, party.get(y)))


def inverse_sqrt(
    builder: Builder, out: str, x: str, shape: tuple[int, ...], calibration: float
) -> None:
    """``out = 1 / sqrt(x)`` by Newton after scaling by ``calibration`` (module docstring)."""
    (
        z,
        t,
        y,
        y2,
    ) = (builder.fresh(f"rsqrt.{n}") for n in ("z", "t", "y", "y2"))
    builder.scale(z, x, 1.0 / calibration)
    builder.affine(t, z, -0.5, -0.2)
    exp(builder, t, t, shape)
    f = builder.fraction

    def start(party: Party) -> None:
        first = party.truncate(party.get(t) * _encoded(2.2, f))
        linear = party.truncate(party.get(z) * _encoded(-1.0 / 1024.0, f))
        party.put(y, first + linear + party.constant(0.2, f))

    builder.local("rsqrt.y0", start)
    for _ in range(INVERSE_SQRT_ITERATIONS):
        builder.multiply("rsqrt.y2", y2, y, y, shape)
        builder.multiply("rsqrt.zy2", y2, z, y2, shape)
        builder.affine(y2, y2, -0.5, 1.5)
        builder.multiply("rsqrt.y", y, y, y2, shape)
    builder.scale(out, y, 1.0 / math.sqrt(calibration))


def chebyshev_power_coefficients(
    function: Callable[[np.ndarray], np.ndarray], bound: float, degree: int = POLYNOMIAL_DEGREE
) -> np.ndarray:
    """Ascending power-basis coefficients of a least-squares Chebyshev fit of
    ``t -> function(bound t)`` on ``[-1, 1]``."""
    nodes = np.cos(np.pi * (np.arange(4 * degree) + 0.5) / (4 * degree))
    fit = np.polynomial.chebyshev.Chebyshev.fit(
        nodes, function(bound * nodes), degree, domain=[-1, 1]
    )
    return np.asarray(fit.convert(kind=np.polynomial.Polynomial).coef, dtype=np.float64)


def polynomial(
    builder: Builder,
    out: str,
    x: str,
    shape: tuple[int, ...],
    coefficients: np.ndarray,
    bound: float,
) -> None:
    """``out = p(x / bound)`` with ascending ``coefficients``, by a power tree."""
    degree = len(coefficients) - 1
    powers = {1: builder.fresh("poly.p1")}
    builder.scale(powers[1], x, 1.0 / bound)
    done = 1
    while done < degree:
        parts: list[Instruction] = []
        for k in range(done + 1, min(2 * done, degree) + 1):
            powers[k] = builder.fresh(f"poly.p{k}")
            parts.append(
                builder.product(
                    "poly.power", powers[k], powers[done], powers[k - done], shape, shape, op="mul"
                )
            )
        builder.parallel("poly.round", parts)
        done = min(2 * done, degree)
    f = builder.fraction

    def combine(party: Party) -> None:
        total = party.constant(float(coefficients[0]), f)
        for k in range(1, degree + 1):
            total = total + party.truncate(
                party.get(powers[k]) * _encoded(float(coefficients[k]), f)
            )
        party.put(out, total)
        party.drop(*powers.values())

    builder.local("poly.sum", combine)


ABS_DOMAIN = 100.0  # |x| by x^2 rsqrt(x^2): x^2 / c up to 100, inside rsqrt's convergence


def absolute(builder: Builder, out: str, x: str, shape: tuple[int, ...], bound: float) -> None:
    """``out = |x|`` for ``x`` in ``[-bound, bound]``, as ``x^2 / sqrt(x^2)`` by
    :func:`inverse_sqrt` calibrated so that ``bound^2 / c = ABS_DOMAIN`` (accurate down to
    ``|x|`` about ``bound / 40``; below, the error is at most ``|x|``)."""
    square, inverse = builder.fresh("abs.sq"), builder.fresh("abs.inv")
    builder.multiply("abs.square", square, x, x, shape)
    inverse_sqrt(builder, inverse, square, shape, bound * bound / ABS_DOMAIN)
    builder.multiply("abs.root", out, square, inverse, shape)
    builder.local("abs.done", lambda party: party.drop(square, inverse))


def rectified_polynomial(
    builder: Builder,
    out: str,
    x: str,
    shape: tuple[int, ...],
    function: Callable[[np.ndarray], np.ndarray],
    bound: float,
) -> None:
    """``out = relu(x) + p(x)`` with ``p`` the Chebyshev fit of ``function - relu`` on
    ``[-bound, bound]``, ``relu(x) = (x + |x|) / 2`` by :func:`absolute`.

    GeLU and SiLU are relu plus a bump that vanishes a few units from 0; a polynomial of the
    whole function over a wide domain errs by the kink at 0 everywhere (degree 10 on
    ``[-27, 27]``, MiniLM's activations: 0.7 per entry, which the down projection sums into
    the residual stream), a polynomial of the bump by 0.09. The price is :func:`absolute`'s
    ``2 + 8 + 3 * INVERSE_SQRT_ITERATIONS`` rounds, in the range of the comparison a
    piecewise approximation (CrypTen's relu) needs instead."""
    magnitude, bump = builder.fresh("relu.abs"), builder.fresh("relu.bump")
    absolute(builder, magnitude, x, shape, bound)
    coefficients = chebyshev_power_coefficients(lambda v: function(v) - np.maximum(v, 0.0), bound)
    polynomial(builder, bump, x, shape, coefficients, bound)
    half = _encoded(0.5, builder.fraction)

    def combine(party: Party) -> None:
        relu = party.truncate((party.get(x) + party.get(magnitude)) * half)
        party.put(out, relu + party.get(bump))
        party.drop(magnitude, bump)

    builder.local("relu.sum", combine)


def layer_norm(
    builder: Builder,
    out: str,
    x: str,
    n: int,
    d: int,
    *,
    gain: str,
    bias: str | None,
    calibration: float,
    centred: bool = True,
    shared_weights: bool = False,
) -> None:
    """LayerNorm (``centred``) or RMSNorm on shares: mean locally, variance with one square,
    :func:`inverse_sqrt`, one product; ``gain``/``bias`` are weights of the party (plaintext Θ'
    entries, or shares when ``shared_weights``)."""
    f = builder.fraction
    xc, square, variance, inverse, normed = (
        builder.fresh(f"ln.{n_}") for n_ in ("xc", "sq", "var", "inv", "normed")
    )

    def centre(party: Party) -> None:
        values = party.get(x)
        if centred:
            mean = party.truncate(values.sum(axis=-1, keepdims=True) * _encoded(1.0 / d, f))
            values = values - mean
        party.put(xc, values)

    builder.local("ln.centre", centre)
    builder.multiply("ln.square", square, xc, xc, (n, d))

    def mean_square(party: Party) -> None:
        total = party.get(square).sum(axis=-1, keepdims=True)
        party.put(variance, party.truncate(total * _encoded(1.0 / d, f)))

    builder.local("ln.variance", mean_square)
    inverse_sqrt(builder, inverse, variance, (n, 1), calibration)
    builder.multiply("ln.normalise", normed, xc, inverse, (n, d), (n, 1))
    if shared_weights:
        gain_value = builder.fresh("ln.gain")
        builder.local(
            "ln.gain",
            lambda party: party.put(gain_value, np.broadcast_to(party.weight(gain), (n, d)).copy()),
        )
        builder.multiply("ln.scale", out, normed, gain_value, (n, d))
        if bias is not None:
            builder.local(
                "ln.bias", lambda party: party.put(out, party.get(out) + party.weight(bias))
            )
        return

    def affine(party: Party) -> None:
        result = party.truncate(party.get(normed) * party.encoded(gain))
        if bias is not None:
            result = result + party.constant(party.weight(bias), f)
        party.put(out, result)
        party.drop(xc, square, variance, inverse, normed)

    builder.local("ln.affine", affine)


__all__ = [
    "Builder",
    "CloudApply",
    "absolute",
    "chebyshev_power_coefficients",
    "exp",
    "inverse_sqrt",
    "layer_norm",
    "polynomial",
    "reciprocal",
    "rectified_polynomial",
]
