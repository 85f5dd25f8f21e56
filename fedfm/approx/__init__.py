"""FHE-friendly approximations of softmax, GELU and LayerNorm (one source of truth).

``specs`` describes them (coefficients, iterations, domains, depth), ``evaluate`` evaluates a spec
with only additions and multiplications (torch, numpy or CKKS), ``modules`` wraps them as torch
modules for distillation.
"""

from fedfm.approx.evaluate import check_domain, evaluate_inv_sqrt, evaluate_inverse, polyval
from fedfm.approx.modules import (
    ApproxGELU,
    ApproxLayerNorm,
    ApproxSoftmax,
    ChannelScaledGELU,
    calibrate,
    calibrate_gelu_scales,
    clamped_count,
    reset_clamped,
    set_domain_policy,
)
from fedfm.approx.specs import (
    QUAD_GELU,
    ApproxConfig,
    GoldschmidtInverseSpec,
    NewtonInvSqrtSpec,
    PolySpec,
    gelu_least_squares,
    newton_inv_sqrt,
    taylor_exp,
)

__all__ = [
    "QUAD_GELU",
    "ApproxConfig",
    "ApproxGELU",
    "ApproxLayerNorm",
    "ApproxSoftmax",
    "ChannelScaledGELU",
    "GoldschmidtInverseSpec",
    "NewtonInvSqrtSpec",
    "PolySpec",
    "calibrate",
    "calibrate_gelu_scales",
    "check_domain",
    "clamped_count",
    "evaluate_inv_sqrt",
    "evaluate_inverse",
    "gelu_least_squares",
    "newton_inv_sqrt",
    "polyval",
    "reset_clamped",
    "set_domain_policy",
    "taylor_exp",
]
