"""HELIX as a protocol of the fedfm runtime: a provider and one or more clients.

Roles: ``provider`` (Party A: public embeddings ``Z_A``, head ``V``, ``c``) and ``client_0``,
``client_1``, ... (Party B: public embeddings ``Z_B``, queries). Each client aligns with the
provider on its own channel; the provider serves all of them in the same steps.

Steps (``mode``):

=================== ========== ===============================================================
step                roles      what happens
=================== ========== ===============================================================
``upload``          clients    fresh alignment keys; ``E(Z_B)`` in row blocks and the public
                               context (one Galois key) to the provider           (align)
``cross_covariance`` provider  ``E(Z_A^T Z_B)`` and ``1^T Z_A`` back                  (align)
``solve``           clients    decrypt, ``W*, b*`` by ridge (:mod:`~.ridge`)        (align)
``query``           clients    fresh inference keys; ``E(z_B W* + b*)`` (Sec. 4.5) or, with
                               ``alignment = "provider"`` (App. G.7), ``E(z_B)`` plus
                               ``W*, b*`` for the provider                          (infer)
``classify``        provider   ``E(z) V + c`` (or ``E(z_B) (W* V) + (b* V + c)``)      (infer)
``reveal``          clients    decrypt the logits                                  (infer)
=================== ========== ===============================================================

``mode = "align-infer"`` runs all six (``solve`` and ``query`` are one step), ``"align"`` the
first three, ``"infer"`` the last three with ``W*, b*`` from the client's inputs.

Inputs (``<role>.npz``): provider ``public`` (``N x d_A``), ``head_weight`` (``d_A x K``),
``head_bias`` (``K``); client ``public`` (``N x d_B``, the same public samples in the same
order), ``queries`` (``n x d_B``), for ``infer`` ``alignment_weight`` and ``alignment_bias``,
and optionally ``report_key`` (32 bytes). A client's results (``W*, b*``, logits) stay on its
node; with a ``report_key`` it publishes them *sealed* under that key (ChaCha20-Poly1305), so
its operator can read them from the run's result and the relay cannot (:func:`open_report`).

Run config keys: ``clients`` (1), ``mode`` (``align-infer``), ``ridge`` (lambda, 0.1),
``alignment`` (``client`` or ``provider``), ``packing`` (``auto``, ``features``, ``rows``; see
:func:`fedfm.protocols.helix.packing.inference_layout`). None of them weakens a party's privacy
except ``alignment = "provider"``, which hands the provider ``W*`` (App. G.7's trade-off) and which
a client refuses unless its own input ``allow_provider_alignment`` is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import numpy as np

from fedfm.crypto import CKKS_8192, CkksParameters
from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.helix.ckks import ClientKeys, Payload, ProviderEvaluator, check_parameters
from fedfm.protocols.helix.packing import (
    LAYOUT_CODES,
    FeatureMajor,
    InferenceLayout,
    RowBlocks,
    inference_layout,
    layout_from_code,
)
from fedfm.protocols.helix.ridge import (
    AffineMap,
    AlignmentStatistics,
    check_embeddings,
    check_ridge,
    fit_from_statistics,
    minimum_public_samples,
)
from fedfm.runtime.payload import pack_arrays, unpack_arrays
from fedfm.runtime.protocol import Protocol, RoleContext, Step, config_choice
from fedfm.runtime.transport import ConfigValue
from fedfm.secagg.channel import KEY_BYTES, open_sealed, seal

PROVIDER = "provider"
MODES = ("align-infer", "align", "infer")
ALIGNMENTS = ("client", "provider")
PACKINGS = ("auto", "features", "rows")
DEFAULTS: dict[str, ConfigValue] = {
    "clients": 1,
    "mode": "align-infer",
    "ridge": 0.1,
    "alignment": "client",
    "packing": "auto",
}
REPORT_LABEL = b"fedfm-helix-report-v1|"
# role state keys
TRAINING_KEYS, INFERENCE_KEYS = "training_keys", "inference_keys"
MAP_WEIGHT, MAP_BIAS, QUERY_LAYOUT = "alignment_weight", "alignment_bias", "query_layout"


def client_role(index: int) -> str:
    return f"client_{index}"


@dataclass(frozen=True)
class HelixSettings:
    """A run's settings: the run config's keys plus the CKKS parameter set (code, not config)."""

    clients: int
    mode: str
    ridge: float
    alignment: str
    packing: str
    ckks: CkksParameters
    allow_insecure: bool

    @property
    def client_roles(self) -> tuple[str, ...]:
        return tuple(client_role(i) for i in range(self.clients))

    def parameters(self) -> dict[str, ConfigValue]:
        """Everything both sides must agree on (part of the signed protocol digest)."""
        ckks = self.ckks
        return {
            "clients": self.clients,
            "mode": self.mode,
            "ridge": self.ridge,
            "alignment": self.alignment,
            "packing": self.packing,
            "ckks": f"N={ckks.poly_modulus_degree} q={list(ckks.coeff_mod_bit_sizes)} "
            f"scale=2^{ckks.scale_bits}",
        }


def _choice(config: Mapping[str, ConfigValue], key: str, choices: tuple[str, ...]) -> str:
    return config_choice("helix", config, key, choices)


def settings_from_config(
    config: Mapping[str, ConfigValue] | None,
    *,
    ckks: CkksParameters = CKKS_8192,
    allow_insecure: bool = False,
) -> HelixSettings:
    """Validated settings; :class:`ConfigError` names an unknown key or a bad value."""
    merged = {**DEFAULTS, **(config or {})}
    unknown = sorted(set(merged) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown helix run config keys {unknown}; known: {sorted(DEFAULTS)}")
    clients = merged["clients"]
    if not isinstance(clients, int) or isinstance(clients, bool) or clients < 1:
        raise ConfigError(f"helix clients must be a positive integer, got {clients!r}")
    ridge = merged["ridge"]
    if isinstance(ridge, bool | str | bytes):
        raise ConfigError(f"helix ridge must be a number, got {ridge!r}")
    check_parameters(ckks, allow_insecure=allow_insecure)
    return HelixSettings(
        clients=clients,
        mode=_choice(merged, "mode", MODES),
        ridge=check_ridge(ridge),
        alignment=_choice(merged, "alignment", ALIGNMENTS),
        packing=_choice(merged, "packing", PACKINGS),
        ckks=ckks,
        allow_insecure=allow_insecure,
    )


def _prefixed(prefix: str, payload: Payload) -> dict[str, np.ndarray]:
    return {f"{prefix}.{name}": value for name, value in payload.items()}


def _unprefixed(prefix: str, message: Mapping[str, np.ndarray]) -> Payload:
    start = f"{prefix}."
    return {name[len(start) :]: value for name, value in message.items() if name.startswith(start)}


def _field(message: Mapping[str, np.ndarray], name: str, sender: str) -> np.ndarray:
    if name not in message:
        raise ProtocolError(f"the message from {sender} lacks {name!r}")
    return message[name]


def _ints(message: Mapping[str, np.ndarray], name: str, count: int, sender: str) -> list[int]:
    values = _field(message, name, sender)
    if values.dtype.kind not in "iu" or values.shape != (count,) or (values < 0).any():
        raise ProtocolError(f"{sender} sent an invalid {name!r}: {values!r}")
    return [int(v) for v in values]


# -- alignment --------------------------------------------------------------------------------


def _upload(settings: HelixSettings, context: RoleContext) -> None:
    public = check_embeddings(f"{context.role}'s input 'public'", context.input("public"))
    keys = ClientKeys.generate(settings.ckks, allow_insecure=settings.allow_insecure)
    layout = RowBlocks(public.shape[1], keys.slots)
    context.state[TRAINING_KEYS] = keys.secret_state()
    context.send(
        PROVIDER,
        {
            "context": keys.public_context(layout.rotation_steps()),
            "shape": np.asarray(public.shape, dtype=np.int64),
            **_prefixed("rows", keys.encrypt(layout.pack(public))),
        },
    )


def _provider_public(context: RoleContext) -> np.ndarray:
    return check_embeddings("the provider's input 'public'", context.input("public"))


def _evaluator_for(
    settings: HelixSettings, client: str, message: Mapping[str, np.ndarray]
) -> ProviderEvaluator:
    """The provider's evaluator on the public context ``client`` sent."""
    return ProviderEvaluator(
        _field(message, "context", client), settings.ckks, allow_insecure=settings.allow_insecure
    )


def _cross_covariance(settings: HelixSettings, context: RoleContext) -> None:
    provider_public = _provider_public(context)
    samples = provider_public.shape[0]
    for client in settings.client_roles:
        message = context.receive(client)
        count, features = _ints(message, "shape", 2, client)
        if count != samples:
            raise ProtocolError(
                f"{client} encrypted {count} public samples; the provider embedded {samples}: "
                "both must embed the same public set in the same order"
            )
        needed = minimum_public_samples(features)
        if count < needed:
            raise ProtocolError(
                f"{client} has {features} embedding features, so the alignment needs at least "
                f"{needed} public samples, got {count}: with fewer the client could solve for "
                "the provider's public embeddings"
            )
        evaluator = _evaluator_for(settings, client, message)
        layout = RowBlocks(features, evaluator.slots)
        uploads = evaluator.load(_unprefixed("rows", message), layout.ciphertexts(count))
        cross = evaluator.cross_covariance(uploads, layout, provider_public)
        context.send(
            client,
            {**_prefixed("cross", evaluator.dump(cross)), "provider_sum": provider_public.sum(0)},
        )


def _solve(settings: HelixSettings, context: RoleContext) -> AffineMap:
    message = context.receive(PROVIDER)
    public = check_embeddings(f"{context.role}'s input 'public'", context.input("public"))
    keys = ClientKeys.restore(context.state.pop(TRAINING_KEYS), settings.ckks)
    provider_sum = _field(message, "provider_sum", PROVIDER).astype(np.float64).reshape(-1)
    layout = RowBlocks(public.shape[1], keys.slots)
    cross = layout.unpack(keys.decrypt(_unprefixed("cross", message)), provider_sum.size)
    mapping = fit_from_statistics(
        AlignmentStatistics.from_client(public, cross, provider_sum), settings.ridge
    )
    context.state[MAP_WEIGHT], context.state[MAP_BIAS] = mapping.weight, mapping.bias
    return mapping


def _solve_step(settings: HelixSettings, context: RoleContext) -> None:
    mapping = _solve(settings, context)
    _publish_report(context, {MAP_WEIGHT: mapping.weight, MAP_BIAS: mapping.bias})


# -- inference --------------------------------------------------------------------------------


def _mapping_from_inputs(context: RoleContext) -> AffineMap:
    weight = check_embeddings(f"{context.role}'s input {MAP_WEIGHT!r}", context.input(MAP_WEIGHT))
    bias = np.asarray(context.input(MAP_BIAS), dtype=np.float64).reshape(-1)
    if bias.size != weight.shape[1]:
        raise ConfigError(
            f"{context.role}'s alignment bias has {bias.size} entries, its map {weight.shape[1]} "
            "columns"
        )
    return AffineMap(weight, bias)


def _query(settings: HelixSettings, context: RoleContext) -> None:
    if settings.mode == "align-infer":
        mapping = _solve(settings, context)
    else:
        mapping = _mapping_from_inputs(context)
    queries = check_embeddings(f"{context.role}'s input 'queries'", context.input("queries"))
    extra: dict[str, np.ndarray] = {}
    if settings.alignment == "client":
        values = mapping.apply(queries)
    else:
        if not bool(np.asarray(context.inputs.get("allow_provider_alignment", False))):
            raise ConfigError(
                f"{context.role} refuses alignment='provider' (App. G.7 hands the provider W*): "
                "set its input 'allow_provider_alignment' to allow it"
            )
        if queries.shape[1] != mapping.weight.shape[0]:
            raise ConfigError(
                f"{context.role}'s queries have {queries.shape[1]} features, its map takes "
                f"{mapping.weight.shape[0]}"
            )
        values = queries
        extra = {MAP_WEIGHT: mapping.weight, MAP_BIAS: mapping.bias}
    keys = ClientKeys.generate(settings.ckks, allow_insecure=settings.allow_insecure)
    count, features = values.shape
    layout = inference_layout(settings.packing, count, features, keys.slots)
    context.state[INFERENCE_KEYS] = keys.secret_state()
    context.state[QUERY_LAYOUT] = np.asarray(
        [LAYOUT_CODES[layout.name], *values.shape], dtype=np.int64
    )
    context.send(
        PROVIDER,
        {
            "context": keys.public_context(layout.rotation_steps()),
            "layout": context.state[QUERY_LAYOUT],
            **_prefixed("queries", keys.encrypt(layout.pack(values))),
            **extra,
        },
    )


def _provider_head(context: RoleContext) -> tuple[np.ndarray, np.ndarray]:
    weight = check_embeddings("the provider's input 'head_weight'", context.input("head_weight"))
    bias = np.asarray(context.input("head_bias"), dtype=np.float64).reshape(-1)
    if bias.size != weight.shape[1]:
        raise ConfigError(f"the head has {weight.shape[1]} classes but {bias.size} biases")
    return weight, bias


def _effective_head(
    settings: HelixSettings,
    client: str,
    message: Mapping[str, np.ndarray],
    features: int,
    head: tuple[np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """The linear map the provider evaluates: its head, or ``W* V``, ``b* V + c`` (App. G.7)."""
    weight, bias = head
    if settings.alignment == "provider":
        mapping = _field(message, MAP_WEIGHT, client).astype(np.float64)
        map_bias = _field(message, MAP_BIAS, client).astype(np.float64).reshape(-1)
        if (
            mapping.ndim != 2
            or mapping.shape[1] != weight.shape[0]
            or map_bias.size != (weight.shape[0])
        ):
            raise ProtocolError(
                f"{client}'s map W* has shape {mapping.shape} (bias {map_bias.size}); the "
                f"provider's head takes {weight.shape[0]} features"
            )
        weight, bias = mapping @ weight, map_bias @ weight + bias
    if features != weight.shape[0]:
        what = "embeddings" if settings.alignment == "provider" else "aligned queries"
        raise ProtocolError(
            f"{client} sent {features}-dimensional {what}; the provider's "
            f"{'map' if settings.alignment == 'provider' else 'head'} takes {weight.shape[0]}"
        )
    return weight, bias


def _classify(settings: HelixSettings, context: RoleContext) -> None:
    head = _provider_head(context)
    for client in settings.client_roles:
        message = context.receive(client)
        code, queries, features = _ints(message, "layout", 3, client)
        weight, bias = _effective_head(settings, client, message, features, head)
        evaluator = _evaluator_for(settings, client, message)
        layout = layout_from_code(code, features, evaluator.slots)
        if queries < 1:
            raise ProtocolError(f"{client} sent no queries")
        uploads = evaluator.load(_unprefixed("queries", message), layout.ciphertexts(queries))
        if isinstance(layout, FeatureMajor):
            outputs = evaluator.linear_features(uploads, layout, weight, bias)
        else:
            outputs = evaluator.linear_rows(uploads, layout, weight, bias)
        context.send(
            client,
            {
                **_prefixed("logits", evaluator.dump(outputs)),
                "classes": np.asarray([weight.shape[1]], dtype=np.int64),
            },
        )


def _reveal(settings: HelixSettings, context: RoleContext) -> None:
    message = context.receive(PROVIDER)
    keys = ClientKeys.restore(context.state.pop(INFERENCE_KEYS), settings.ckks)
    code, queries, features = (int(v) for v in context.state[QUERY_LAYOUT])
    (classes,) = _ints(message, "classes", 1, PROVIDER)
    layout: InferenceLayout = layout_from_code(code, features, keys.slots)
    decrypted = keys.decrypt(_unprefixed("logits", message))
    if decrypted.shape[0] != layout.outputs(queries, classes):
        raise ProtocolError(
            f"expected {layout.outputs(queries, classes)} logit ciphertexts, got "
            f"{decrypted.shape[0]}"
        )
    report = {"logits": layout.unpack(decrypted, queries, classes)}
    if MAP_WEIGHT in context.state:
        report |= {MAP_WEIGHT: context.state[MAP_WEIGHT], MAP_BIAS: context.state[MAP_BIAS]}
    _publish_report(context, report)


# -- the client's sealed report ---------------------------------------------------------------


def _report_key(context: RoleContext) -> bytes | None:
    key = context.inputs.get("report_key")
    if key is None:
        return None
    data = np.asarray(key, dtype=np.uint8).tobytes()
    if len(data) != KEY_BYTES:
        raise ConfigError(f"{context.role}'s report_key must be {KEY_BYTES} bytes, got {len(data)}")
    return data


def _publish_report(context: RoleContext, arrays: dict[str, np.ndarray]) -> None:
    key = _report_key(context)
    if key is not None:
        sealed = seal(key, pack_arrays(arrays), REPORT_LABEL + context.role.encode())
        context.publish("report", np.frombuffer(sealed, dtype=np.uint8))


def open_report(key: bytes, sealed: np.ndarray, role: str) -> dict[str, np.ndarray]:
    """What ``role`` published sealed under ``key`` (its operator's ``report_key``)."""
    data = np.asarray(sealed, dtype=np.uint8).tobytes()
    return unpack_arrays(open_sealed(key, data, REPORT_LABEL + role.encode(), "helix report"))


# -- the declaration --------------------------------------------------------------------------


def helix(
    config: Mapping[str, ConfigValue] | None = None,
    *,
    ckks: CkksParameters = CKKS_8192,
    allow_insecure: bool = False,
) -> Protocol:
    """The HELIX protocol for the run config keys ``config`` (module docstring).

    ``ckks`` and ``allow_insecure`` are code, not run config: the relay hands out the run
    config and must not be able to weaken the encryption. ``allow_insecure`` is for tests.
    """
    settings = settings_from_config(config, ckks=ckks, allow_insecure=allow_insecure)
    clients = settings.client_roles
    align = (
        Step("upload", clients, partial(_upload, settings)),
        Step("cross_covariance", (PROVIDER,), partial(_cross_covariance, settings)),
    )
    infer = (
        Step("query", clients, partial(_query, settings)),
        Step("classify", (PROVIDER,), partial(_classify, settings)),
        Step("reveal", clients, partial(_reveal, settings)),
    )
    steps = {
        "align-infer": align + infer,
        "align": (*align, Step("solve", clients, partial(_solve_step, settings))),
        "infer": infer,
    }[settings.mode]
    return Protocol(
        name="helix",
        roles=(PROVIDER, *clients),
        channels=tuple((PROVIDER, client) for client in clients),
        separated=tuple((PROVIDER, client) for client in clients),
        steps=steps,
        parameters=settings.parameters(),
    )
