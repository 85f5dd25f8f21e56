"""FedRAG as a protocol of the fedfm runtime (spec 002 §4-§5); see ``docs/fedrag.md``.

Roles (:mod:`~fedfm.protocols.fedrag.plan`): ``coordinator``, ``owner_0 .. owner_{n-1}``, and the
compute role(s) of the compute plan. Stages (run config ``stage``):

``generate``
    The segments are given: each owner's input ``segment`` (token ids of its retrieved
    documents; ``owner_0``'s starts with ``<s>``) and the coordinator's input ``query`` (token
    ids). Steps: :mod:`~fedfm.protocols.fedrag.generation`.
``rag``
    Retrieval (§5.1, :mod:`~fedfm.protocols.fedrag.retrieval`), collaborative re-ranking (§5.2,
    :mod:`~fedfm.protocols.fedrag.reranking`), then generation over the selected documents.

The coordinator's result (generated tokens and their logits, and in ``rag`` the chosen
documents' ids) stays on its node; with an input ``report_key`` (32 bytes) it publishes it
sealed under that key (ChaCha20-Poly1305), so its operator reads it from the run's result and
the relay cannot (:func:`open_report`).

The model is code and public data: every party loads the decoder the run config names
(``decoder``, ``decoder-cache``); tests pass ``decoders`` (one source, or one per role) in code.
Parties compare their models' fingerprints and refuse a peer that runs another model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.fedrag.decoder import DecoderRunner, runner_for
from fedfm.protocols.fedrag.defaults import DEFAULTS
from fedfm.protocols.fedrag.generation import Generation, GenerationSettings
from fedfm.protocols.fedrag.plan import COORDINATOR, RolePlan
from fedfm.protocols.fedrag.scrambler import KINDS, check_scaling_range
from fedfm.protocols.reports import open_report as open_sealed_report
from fedfm.protocols.reports import seal_report
from fedfm.runtime.protocol import Protocol, RoleContext, Step, config_choice
from fedfm.runtime.transport import ConfigValue
from fedfm.secagg.channel import KEY_BYTES

STAGES = ("generate", "rag")
ATTENTIONS = ("scrambled", "distributed", "secret-sharing")
RETRIEVALS = ("private", "faithful")
REPORT_LABEL = b"fedfm-fedrag-report-v1|"
DecoderSpec = Any  # an embedded variant name, a DecoderSource, a folder or a hub name


@dataclass(frozen=True)
class FedragSettings:
    """A run's settings: the run config's keys (:data:`DEFAULTS`), validated."""

    plan: RolePlan
    stage: str
    attention: str
    scrambler: str
    scaling_range: float
    max_new_tokens: int
    retrieval: str
    top_k: int
    top_m: int
    decoder: str
    decoder_cache: str
    request: str

    def parameters(self) -> dict[str, ConfigValue]:
        """Everything the parties must agree on (part of the signed protocol digest)."""
        return {
            "owners": self.plan.owners,
            "compute-plan": self.plan.plan,
            "stage": self.stage,
            "attention": self.attention,
            "scrambler": self.scrambler,
            "scaling-range": self.scaling_range,
            "max-new-tokens": self.max_new_tokens,
            "retrieval": self.retrieval,
            "top-k": self.top_k,
            "top-m": self.top_m,
            "decoder": self.decoder,
            "request": self.request,
        }


def _choice(config: Mapping[str, ConfigValue], key: str, choices: tuple[str, ...]) -> str:
    return config_choice("fedrag", config, key, choices)


def _positive(config: Mapping[str, ConfigValue], key: str) -> int:
    value = config[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"fedrag {key} must be a positive integer, got {value!r}")
    return value


def settings_from_config(config: Mapping[str, ConfigValue] | None) -> FedragSettings:
    """Validated settings; :class:`ConfigError` names an unknown key or a bad value."""
    merged = {**DEFAULTS, **(config or {})}
    unknown = sorted(set(merged) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown fedrag run config keys {unknown}; known: {sorted(DEFAULTS)}")
    scaling = merged["scaling-range"]
    if isinstance(scaling, bool | str | bytes):
        raise ConfigError(f"fedrag scaling-range must be a number, got {scaling!r}")
    top_k, top_m = _positive(merged, "top-k"), _positive(merged, "top-m")
    if top_m > top_k:
        raise ConfigError(f"fedrag top-m ({top_m}) cannot exceed top-k ({top_k})")
    return FedragSettings(
        plan=RolePlan(
            _positive(merged, "owners"), _choice(merged, "compute-plan", ("dedicated", "rotating"))
        ),
        stage=_choice(merged, "stage", STAGES),
        attention=_choice(merged, "attention", ATTENTIONS),
        scrambler=_choice(merged, "scrambler", KINDS),
        scaling_range=check_scaling_range(float(scaling)),
        max_new_tokens=_positive(merged, "max-new-tokens"),
        retrieval=_choice(merged, "retrieval", RETRIEVALS),
        top_k=top_k,
        top_m=top_m,
        decoder=str(merged["decoder"]),
        decoder_cache=str(merged["decoder-cache"]),
        request=str(merged["request"]),
    )


def decoder_source(settings: FedragSettings) -> DecoderSpec:
    """The decoder the run config names (an embedded variant from ``decoder-cache``)."""
    from fedfm.models.decoder.config import EMBEDDED_DECODERS

    if settings.decoder in EMBEDDED_DECODERS:
        from fedfm.models.decoder import DecoderSource

        return DecoderSource(name=settings.decoder, cache_dir=Path(settings.decoder_cache))
    return settings.decoder


def decoder_layers(source: DecoderSpec) -> tuple[int, int, int]:
    """``(layers, heads, head_dim)`` of a decoder source, without loading its weights."""
    from fedfm.models.decoder import DecoderSource
    from fedfm.models.decoder.config import EMBEDDED_DECODERS

    if isinstance(source, str) and source in EMBEDDED_DECODERS:
        source = DecoderSource(name=source)
    if isinstance(source, DecoderSource):
        variant = source.variant
        return variant.num_layers, variant.num_heads, variant.hidden_size // variant.num_heads
    config_file = Path(str(source)) / "config.json"
    if not config_file.is_file():
        runner, _ = runner_for(source)
        g = runner.geometry
        return g.layers, g.heads, g.head_dim
    config = json.loads(config_file.read_text())
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return int(config["num_hidden_layers"]), heads, head_dim


# -- the coordinator's sealed report ----------------------------------------------------------


def _report_key(context: RoleContext) -> bytes | None:
    key = context.inputs.get("report_key")
    if key is None:
        return None
    data = np.asarray(key, dtype=np.uint8).tobytes()
    if len(data) != KEY_BYTES:
        raise ConfigError(f"{context.role}'s report_key must be {KEY_BYTES} bytes, got {len(data)}")
    return data


def publish_report(context: RoleContext, arrays: dict[str, np.ndarray]) -> None:
    """Publish ``arrays`` sealed under the role's ``report_key`` (nothing without one)."""
    context.state.update({f"report.{name}": value for name, value in arrays.items()})
    key = _report_key(context)
    if key is not None:
        report = {
            name[len("report.") :]: value
            for name, value in context.state.items()
            if name.startswith("report.")
        }
        context.publish("report", seal_report(key, report, REPORT_LABEL + context.role.encode()))


def open_report(key: bytes, sealed: np.ndarray, role: str = COORDINATOR) -> dict[str, np.ndarray]:
    """What ``role`` published sealed under ``key`` (its operator's ``report_key``)."""
    return open_sealed_report(key, sealed, REPORT_LABEL + role.encode(), "fedrag report")


# -- inputs -------------------------------------------------------------------------------------


def given_segment(context: RoleContext, runner: DecoderRunner) -> np.ndarray:
    """``generate`` stage: an owner's input ``segment``, the coordinator's ``query``."""
    name = "query" if context.role == COORDINATOR else "segment"
    ids = np.asarray(context.input(name))
    if ids.dtype.kind not in "iu":
        raise ConfigError(f"{context.role}'s input {name!r} must be token ids, not {ids.dtype}")
    return ids.reshape(-1).astype(np.int64)


# -- the declaration ----------------------------------------------------------------------------


def _runner_lookup(
    settings: FedragSettings, decoders: DecoderSpec | Mapping[str, DecoderSpec] | None
) -> Callable[[str], DecoderRunner]:
    def lookup(role: str) -> DecoderRunner:
        if isinstance(decoders, Mapping):
            source = decoders.get(role, decoders.get(COORDINATOR))
        else:
            source = decoders if decoders is not None else decoder_source(settings)
        return runner_for(source)[0]

    return lookup


def fedrag(
    config: Mapping[str, ConfigValue] | None = None,
    *,
    decoders: DecoderSpec | Mapping[str, DecoderSpec] | None = None,
) -> Protocol:
    """The FedRAG protocol for the run config keys ``config`` (module docstring)."""
    settings = settings_from_config(config)
    if isinstance(decoders, Mapping):
        declared = decoders.get(COORDINATOR)
    else:
        declared = decoders if decoders is not None else decoder_source(settings)
    layers, heads, head_dim = decoder_layers(declared)
    runner_of = _runner_lookup(settings, decoders)
    plan = settings.plan
    steps: list[Step] = []
    segment_for: Callable[[RoleContext, DecoderRunner], np.ndarray] = given_segment
    if settings.stage == "rag":
        from fedfm.protocols.fedrag.rag import RagStages

        stages = RagStages(settings, runner_for=runner_of)
        steps += stages.steps()
        segment_for = stages.segment
    if settings.attention == "secret-sharing":
        from fedfm.protocols.fedrag.secret_sharing import SecretSharingGeneration

        generation: Any = SecretSharingGeneration(
            _generation_settings(settings, layers, head_dim),
            runner_for=runner_of,
            segment_for=segment_for,
            report=publish_report,
        )
    else:
        generation = Generation(
            _generation_settings(settings, layers, head_dim),
            runner_for=runner_of,
            segment_for=segment_for,
            report=publish_report,
        )
    steps += generation.steps()
    del heads
    return Protocol(
        name="fedrag",
        roles=plan.roles,
        channels=plan.channels(),
        separated=(*plan.separated(), *plan.parties_apart()),
        steps=tuple(steps),
        parameters=settings.parameters(),
    )


def _generation_settings(
    settings: FedragSettings, layers: int, head_dim: int
) -> GenerationSettings:
    if settings.stage == "rag" and settings.attention == "distributed":
        raise ConfigError("attention 'distributed' is an ablation of the generate stage only")
    return GenerationSettings(
        plan=settings.plan,
        layers=layers,
        max_new_tokens=settings.max_new_tokens,
        attention="distributed" if settings.attention == "distributed" else "scrambled",
        scrambler=settings.scrambler,
        scaling_range=settings.scaling_range,
        request=settings.request,
        scaling=float(head_dim) ** -0.5,
    )


def check_placement(plan: RolePlan, placement: list[frozenset[str]]) -> None:
    """:class:`ProtocolError` if a node hosts a compute role and a role it serves (§5.4), or
    two parties (the coordinator and the owners are distinct institutions)."""
    for index, roles in enumerate(placement):
        parties = [role for role in plan.inquirers if role in roles]
        if len(parties) > 1:
            raise ProtocolError(
                f"node {index + 1} would host the parties {parties}: the coordinator and each "
                f"context owner need nodes of their own (FedRAG needs at least three nodes)"
            )
        for compute, served in plan.separated():
            if compute in roles and served in roles:
                raise ProtocolError(
                    f"node {index + 1} would be the compute node ({compute}) and {served} of the "
                    "same attention computation: it could unscramble with the shared keys (§5.4)"
                )
