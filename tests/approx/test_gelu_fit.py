"""The least-squares GELU fit and the channel-scaled GELU of the text encoder."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfm.approx import (
    QUAD_GELU,
    ApproxConfig,
    ChannelScaledGELU,
    calibrate_gelu_scales,
    gelu_least_squares,
    polyval,
)
from fedfm.errors import ConfigError, ModelError


@pytest.mark.parametrize(("degree", "radius"), [(2, 4.0), (4, 4.0), (4, 6.0)])
def test_fit_is_within_its_stated_error_on_its_domain(degree: int, radius: float) -> None:
    spec = gelu_least_squares(degree, radius=radius)
    x = torch.linspace(-radius, radius, 20001, dtype=torch.float64)
    error = (polyval(spec, x) - nn.functional.gelu(x)).abs().max().item()
    assert error <= spec.max_abs_error * (1 + 1e-6)
    assert error > 0.9 * spec.max_abs_error  # the bound is the measured one, not a loose guess
    assert spec.domain == (-radius, radius) and spec.degree == degree


def test_quartic_is_closer_than_the_quadratic_and_costs_one_level_more() -> None:
    quadratic, quartic = gelu_least_squares(2), gelu_least_squares(4)
    assert quartic.max_abs_error < 0.5 * quadratic.max_abs_error
    assert quadratic.max_abs_error < QUAD_GELU.max_abs_error
    assert (quadratic.depth, quartic.depth) == (2, 3)


def test_bad_fit_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="degree"):
        gelu_least_squares(0)
    with pytest.raises(ConfigError, match="radius"):
        gelu_least_squares(2, radius=-1.0)
    with pytest.raises(ConfigError, match="gelu_channel_scale needs"):
        ApproxConfig.build(gelu=False, gelu_channel_scale=True)


def test_paper_configuration_keeps_its_settings_and_description() -> None:
    assert ApproxConfig.build() == ApproxConfig()
    assert set(ApproxConfig().settings()) == {
        "exp_degree", "inverse_iterations", "gelu", "inv_sqrt_iterations",
    }  # fmt: skip
    assert "gelu_channel_scale" not in ApproxConfig().describe()
    fitted = ApproxConfig.build(gelu_degree=4, gelu_radius=4.0, gelu_channel_scale=True)
    assert fitted.settings()["gelu_degree"] == 4 and fitted.describe()["gelu_channel_scale"]


class Mlp(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.fc2 = nn.Linear(8, 6), act, nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_scale_brings_every_calibrated_input_into_the_domain_and_folds_away() -> None:
    spec = gelu_least_squares(4, radius=4.0)
    mlp = Mlp(ChannelScaledGELU(spec, 6))
    x = torch.randn(32, 8) * 10  # inputs far outside [-4, 4]
    assert calibrate_gelu_scales(mlp, [x[:16], x[16:]]) == 1
    scale = mlp.act.channel_scale
    scaled_inputs = mlp.fc1(x).detach() / scale
    assert scaled_inputs.abs().max() <= 4.0 + 1e-5
    assert (scale >= 1).all() and (scale > 1).any()
    # the scaled polynomial tracks GELU where the plain one explodes
    with torch.no_grad():
        hidden = mlp.fc1(x)
        scaled_error = (mlp.act(hidden) - nn.functional.gelu(hidden)).abs().max()
        plain_error = (polyval(spec, hidden) - nn.functional.gelu(hidden)).abs().max()
    assert scaled_error < 0.1 * plain_error
    # folding: the plain polynomial between the folded layers computes the same
    first, second = mlp.act.folded_linear_layers(mlp.fc1, mlp.fc2)
    with torch.no_grad():
        torch.testing.assert_close(second(polyval(spec, first(x))), mlp(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ModelError, match="do not fit"):
        mlp.act.folded_linear_layers(mlp.fc2, mlp.fc2)


def test_scale_is_kept_by_later_forward_passes_and_refused_for_the_wrong_width() -> None:
    act = ChannelScaledGELU(gelu_least_squares(2), 4)
    calibrate_gelu_scales(act, [torch.full((2, 4), 40.0)])
    before = act.channel_scale.clone()
    act(torch.full((2, 4), 400.0))  # not calibrating: the scale is part of the function
    torch.testing.assert_close(act.channel_scale, before)
    with pytest.raises(ModelError, match="5 channels"):
        act(torch.zeros(2, 5))
    with pytest.raises(ConfigError, match="at least one batch"):
        calibrate_gelu_scales(act, [])
