"""CENTAUR as a protocol of the fedfm runtime (seed §4, App. A); see ``docs/centaur.md``.

Roles (seed §4.1): ``developer`` (P0: holds Θ and the permutations; online it computes on its
shares with Θ'), ``cloud`` (P1: holds Θ', computes the non-linear layers on permuted plaintext)
and ``client`` (P2: holds the input tokens; deals the correlated randomness, Alg. 6). Every pair
is ``separated``: no node may play two roles (P0 and P1 together would hold both shares; P1 and
P2 together would hold Θ' and the permutations' shares).

Inputs (each role's ``<role>.npz``):

* ``developer`` and ``cloud``: the provisioned model (:func:`fedfm.protocols.centaur.
  provisioning.provisioned_arrays`): Θ' (modes ``faithful``/``hardened``) or the party's weight
  shares (``full-sharing``), with the architecture, calibration and model id. The cloud's is a
  file the developer provisioned out of band; no weight is ever a message.
* ``client``: ``tokens`` (token ids) and optionally ``report_key`` (32 bytes): the client then
  publishes its result sealed under it (ChaCha20-Poly1305), so its operator reads it from the
  run's result and the relay cannot (:func:`open_report`).

Steps: per forward pass ``t`` (1 for BERT, ``max-new-tokens`` for Llama greedy generation, each
pass recomputing the whole sequence: the seed has no KV cache, §7), the client deals
(``p<t>_deal``), then the compute parties run the pass's program (``p<t>_c<k>``, one relay round
trip each, :mod:`~fedfm.protocols.centaur.engine`), then the client reconstructs the logits,
takes the greedy token and deals the next pass (or reports).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from fedfm.errors import ConfigError, InvariantError, ProtocolError
from fedfm.protocols.centaur.defaults import DEFAULTS
from fedfm.protocols.centaur.engine import (
    CLIENT,
    CLOUD,
    DEVELOPER,
    Observer,
    Party,
    Profile,
    Program,
    _no_observer,
    check_tags,
    deal,
    one_hot,
    permutation_matrix,
    run_compute_step,
    tags,
)
from fedfm.protocols.centaur.model import Architecture, random_permutation
from fedfm.protocols.centaur.programs import Calibration, build_forward, check_mode, output_fraction
from fedfm.protocols.centaur.provisioning import Provisioned, load_provisioned
from fedfm.protocols.reports import open_report as _open_report
from fedfm.protocols.reports import seal_report
from fedfm.protocols.sharing import check_fraction, decode, encode
from fedfm.runtime.protocol import Protocol, RoleContext, Step
from fedfm.runtime.transport import ConfigValue

ROLES = (DEVELOPER, CLOUD, CLIENT)
REPORT_LABEL = b"fedfm-centaur-report-v1|"
TEMPLATE_LENGTH = 2  # the schedule does not depend on the length: any length counts the steps


@dataclass(frozen=True)
class CentaurSettings:
    """A run's settings: the run config's keys (:data:`DEFAULTS`), validated."""

    mode: str
    fraction: int
    max_new_tokens: int
    model_id: str
    architecture: Architecture
    request: str

    @property
    def passes(self) -> int:
        return 1 if self.architecture.kind == "bert" else self.max_new_tokens

    def parameters(self) -> dict[str, ConfigValue]:
        """Everything the parties must agree on (part of the signed protocol digest)."""
        return {
            "mode": self.mode,
            "fraction-bits": self.fraction,
            "max-new-tokens": self.max_new_tokens,
            "model-id": self.model_id,
            "architecture": self.architecture.to_json(),
            "request": self.request,
        }


def settings_from_config(config: Mapping[str, ConfigValue] | None) -> CentaurSettings:
    """Validated settings; :class:`ConfigError` names an unknown key or a bad value."""
    merged = {**DEFAULTS, **(config or {})}
    unknown = sorted(set(merged) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown centaur run config keys {unknown}; known: {sorted(DEFAULTS)}")
    tokens = merged["max-new-tokens"]
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ConfigError(f"centaur max-new-tokens must be a positive integer, got {tokens!r}")
    fraction = merged["fraction-bits"]
    if not isinstance(fraction, int) or isinstance(fraction, bool):
        raise ConfigError(f"centaur fraction-bits must be an integer, got {fraction!r}")
    if not str(merged["model-id"]) or not str(merged["architecture"]):
        raise ConfigError(
            "centaur needs 'model-id' and 'architecture' (the provisioned model's id and public "
            "shape: fedfm.protocols.centaur.provisioning.run_config gives both)"
        )
    return CentaurSettings(
        mode=check_mode(str(merged["mode"])),
        fraction=check_fraction(fraction),
        max_new_tokens=tokens,
        model_id=str(merged["model-id"]),
        architecture=Architecture.from_json(str(merged["architecture"])),
        request=str(merged["request"]),
    )


@dataclass
class CentaurRun:
    """The roles' step actions for one run (module docstring), with per-run caches."""

    settings: CentaurSettings
    observer: Observer = _no_observer
    profile: Profile | None = None  # per-instruction compute time and bytes (benchmarks)
    _programs: dict[int, Program] = field(default_factory=dict)
    _models: dict[str, Provisioned] = field(default_factory=dict)
    _encoded: dict[tuple[str, str, int], np.ndarray] = field(default_factory=dict)
    _rounds: int = 0

    def program(self, n: int) -> Program:
        if n not in self._programs:
            s = self.settings
            model_calibration = (
                next(iter(self._models.values())).calibration if self._models else None
            )
            self._programs[n] = build_forward(
                s.architecture,
                n,
                mode=s.mode,
                fraction=s.fraction,
                calibration=model_calibration or Calibration(),
            )
        return self._programs[n]

    def rounds(self) -> int:
        """Relay round trips of one forward pass (the same for every length)."""
        if not self._rounds:
            s = self.settings
            self._rounds = build_forward(
                s.architecture,
                TEMPLATE_LENGTH,
                mode=s.mode,
                fraction=s.fraction,
                calibration=Calibration(),
            ).rounds()
        return self._rounds

    def purpose(self, forward_pass: int) -> str:
        return f"centaur/{self.settings.request}/p{forward_pass}"

    # -- the compute parties' model ------------------------------------------------------------

    def model(self, context: RoleContext) -> Provisioned:
        role = context.role
        if role not in self._models:
            provisioned = load_provisioned(context.inputs, role=role)
            s = self.settings
            if provisioned.model_id != s.model_id:
                raise ProtocolError(
                    f"the {role} was provisioned for model {provisioned.model_id}, this run asks "
                    f"for model {s.model_id}: refused"
                )
            if provisioned.architecture != s.architecture:
                raise ProtocolError(f"the {role}'s provisioned architecture is not the run's")
            wanted = "share" if s.mode == "full-sharing" else "permuted"
            if provisioned.kind != wanted:
                raise ProtocolError(
                    f"mode {s.mode!r} needs the {role} provisioned with {wanted} weights, it holds "
                    f"{provisioned.kind} ones"
                )
            if provisioned.kind == "share" and provisioned.fraction != s.fraction:
                raise ProtocolError(
                    f"the {role}'s weight shares encode fixed point with {provisioned.fraction} "
                    f"fractional bits, the run with {s.fraction}: mismatched fixed-point settings"
                )
            self._models[role] = provisioned
            self._programs.clear()  # rebuild with the provisioned calibration
        return self._models[role]

    def party(self, context: RoleContext, forward_pass: int) -> Party:
        model = self.model(context)

        def encoded(name: str, fraction: int) -> np.ndarray:
            key = (context.role, name, fraction)
            if key not in self._encoded:
                self._encoded[key] = encode(model.weight(name), fraction)
            return self._encoded[key]

        return Party(
            context,
            weights=model.weight,
            encoded=encoded,
            fraction=self.settings.fraction,
            purpose=self.purpose(forward_pass),
            observer=self.observer,
            tags=tags(self.settings.request, forward_pass, self.settings.fraction),
        )

    # -- the client -----------------------------------------------------------------------------

    def _client_tokens(self, context: RoleContext) -> np.ndarray:
        if "tokens" not in context.state:
            ids = np.asarray(context.input("tokens"))
            if ids.dtype.kind not in "iu" or ids.ndim != 1 or ids.size == 0:
                raise ConfigError(
                    "the client's input 'tokens' must be a non-empty 1-D array of ids"
                )
            a = self.settings.architecture
            if ids.min() < 0 or ids.max() >= a.vocab:
                raise ConfigError(f"token ids must be in [0, {a.vocab})")
            total = ids.size + self.settings.passes - 1
            if total > a.max_positions:
                raise ConfigError(
                    f"{ids.size} tokens and {self.settings.passes - 1} more exceed the model's "
                    f"{a.max_positions} positions"
                )
            context.state["tokens"] = ids.astype(np.int64)
        return context.state["tokens"]

    def _collect(self, context: RoleContext, forward_pass: int) -> None:
        """Reconstruct the previous pass's logits; Llama: append the greedy token."""
        s = self.settings
        parts = []
        for role in (DEVELOPER, CLOUD):
            arrays = context.receive(role)
            check_tags(arrays, role, s.request, forward_pass, s.fraction)
            parts.append(arrays["output"])
        logits = decode(parts[0] + parts[1], output_fraction(s.mode, s.fraction)).reshape(-1)
        previous = context.state.get("logits")
        context.state["logits"] = (
            logits[None] if previous is None else np.vstack([previous, logits])
        )
        if s.architecture.kind == "llama":
            token = np.asarray([int(np.argmax(logits))], np.int64)
            context.state["generated"] = np.concatenate(
                [context.state.get("generated", np.zeros(0, np.int64)), token]
            )
            context.state["tokens"] = np.concatenate([context.state["tokens"], token])

    def client_deal(self, forward_pass: int, context: RoleContext) -> None:
        s = self.settings
        if forward_pass > 0:
            self._collect(context, forward_pass - 1)
        ids = self._client_tokens(context)
        n = len(ids)
        program = self.program(n)
        secrets: dict[str, np.ndarray] = {"input": one_hot(ids, s.architecture.vocab)}
        for item in program.secrets:
            if item.source.startswith("perm"):
                count = 1 if len(item.shape) == 2 else item.shape[0]
                matrices = [permutation_matrix(random_permutation(n)) for _ in range(count)]
                secrets[item.source] = matrices[0] if len(item.shape) == 2 else np.stack(matrices)
        explicit = deal(
            context, program.deals(), purpose=self.purpose(forward_pass), secrets=secrets
        )
        header = tags(s.request, forward_pass, s.fraction) | {"length": np.asarray([n], np.int64)}
        context.send(CLOUD, header | {f"d.{name}": value for name, value in explicit.items()})
        context.send(DEVELOPER, header)

    def client_report(self, context: RoleContext) -> None:
        self._collect(context, self.settings.passes - 1)
        report = {"logits": context.state["logits"]}
        if "generated" in context.state:
            report["tokens"] = context.state["generated"]
        key = context.inputs.get("report_key")
        if key is not None:
            context.publish(
                "report",
                seal_report(
                    np.asarray(key, np.uint8).tobytes(), report, REPORT_LABEL + CLIENT.encode()
                ),
            )

    # -- the compute parties ----------------------------------------------------------------------

    def compute(self, forward_pass: int, step: int, context: RoleContext) -> None:
        s = self.settings
        if step == 0:
            arrays = context.receive(CLIENT)
            check_tags(arrays, CLIENT, s.request, forward_pass, s.fraction)
            context.state["length"] = np.asarray(arrays["length"], np.int64)
            for name, value in arrays.items():
                if name.startswith("d."):
                    context.state[name] = value
        if "length" not in context.state:
            raise ProtocolError(f"the {context.role} has no dealt length for pass {forward_pass}")
        n = int(context.state["length"][0])
        party = self.party(context, forward_pass)
        program = self.program(n)
        total = program.rounds()
        if total != self.rounds():
            raise InvariantError(f"a program of length {n} has {total} rounds, not {self.rounds()}")
        run_compute_step(
            program, step, party, request=s.request, forward_pass=forward_pass, profile=self.profile
        )
        if step == total - 1:
            for name in [k for k in context.state if k.startswith(("v.", "d."))]:
                del context.state[name]

    def steps(self) -> list[Step]:
        rounds = self.rounds()
        steps: list[Step] = []
        for forward_pass in range(self.settings.passes):
            steps.append(
                Step(f"p{forward_pass}_deal", (CLIENT,), partial(self.client_deal, forward_pass))
            )
            steps += [
                Step(
                    f"p{forward_pass}_c{k}",
                    (DEVELOPER, CLOUD),
                    partial(self.compute, forward_pass, k),
                )
                for k in range(rounds)
            ]
        steps.append(Step("report", (CLIENT,), self.client_report))
        return steps


def centaur(
    config: Mapping[str, ConfigValue] | None = None, *, observer: Observer | None = None
) -> Protocol:
    """The CENTAUR protocol for the run config keys ``config`` (module docstring).

    ``observer(role, name, value)`` is called with every plaintext the cloud reconstructs
    (tests and the attacks use it to see exactly what P1 sees).
    """
    settings = settings_from_config(config)
    run = CentaurRun(settings, observer or _no_observer)
    pairs = ((DEVELOPER, CLOUD), (DEVELOPER, CLIENT), (CLOUD, CLIENT))
    return Protocol(
        name="centaur",
        roles=ROLES,
        channels=pairs,
        separated=pairs,
        steps=tuple(run.steps()),
        parameters=settings.parameters(),
    )


def open_report(key: bytes, sealed: np.ndarray) -> dict[str, np.ndarray]:
    """What the client published sealed under ``key`` (its operator's ``report_key``)."""
    return _open_report(key, sealed, REPORT_LABEL + CLIENT.encode(), "centaur report")
