"""The developer's offline step: permutations, Θ', calibration, and the provisioned files.

Seed §4.1 "Initialization": the developer P0 draws its permutations (OS CSPRNG), permutes Θ into
Θ' and provisions the cloud P1 with it: here a file (``.npz``, no pickles) the cloud's operator
installs as the cloud's input, never a protocol message. The developer runs with the same Θ' (it
needs Θ', not Θ, for Π_ScalMul on its shares). The full secret-sharing baseline instead gives
each party a share of the fixed-point weights.

A provisioned file carries metadata beside the weights: the public :class:`Architecture`, the
:class:`Calibration` constants, the kind (``permuted`` or ``share``), the fixed-point fraction
of shares, and the model id (a fingerprint of Θ' for ``permuted``; of Θ for ``share``). The
compute parties refuse a run for another model id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.centaur.model import (
    Architecture,
    Permutations,
    Trace,
    Weights,
    fingerprint,
    forward,
    permute_weights,
)
from fedfm.protocols.centaur.programs import Calibration, check_mode
from fedfm.protocols.sharing import encode, share
from fedfm.runtime.transport import ConfigValue

META = ("__architecture__", "__model_id__", "__calibration__", "__kind__", "__fraction__")


def _text(value: str) -> np.ndarray:
    return np.frombuffer(value.encode(), dtype=np.uint8)


def _read(arrays: Mapping[str, np.ndarray], key: str) -> str:
    return bytes(np.asarray(arrays[key], dtype=np.uint8)).decode()


@dataclass(frozen=True)
class Provisioned:
    """A compute party's model as provisioned (module docstring)."""

    architecture: Architecture
    model_id: str
    calibration: Calibration
    kind: str  # "permuted" (Θ', float64) or "share" (uint64 shares of fixed-point weights)
    fraction: int  # the shares' fractional bits (0 for Θ')
    weights: Weights

    def weight(self, name: str) -> np.ndarray:
        if name not in self.weights:
            raise ProtocolError(f"the provisioned model has no weight {name!r}")
        return self.weights[name]

    def arrays(self) -> dict[str, np.ndarray]:
        """The file's arrays."""
        return {
            "__architecture__": _text(self.architecture.to_json()),
            "__model_id__": _text(self.model_id),
            "__calibration__": _text(self.calibration.to_json()),
            "__kind__": _text(self.kind),
            "__fraction__": np.asarray([self.fraction], np.int64),
            **self.weights,
        }

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = self.arrays()
        np.savez(path, **arrays)
        return path


def load_provisioned(arrays: Mapping[str, np.ndarray], *, role: str = "party") -> Provisioned:
    """A provisioned model from a file's arrays; :class:`ProtocolError` if it is not one."""
    missing = [key for key in META if key not in arrays]
    if missing:
        raise ProtocolError(
            f"the {role} holds no provisioned CENTAUR model (missing {missing}): install the "
            "file the developer provisioned as its input"
        )
    kind = _read(arrays, "__kind__")
    weights = {name: np.asarray(value) for name, value in arrays.items() if name not in META}
    model_id = _read(arrays, "__model_id__")
    if kind == "permuted":
        weights = {name: value.astype(np.float64) for name, value in weights.items()}
        if fingerprint(weights) != model_id:
            raise ProtocolError(
                f"the {role}'s provisioned weights do not match their id {model_id}"
            )
    elif kind == "share":
        weights = {name: value.astype(np.uint64) for name, value in weights.items()}
    else:
        raise ProtocolError(f"unknown provisioned kind {kind!r}")
    return Provisioned(
        architecture=Architecture.from_json(_read(arrays, "__architecture__")),
        model_id=model_id,
        calibration=Calibration.from_json(_read(arrays, "__calibration__")),
        kind=kind,
        fraction=int(np.asarray(arrays["__fraction__"]).reshape(-1)[0]),
        weights=weights,
    )


@dataclass(frozen=True)
class Deployment:
    """What the developer's offline step produces for one mode: the two compute parties'
    provisioned models, and the secrets it keeps (``permutations``, ``None`` for shares)."""

    mode: str
    developer: Provisioned
    cloud: Provisioned
    permutations: Permutations | None

    @property
    def model_id(self) -> str:
        return self.developer.model_id

    def run_config(self, **extra: ConfigValue) -> dict[str, ConfigValue]:
        """The run config keys that name this deployment (plus ``extra``)."""
        return {
            "mode": self.mode,
            "model-id": self.model_id,
            "architecture": self.developer.architecture.to_json(),
            **extra,
        }


def prepare(
    architecture: Architecture,
    weights: Mapping[str, np.ndarray],
    *,
    mode: str,
    calibration: Calibration,
    fraction: int = 16,
) -> Deployment:
    """The developer's offline step for ``mode`` (module docstring). ``hardened`` draws a fresh
    π_2 per layer; ``faithful`` one π_2 for all layers, as the seed."""
    check_mode(mode)
    if mode == "full-sharing":
        developer_shares: Weights = {}
        cloud_shares: Weights = {}
        for name, value in weights.items():
            developer_shares[name], cloud_shares[name] = share(encode(value, fraction))
        model_id = fingerprint(weights)

        def shares(held: Weights) -> Provisioned:
            return Provisioned(architecture, model_id, calibration, "share", fraction, held)

        return Deployment(mode, shares(developer_shares), shares(cloud_shares), None)
    permutations = Permutations.draw(architecture, fresh_ffn=mode == "hardened")
    permuted = permute_weights(architecture, weights, permutations)
    provisioned = Provisioned(
        architecture, fingerprint(permuted), calibration, "permuted", 0, permuted
    )
    return Deployment(mode, provisioned, provisioned, permutations)


def calibrate(
    architecture: Architecture, weights: Mapping[str, np.ndarray], sequences: Iterable[np.ndarray]
) -> Calibration:
    """Public constants for the MPC approximations, from plaintext runs on public text (the
    developer's own model, so nothing private leaves it beyond these numbers).

    Each norm gets its own inverse-square-root constant, the geometric middle of its rows'
    variances (mean squares for RMSNorm) over the text: inverse_sqrt's domain is a ratio
    (about ``[0.05, 50]`` around the constant), so the middle in log scale leaves the most room
    on both sides."""
    embed, layer, activation, spread = [], [], [0.0], [0.0]
    rows: dict[str, list[np.ndarray]] = {}
    for ids in sequences:
        trace = Trace()
        forward(architecture, weights, ids, trace=trace)
        for name, value in trace.values.items():
            if name.endswith(".scores"):
                scaled = value  # the trace's scores are already scaled by 1/sqrt(d_h)
                allowed = scaled > -1e3  # the causal mask's entries are not scores
                mean = np.where(allowed, scaled, 0).sum(-1) / allowed.sum(-1)
                top = np.where(allowed, scaled, -np.inf).max(-1)
                spread.append(float((top - mean).max()))
            elif name == "embed.input" or name == "l0.norm1.input":
                embed.append(float(_variance(value, architecture.kind)))
            elif name.endswith((".ln1.input", ".ln2.input", ".norm2.input", "norm.input")) or (
                name.endswith(".norm1.input") and name != "l0.norm1.input"
            ):
                layer.append(float(_variance(value, architecture.kind)))
                rows.setdefault(name.removesuffix(".input"), []).append(
                    _row_variances(value, architecture.kind)
                )
            elif name.endswith(".up"):
                activation.append(float(np.abs(value).max()))
    if not embed:
        raise ConfigError("calibration needs at least one public sequence")
    return Calibration(
        score_spread=float(np.ceil(max(spread))),
        embed_variance=float(np.median(embed)),
        layer_variance=float(np.median(layer)) if layer else 1.0,
        activation_bound=float(np.ceil(max(activation) * 1.1)),
        tanh_bound=4.0,
        norm_variances={
            norm: float(np.sqrt(np.concatenate(v).min() * np.concatenate(v).max()))
            for norm, v in sorted(rows.items())
        },
    )


def _variance(value: np.ndarray, kind: str) -> float:
    if kind == "bert":
        return float(value.var(axis=-1).mean())
    return float((value**2).mean(axis=-1).mean())


def _row_variances(value: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bert":
        return np.asarray(value.var(axis=-1), dtype=np.float64)
    return np.asarray((value**2).mean(axis=-1), dtype=np.float64)
