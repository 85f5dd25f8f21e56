"""Torch modules of the approximations, for distillation and plaintext inference.

Each module takes a spec (or ``None`` for the exact function) and evaluates it with the same
evaluator an encrypted backend uses (:mod:`fedfm.approx.evaluate`).

Divisions (softmax's normaliser, LayerNorm's ``1/sqrt(var)``) need their input scaled into the
domain of the iteration. The scale is a bound fixed in plaintext from data (App. "Approximation
results", *Inverse*): :func:`calibrate` runs the model on auxiliary data and records, per module,
the largest value seen. The bounds are buffers, so they travel with the checkpoint and an
encrypted evaluator uses exactly the same ones.

Out-of-domain inputs are handled by each module's ``domain_policy``:

``"clamp"`` (default)
    clamp the scaled input to the domain and count the clamped elements in ``clamped`` (the
    encrypted evaluator cannot clamp, so reports show this count);
``"raise"``
    raise :class:`~fedfm.errors.ApproximationDomainError` naming the module and the range seen.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedfm.approx.evaluate import check_domain, evaluate_inv_sqrt, evaluate_inverse, polyval
from fedfm.approx.specs import GoldschmidtInverseSpec, NewtonInvSqrtSpec, PolySpec
from fedfm.errors import ApproximationDomainError, ConfigError, ModelError

DomainPolicy = Literal["clamp", "raise"]
_POLICIES = ("clamp", "raise")


class _Calibrated(nn.Module):
    """A module whose division is scaled by a bound recorded from data."""

    input_bound: torch.Tensor  # buffers (registered in __init__)
    clamped: torch.Tensor

    def __init__(self, bound_name: str) -> None:
        super().__init__()
        self.register_buffer("input_bound", torch.tensor(float("nan")))
        self.register_buffer("clamped", torch.tensor(0, dtype=torch.long), persistent=False)
        self.calibrating = False
        self.domain_policy: DomainPolicy = "clamp"
        self._bound_name = bound_name

    def _scale(self, values: torch.Tensor, margin: float) -> torch.Tensor:
        """Record the bound while calibrating, then return ``values / bound``."""
        if self.calibrating:
            seen = values.detach().max() * margin
            self.input_bound = torch.where(
                torch.isnan(self.input_bound), seen, torch.maximum(self.input_bound, seen)
            )
        if torch.isnan(self.input_bound):
            raise ApproximationDomainError(
                f"{self._bound_name} has no input bound yet: run "
                "fedfm.approx.calibrate(model, data) "
                "on auxiliary data before using the approximation"
            )
        return values / self.input_bound

    def _enforce(
        self,
        scaled: torch.Tensor,
        domain: tuple[float, float],
        *,
        open_interval: bool,
        clamp_low: bool = True,
    ) -> torch.Tensor:
        if self.domain_policy == "raise":
            check_domain(
                scaled.detach(), domain, what=self._bound_name, open_interval=open_interval
            )
            return scaled
        low, high = domain
        if open_interval:  # stay strictly inside (low, high)
            span = high - low
            low, high = low + 1e-6 * span, high - 1e-6 * span
        if not clamp_low:
            low = -float("inf")
        outside = (scaled < low) | (scaled > high)
        self.clamped += int(outside.sum())
        return scaled.clamp(low, high)


class ApproxSoftmax(_Calibrated):
    """Softmax as ``p(a_i) / sum_j p(a_j)``: ``p`` the Taylor exp, the division by Goldschmidt.

    With ``exp_spec=None`` the exponential is exact (computed on max-shifted logits for stability;
    only plaintext sweeps use that mix); with ``inverse_spec=None`` the division is exact. With both
    ``None`` this is ``torch.softmax``.
    """

    def __init__(
        self, exp_spec: PolySpec | None, inverse_spec: GoldschmidtInverseSpec | None
    ) -> None:
        super().__init__("softmax normaliser")
        self.exp_spec = exp_spec
        self.inverse_spec = inverse_spec

    def forward(self, logits: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax over the last axis; ``keep`` (boolean, broadcastable to ``logits``) marks the
        entries that take part, the others (padding keys) get weight exactly zero.

        An additive ``-inf`` mask only works with the exact exponential: the Taylor polynomial
        of a large negative number is large and positive (even degree). So the mask multiplies
        the numerators instead (a plaintext 0/1 product under CKKS), after the polynomial and
        before the normaliser's sum.
        """
        if self.exp_spec is None and self.inverse_spec is None:
            if keep is not None:
                logits = logits.masked_fill(~keep, float("-inf"))
            return logits.softmax(dim=-1)
        if self.exp_spec is None:
            if keep is not None:
                logits = logits.masked_fill(~keep, float("-inf"))
            numerators = (logits - logits.amax(dim=-1, keepdim=True)).exp()
        else:
            numerators = polyval(self.exp_spec, logits)
            if keep is not None:  # a select, not a product: 0 * inf would be NaN in torch
                numerators = numerators.masked_fill(~keep, 0.0)
        denominators = numerators.sum(dim=-1, keepdim=True)
        if self.inverse_spec is None:
            return numerators / denominators
        scaled = self._scale(denominators, self.inverse_spec.calibration_margin)
        scaled = self._enforce(scaled, self.inverse_spec.domain, open_interval=True)
        # 1/d = (1/(d/B)) / B: the bound is a plaintext constant.
        return numerators * (evaluate_inverse(self.inverse_spec, scaled) / self.input_bound)


class ApproxGELU(nn.Module):
    """GELU replaced by a polynomial (Eq. 2), or exact with ``spec=None``."""

    def __init__(self, spec: PolySpec | None, *, approximate: str = "none") -> None:
        super().__init__()
        self.spec = spec
        self.approximate = approximate  # only used when exact, to match the teacher's GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec is None:
            return F.gelu(x, approximate=self.approximate)
        return polyval(self.spec, x)


class ChannelScaledGELU(ApproxGELU):
    """GELU as ``s_c * p(x_c / s_c)`` per channel ``c`` (the last axis), ``p`` a GELU fit on
    ``[-R, R]`` (:func:`fedfm.approx.specs.gelu_least_squares`).

    A pretrained encoder's GELU inputs have channels whose range is many times any low-degree
    fit's domain (MiniLM: up to +25); a polynomial there is orders of magnitude off and breaks
    the encoder. The scale ``s_c = max(1, margin * max|x_c| / R)`` (:func:`calibrate_gelu_scales`,
    once, on the teacher's weights) keeps every calibrated input in the domain; GELU is close to
    positively homogeneous away from 0, so ``s p(x / s)`` stays close to GELU where ``|x|`` is
    large and only the bend near 0 widens. ``1/s_c`` folds into the rows of the linear layer
    before the activation and ``s_c`` into the columns of the one after
    (:meth:`folded_linear_layers`): an encrypted evaluator sees the plain polynomial ``p``.

    The scale is a buffer fixed at calibration: later division re-calibrations
    (:func:`calibrate`) leave it alone, as it changes the function the weights adapt to.
    """

    channel_scale: torch.Tensor  # a buffer (registered in __init__)

    def __init__(
        self,
        spec: PolySpec,
        channels: int,
        *,
        approximate: str = "none",
        margin: float = 1.0,
    ) -> None:
        super().__init__(spec, approximate=approximate)
        if channels < 1:
            raise ConfigError(f"a channel-scaled GELU needs >= 1 channels, got {channels}")
        if margin <= 0:
            raise ConfigError(f"GELU scale margin must be > 0, got {margin}")
        self.register_buffer("channel_scale", torch.ones(channels))
        self.margin = margin
        self.calibrating = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if spec is None:
            raise ModelError("ChannelScaledGELU needs a polynomial spec")
        if x.shape[-1] != self.channel_scale.shape[0]:
            raise ModelError(
                f"GELU input has {x.shape[-1]} channels, the scale {self.channel_scale.shape[0]}"
            )
        if self.calibrating:
            radius = min(-spec.domain[0], spec.domain[1])
            seen = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0) * self.margin / radius
            self.channel_scale = torch.maximum(self.channel_scale, seen)
        scale = self.channel_scale
        return scale * polyval(spec, x / scale)

    def folded_linear_layers(
        self, before: nn.Linear, after: nn.Linear
    ) -> tuple[nn.Linear, nn.Linear]:
        """Copies of the linear layers around the activation with the scale folded in:
        ``after(s * p(before(x) / s)) == after'(p(before'(x)))``."""
        scale = self.channel_scale.detach()
        if before.out_features != scale.numel() or after.in_features != scale.numel():
            raise ModelError(
                f"layers of {before.out_features} -> {after.in_features} features do not fit a "
                f"GELU scale of {scale.numel()} channels"
            )
        first, second = copy.deepcopy(before), copy.deepcopy(after)
        with torch.no_grad():
            first.weight.div_(scale[:, None])
            if first.bias is not None:
                first.bias.div_(scale)
            second.weight.mul_(scale[None, :])
        return first, second


def gelu_scale_modules(model: nn.Module) -> list[ChannelScaledGELU]:
    """Every channel-scaled GELU of ``model``."""
    return [m for m in model.modules() if isinstance(m, ChannelScaledGELU)]


@torch.no_grad()
def calibrate_gelu_scales(model: nn.Module, batches: Iterable[torch.Tensor]) -> int:
    """Fix every :class:`ChannelScaledGELU`'s scale from the inputs ``model`` sees on
    ``batches`` (reset to 1 first); return how many modules were calibrated.

    Call it on the teacher's weights, before distillation: the scale is part of the function.
    """
    modules = gelu_scale_modules(model)
    was_training = model.training
    model.eval()
    for module in modules:
        module.channel_scale.fill_(1.0)
        module.calibrating = True
    seen = 0
    try:
        for batch in batches:
            model(batch)
            seen += 1
    finally:
        for module in modules:
            module.calibrating = False
        model.train(was_training)
    if seen == 0:
        raise ConfigError("GELU scale calibration needs at least one batch of data")
    return len(modules)


class ApproxLayerNorm(_Calibrated):
    """LayerNorm whose ``1/sqrt(var + eps)`` is Newton's iteration on the scaled variance.

    Parameters ``weight`` and ``bias`` have the names and shapes of :class:`torch.nn.LayerNorm`, so
    a teacher's state dict loads unchanged. With ``spec=None`` it equals ``torch.nn.LayerNorm``.
    """

    def __init__(
        self, dim: int, *, eps: float = 1e-6, spec: NewtonInvSqrtSpec | None = None
    ) -> None:
        super().__init__("layer-norm variance")
        self.dim = dim
        self.eps = eps
        self.spec = spec
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    @classmethod
    def replacing(
        cls, source: nn.LayerNorm | ApproxLayerNorm, spec: NewtonInvSqrtSpec | None
    ) -> ApproxLayerNorm:
        """The replacement of ``source`` (same ``eps``; shares its weight and bias parameters).

        Raises :class:`~fedfm.errors.ModelError` for a LayerNorm over more than the last axis or
        without weight and bias.
        """
        if isinstance(source, ApproxLayerNorm):
            dim, eps = source.dim, source.eps
        else:
            if len(source.normalized_shape) != 1 or source.weight is None or source.bias is None:
                raise ModelError(
                    "only LayerNorm over the last dimension with weight and bias is supported"
                )
            dim, eps = source.normalized_shape[0], source.eps
        replacement = cls(dim, eps=eps, spec=spec)
        replacement.weight = source.weight
        replacement.bias = source.bias
        return replacement

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec is None:
            return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
        centered = x - x.mean(dim=-1, keepdim=True)
        variance = (centered * centered).mean(dim=-1, keepdim=True) + self.eps
        scaled = self._scale(variance, self.spec.calibration_margin)
        # Below its domain Newton's iteration stays bounded (it approaches 1/sqrt(u) from below
        # and under-estimates it), so only the top, where it diverges, is clamped: an encrypted
        # evaluator, which cannot clamp, then computes the same as this module.
        scaled = self._enforce(scaled, self.spec.domain, open_interval=False, clamp_low=False)
        # 1/sqrt(v) = (1/sqrt(v/B)) / sqrt(B): sqrt(B) is a plaintext constant.
        inv_std = evaluate_inv_sqrt(self.spec, scaled) * self.input_bound.rsqrt()
        return centered * inv_std * self.weight + self.bias


def calibrated_modules(model: nn.Module) -> Iterator[_Calibrated]:
    """Every module of ``model`` that scales its input by a calibrated bound."""
    return (m for m in model.modules() if isinstance(m, _Calibrated))


def set_domain_policy(model: nn.Module, policy: DomainPolicy) -> None:
    """Choose how every approximation in ``model`` treats out-of-domain inputs."""
    if policy not in _POLICIES:
        raise ConfigError(f"domain policy must be one of {_POLICIES}, got {policy!r}")
    for module in calibrated_modules(model):
        module.domain_policy = policy


def clamped_count(model: nn.Module) -> int:
    """Number of elements clamped into a domain since the counters were last reset."""
    return sum(int(m.clamped) for m in calibrated_modules(model))


def reset_clamped(model: nn.Module) -> None:
    """Reset every clamp counter to zero."""
    for module in calibrated_modules(model):
        module.clamped.zero_()


@contextmanager
def calibrating(model: nn.Module) -> Iterator[None]:
    """Within this block, forward passes reset and then record every module's input bound.

    If the block raises, the previous bounds are restored.
    """
    modules = list(calibrated_modules(model))
    previous = [module.input_bound.clone() for module in modules]
    for module in modules:
        module.input_bound.fill_(float("nan"))
        module.calibrating = True
    try:
        yield
    except BaseException:
        for module, bound in zip(modules, previous, strict=True):
            module.input_bound.copy_(bound)
        raise
    finally:
        for module in modules:
            module.calibrating = False


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[torch.Tensor]) -> None:
    """Fix every approximation's input bound from the largest values ``model`` sees on ``batches``.

    Layers are calibrated in forward order within each pass, so a layer's bound reflects the
    approximated (not the exact) layers before it.
    """
    was_training = model.training
    model.eval()
    seen = 0
    with calibrating(model):
        for batch in batches:
            model(batch)
            seen += 1
    model.train(was_training)
    if seen == 0:
        raise ConfigError("calibration needs at least one batch of data")
