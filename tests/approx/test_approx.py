"""Error bounds, domains and shared arithmetic of the FHE-friendly approximations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedfm.approx import (
    QUAD_GELU,
    ApproxConfig,
    ApproxLayerNorm,
    ApproxSoftmax,
    GoldschmidtInverseSpec,
    calibrate,
    check_domain,
    clamped_count,
    evaluate_inv_sqrt,
    evaluate_inverse,
    newton_inv_sqrt,
    polyval,
    reset_clamped,
    set_domain_policy,
    taylor_exp,
)
from fedfm.approx.evaluate import powers
from fedfm.errors import ApproximationDomainError, ConfigError


class CountingValue:
    """A scalar that records the multiplicative depth of every product, like a CKKS level."""

    def __init__(self, value: float, depth: int = 0) -> None:
        self.value, self.depth = value, depth

    def _wrap(self, other: object) -> CountingValue:
        return other if isinstance(other, CountingValue) else CountingValue(float(other), -1)

    def __add__(self, other: object) -> CountingValue:
        o = self._wrap(other)
        return CountingValue(self.value + o.value, max(self.depth, o.depth))

    __radd__ = __add__

    def __sub__(self, other: object) -> CountingValue:
        o = self._wrap(other)
        return CountingValue(self.value - o.value, max(self.depth, o.depth))

    def __rsub__(self, other: object) -> CountingValue:
        return CountingValue(float(other) - self.value, self.depth)

    def __mul__(self, other: object) -> CountingValue:
        o = self._wrap(other)
        # a constant factor (depth -1) costs one level, like CKKS multiply-plain + rescale
        return CountingValue(self.value * o.value, max(self.depth, o.depth, 0) + 1)


@pytest.mark.parametrize("degree", [2, 4, 6, 8, 10, 16])
def test_taylor_exp_error_within_lagrange_bound_on_domain(degree: int) -> None:
    spec = taylor_exp(degree)
    x = torch.linspace(*spec.domain, 20001, dtype=torch.float64)
    error = (polyval(spec, x) - x.exp()).abs().max().item()
    assert error <= spec.max_abs_error
    # the bound is the remainder term, so it is not loose by orders of magnitude
    assert error >= spec.max_abs_error / 50


def test_taylor_exp_error_grows_outside_domain() -> None:
    spec = taylor_exp(6)
    outside = torch.tensor([2.0 * spec.domain[1]], dtype=torch.float64)
    assert (polyval(spec, outside) - outside.exp()).abs().item() > spec.max_abs_error
    with pytest.raises(ApproximationDomainError, match=r"\[-4, 4\]"):
        check_domain(outside, spec.domain, what="exp input")


def test_even_taylor_degree_is_positive_everywhere() -> None:
    x = torch.linspace(-50, 50, 10001, dtype=torch.float64)
    for degree in (2, 4, 6, 8):
        assert polyval(taylor_exp(degree), x).min().item() > 0


def test_quad_gelu_matches_paper_coefficients_and_documented_error() -> None:
    x = torch.linspace(*QUAD_GELU.domain, 20001, dtype=torch.float64)
    assert torch.allclose(polyval(QUAD_GELU, x), 0.125 * x**2 + 0.25 * x + 0.5)
    error = (polyval(QUAD_GELU, x) - torch.nn.functional.gelu(x)).abs().max().item()
    assert error <= QUAD_GELU.max_abs_error
    assert error > QUAD_GELU.max_abs_error - 0.01


@pytest.mark.parametrize("iterations", [2, 4, 7, 10])
def test_goldschmidt_matches_closed_form_error(iterations: int) -> None:
    spec = GoldschmidtInverseSpec(iterations)
    y = np.linspace(0.05, 1.95, 2001)
    relative = np.abs(evaluate_inverse(spec, y) * y - 1.0)
    expected = np.abs(1.0 - y) ** (2 ** (iterations + 1))
    np.testing.assert_allclose(relative, expected, atol=1e-12)


def test_goldschmidt_diverges_outside_its_domain() -> None:
    spec = GoldschmidtInverseSpec(7)
    inside, outside = np.array([0.5]), np.array([2.5])
    assert abs(evaluate_inverse(spec, inside)[0] - 2.0) < 1e-9
    assert abs(evaluate_inverse(spec, outside)[0]) > 1e6


@pytest.mark.parametrize("iterations", [3, 5, 6])
def test_newton_inv_sqrt_within_stated_error(iterations: int) -> None:
    spec = newton_inv_sqrt(iterations)
    u = np.linspace(*spec.domain, 20001)
    relative = np.abs(evaluate_inv_sqrt(spec, u) * np.sqrt(u) - 1.0).max()
    assert relative <= spec.max_rel_error * (1 + 1e-9)
    assert spec.max_rel_error < {3: 0.2, 5: 2e-3, 6: 1e-5}[iterations]


def test_newton_inv_sqrt_is_wrong_outside_domain() -> None:
    spec = newton_inv_sqrt(5)
    u = np.array([1e-4, 1.5])  # below the domain's low end, above its top
    relative = np.abs(evaluate_inv_sqrt(spec, u) * np.sqrt(u) - 1.0)
    assert (relative > 0.1).all()


def test_same_evaluator_on_numpy_and_torch() -> None:
    x = np.linspace(-3, 3, 101)
    for spec in (taylor_exp(6), QUAD_GELU):
        np.testing.assert_allclose(polyval(spec, x), polyval(spec, torch.tensor(x)).numpy())
    y = np.linspace(0.1, 1.9, 101)
    np.testing.assert_allclose(
        evaluate_inverse(GoldschmidtInverseSpec(7), y),
        evaluate_inverse(GoldschmidtInverseSpec(7), torch.tensor(y)).numpy(),
    )


def test_power_tree_and_stated_depths() -> None:
    table = powers(CountingValue(1.1), 16)
    for k, value in table.items():
        assert value.depth == (math.ceil(math.log2(k)) if k > 1 else 0)
        assert value.value == pytest.approx(1.1**k)
    for degree in (2, 6, 16):
        spec = taylor_exp(degree)
        assert polyval(spec, CountingValue(0.3)).depth == spec.depth
    inverse = GoldschmidtInverseSpec(7)
    assert evaluate_inverse(inverse, CountingValue(0.5)).depth == inverse.depth
    inv_sqrt = newton_inv_sqrt(5)
    assert evaluate_inv_sqrt(inv_sqrt, CountingValue(0.5)).depth == inv_sqrt.depth


@pytest.mark.parametrize(
    "build",
    [
        lambda: taylor_exp(0),
        lambda: taylor_exp(-3),
        lambda: GoldschmidtInverseSpec(0),
        lambda: newton_inv_sqrt(0),
        lambda: newton_inv_sqrt(5, low=0.0),
        lambda: ApproxConfig.build(exp_degree=0),
    ],
)
def test_invalid_specs_raise_config_error(build) -> None:
    with pytest.raises(ConfigError):
        build()


def test_approx_softmax_is_close_to_softmax_and_sums_to_one() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 17, 17) * 0.5  # mostly inside [-2, 2], where Taylor is accurate
    module = ApproxSoftmax(taylor_exp(6), GoldschmidtInverseSpec(7))
    calibrate(module, [logits])
    approx = module(logits)
    torch.testing.assert_close(approx.sum(-1), torch.ones(4, 3, 17), atol=1e-3, rtol=0)
    assert (approx - logits.softmax(-1)).abs().max() < 5e-3
    # the division alone converges: exact exp + Goldschmidt is softmax to float precision
    division_only = ApproxSoftmax(None, GoldschmidtInverseSpec(7))
    calibrate(division_only, [logits])
    assert (division_only(logits) - logits.softmax(-1)).abs().max() < 1e-5
    assert torch.equal(ApproxSoftmax(None, None)(logits), logits.softmax(-1))


def test_uncalibrated_division_refuses_to_run() -> None:
    with pytest.raises(ApproximationDomainError, match="calibrate"):
        ApproxSoftmax(taylor_exp(6), GoldschmidtInverseSpec(7))(torch.randn(2, 5))


def test_layer_norm_approximation_and_domain_policies() -> None:
    torch.manual_seed(0)
    exact = torch.nn.LayerNorm(32, eps=1e-6)
    torch.nn.init.normal_(exact.weight)
    torch.nn.init.normal_(exact.bias)
    module = ApproxLayerNorm(32, eps=1e-6, spec=newton_inv_sqrt(6))
    module.load_state_dict(exact.state_dict(), strict=False)
    # token variances spanning a factor 40, inside the domain's factor 100 less the 1.25 margin
    scales = torch.logspace(-0.4, 0.4, 64).reshape(64, 1)
    x = torch.randn(64, 32) * scales
    calibrate(module, [x])
    torch.testing.assert_close(module(x), exact(x), atol=1e-3, rtol=1e-3)

    too_large = x * 10  # variance 100x the calibrated bound
    module.domain_policy = "raise"
    with pytest.raises(ApproximationDomainError, match="layer-norm variance"):
        module(too_large)
    set_domain_policy(module, "clamp")
    module(too_large)
    assert clamped_count(module) > 0
    # below the domain Newton's iteration under-estimates 1/sqrt but stays bounded: no clamp,
    # so an encrypted evaluator (which cannot clamp) computes the same
    reset_clamped(module)
    tiny = module(x * 0.01)
    assert clamped_count(module) == 0
    exact_scale = exact(x * 0.01).abs().max()
    assert torch.isfinite(tiny).all() and tiny.abs().max() <= exact_scale
    with pytest.raises(ConfigError):
        set_domain_policy(module, "ignore")  # type: ignore[arg-type]


def test_failed_calibration_keeps_previous_bounds() -> None:
    module = ApproxSoftmax(taylor_exp(6), GoldschmidtInverseSpec(7))
    calibrate(module, [torch.randn(3, 8)])
    bound = module.input_bound.clone()

    def broken_batches():
        yield torch.randn(3, 8) * 3
        raise RuntimeError("data source failed")

    with pytest.raises(RuntimeError):
        calibrate(module, broken_batches())
    assert torch.equal(module.input_bound, bound)


def test_config_settings_round_trip_and_description() -> None:
    config = ApproxConfig.build(exp_degree=8, inverse_iterations=None, gelu=False)
    assert ApproxConfig.build(**config.settings()) == config
    described = ApproxConfig().describe()
    assert described["exp"]["coefficients"][2] == 0.5
    assert described["inverse"]["iterations"] == 7
    assert tuple(described["gelu"]["coefficients"]) == (0.5, 0.25, 0.125)
