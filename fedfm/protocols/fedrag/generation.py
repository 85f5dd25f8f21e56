"""Collaborative generation: prefill and decoding with scrambled distributed attention (§5.3).

Segments in sequence order: ``owner_0``'s, ..., ``owner_{n-1}``'s, then the coordinator's query
(§5.3: the last segment is the query, so its owner, the coordinator, goes on decoding). Steps:

``segments`` (owners)
    Each owner builds its segment (its token ids) and sends its length and model fingerprint to
    every later inquirer. ``owner_0`` has no context before it: it prefills alone and sends its
    scrambled, token-permuted keys and values of every layer to the compute role of each
    (later inquirer, owner_0) pair, under that pair's key set for that layer.
``<inquirer>_b<block>_l<layer>_q`` (the inquirer)
    Finishes the previous layer (below), then computes the layer's queries, keys and values and
    sends, per context owner, ``Q S`` with its rows permuted (a fresh permutation from the OS
    CSPRNG) to the pair's compute role.
``<inquirer>_b<block>_l<layer>_attn`` (compute roles)
    Store keys and values that arrived; answer each query with ``(O', lse)`` per owner
    (Eqs. 4-5 on scrambled inputs).
(next ``_q`` step, or ``..._done``, or ``report``)
    The inquirer un-permutes and unscrambles ``O' M^{-1}`` and merges it with its local attention
    over its own tokens (Eq. 6), and runs the rest of the layer. After its segment's last layer an
    owner sends its own scrambled keys and values to the compute roles of the later inquirers.

Block 0 of the coordinator is its query's prefill; it yields the first token (the time to first
token). Blocks ``1 .. T-1`` decode one token each: one compute exchange (two relay round trips)
per layer per token; the compute nodes already hold every owner's scrambled cache, and the
coordinator keeps its own keys and values (the query's and the generated tokens') locally
(§5.3: "the Inquirer does not need to send the newly computed K and V").

``attention = "distributed"`` (the ablation's "+Distributed") runs the same steps with the
identity instead of the scramblers and no token permutation; a context owner refuses it unless
its input ``allow_plaintext_attention`` is set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

import fedfm.protocols.fedrag.keys as keyring
from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.fedrag.attention import (
    attention_with_lse,
    causal_mask,
    merge_attention,
    repeat_kv,
)
from fedfm.protocols.fedrag.decoder import DecoderRunner
from fedfm.protocols.fedrag.plan import COORDINATOR, RolePlan
from fedfm.protocols.fedrag.scrambler import AttentionKeys, key_purpose, token_permutation
from fedfm.runtime.protocol import RoleContext, Step

RunnerFor = Callable[[str], DecoderRunner]
SegmentFor = Callable[[RoleContext, DecoderRunner], np.ndarray]
Report = Callable[[RoleContext, dict[str, np.ndarray]], None]
STAGE = "generate"


@dataclass(frozen=True)
class GenerationSettings:
    """What the generation steps need (a slice of the protocol's settings)."""

    plan: RolePlan
    layers: int
    max_new_tokens: int
    attention: str  # "scrambled" or "distributed"
    scrambler: str
    scaling_range: float
    request: str
    scaling: float  # the model's attention scaling (public)


def _fingerprint_check(
    context: RoleContext, runner: DecoderRunner, sender: str, fp: np.ndarray
) -> None:
    theirs = np.asarray(fp, dtype=np.uint8).tobytes()
    if theirs != runner.fingerprint:
        raise ProtocolError(
            f"mismatched model configs: {sender} runs a decoder with fingerprint {theirs.hex()}, "
            f"{context.role} runs {runner.fingerprint.hex()}: every party must load the same "
            "model (architecture and weights)"
        )


def _fp(runner: DecoderRunner) -> np.ndarray:
    return np.frombuffer(runner.fingerprint, dtype=np.uint8).copy()


class Generation:
    """The generation steps of one run (see the module docstring)."""

    def __init__(
        self,
        settings: GenerationSettings,
        *,
        runner_for: RunnerFor,
        segment_for: SegmentFor,
        report: Report,
    ) -> None:
        self.settings = settings
        self.plan = settings.plan
        self.runner_for, self.segment_for, self.report = runner_for, segment_for, report

    # -- keys -----------------------------------------------------------------------------------

    def _keys(
        self, context: RoleContext, runner: DecoderRunner, inquirer: str, owner: str, layer: int
    ) -> AttentionKeys | None:
        """The pair's key set for ``layer``: derived once (ledger), then kept by the inquirer."""
        if self.settings.attention == "distributed":
            return None
        g = runner.geometry
        prefix = f"keys.{owner if context.role == inquirer else inquirer}.{layer}"
        if context.role == inquirer and f"{prefix}.qk" in context.state:
            return keyring.keys_from_state(context.state, prefix, self.settings.scrambler)
        peer = owner if context.role == inquirer else inquirer
        keys = keyring.derive(
            context,
            peer,
            key_purpose(self.settings.request, STAGE, inquirer, owner, layer),
            heads=g.kv_heads,
            head_dim=g.head_dim,
            kind=self.settings.scrambler,
            scaling_range=self.settings.scaling_range,
        )
        if context.role == inquirer:
            context.state.update(keyring.keys_to_arrays(prefix, keys))
        return keys

    # -- the owner's segment --------------------------------------------------------------------

    def _later(self, role: str) -> tuple[str, ...]:
        order = self.plan.inquirers
        return order[order.index(role) + 1 :]

    def _earlier(self, role: str) -> tuple[str, ...]:
        order = self.plan.inquirers
        return order[: order.index(role)]

    def _segments(self, context: RoleContext) -> None:
        role = context.role
        runner = self.runner_for(role)
        if self.settings.attention == "distributed" and not bool(
            np.asarray(context.inputs.get("allow_plaintext_attention", False))
        ):
            raise ConfigError(
                f"{role} refuses attention='distributed': it sends its keys and values to the "
                "compute node unscrambled (the ablation's +Distributed); set the owner's input "
                "'allow_plaintext_attention' to allow it"
            )
        segment = np.asarray(self.segment_for(context, runner), dtype=np.int64)
        if segment.ndim != 1 or segment.size == 0:
            raise ConfigError(f"{role}'s segment must be a non-empty vector of token ids")
        context.state["segment"] = segment
        for later in self._later(role):
            context.send(later, {"length": np.asarray([segment.size]), "fp": _fp(runner)})
        if role == self.plan.inquirers[0]:
            self._start_block(context, runner, segment, offset=0)
            for layer in range(self.settings.layers):
                self._finish_layer(context, runner, layer, remote={})
            self._send_cache(context, runner)

    # -- an inquirer's blocks -------------------------------------------------------------------

    def _start_block(
        self, context: RoleContext, runner: DecoderRunner, ids: np.ndarray, *, offset: int
    ) -> None:
        context.state["positions"] = offset + np.arange(ids.size)
        context.state["hidden"] = runner.embed(ids)

    def _offset(self, context: RoleContext, runner: DecoderRunner) -> int:
        """Where this inquirer's segment starts: the lengths its predecessors sent."""
        total = 0
        for earlier in self._earlier(context.role):
            message = context.receive(earlier)
            _fingerprint_check(context, runner, earlier, message["fp"])
            length = int(np.asarray(message["length"]).reshape(-1)[0])
            context.state[f"length.{earlier}"] = np.asarray([length])
            total += length
        return total

    def _send_queries(self, context: RoleContext, runner: DecoderRunner, layer: int) -> None:
        hidden, positions = context.state["hidden"], context.state["positions"]
        q, _, _ = runner.qkv(layer, hidden, positions)
        by_compute: dict[str, dict[str, np.ndarray]] = {}
        for owner in self._earlier(context.role):
            keys = self._keys(context, runner, context.role, owner, layer)
            order = np.arange(q.shape[1])
            scrambled = q
            if keys is not None:
                order = token_permutation(q.shape[1])
                scrambled = keys.scramble_queries(q, runner.geometry.groups)[:, order]
            context.state[f"perm.{owner}"] = order
            message = by_compute.setdefault(
                self.plan.compute_role(context.role, owner),
                {"fp": _fp(runner), "layer": np.asarray([layer])},
            )
            message[f"q.{owner}"] = np.ascontiguousarray(scrambled, dtype=np.float32)
        for compute, message in by_compute.items():
            context.send(compute, message)

    def _remote_parts(
        self, context: RoleContext, runner: DecoderRunner, layer: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The unscrambled ``(O_i, lse_i)`` per context owner from the compute roles."""
        parts = {}
        groups = runner.geometry.groups
        for owner in self._earlier(context.role):
            message = context.receive(self.plan.compute_role(context.role, owner))
            out, lse = message[f"out.{owner}"], message[f"lse.{owner}"]
            order = context.state.pop(f"perm.{owner}")
            restored_out, restored_lse = np.empty_like(out), np.empty_like(lse)
            restored_out[:, order], restored_lse[:, order] = out, lse
            keys = self._keys(context, runner, context.role, owner, layer)
            if keys is not None:
                restored_out = keys.unscramble_outputs(restored_out.astype(np.float64), groups)
            parts[owner] = (
                torch.from_numpy(np.ascontiguousarray(restored_out, dtype=np.float32)),
                torch.from_numpy(np.ascontiguousarray(restored_lse, dtype=np.float32)),
            )
        return parts

    def _finish_layer(
        self,
        context: RoleContext,
        runner: DecoderRunner,
        layer: int,
        *,
        remote: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Local attention over the inquirer's own tokens merged with ``remote`` (Eq. 6)."""
        g = runner.geometry
        own_k = context.state.get(f"own.{layer}.k")
        own_v = context.state.get(f"own.{layer}.v")
        new: dict[str, np.ndarray] = {}

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = k if own_k is None else torch.cat([torch.from_numpy(own_k), k], dim=1)
            values = v if own_v is None else torch.cat([torch.from_numpy(own_v), v], dim=1)
            new["k"], new["v"] = keys.numpy().copy(), values.numpy().copy()
            past = 0 if own_k is None else own_k.shape[1]
            local = attention_with_lse(
                q,
                repeat_kv(keys, g.groups),
                repeat_kv(values, g.groups),
                scaling=runner.scaling,
                allowed=causal_mask(q.shape[1], keys.shape[1], offset=past),
            )
            output, _ = merge_attention([local, *remote.values()])
            return output

        hidden = runner.finish(layer, context.state["hidden"], context.state["positions"], attend)
        context.state["hidden"] = hidden
        context.state[f"own.{layer}.k"], context.state[f"own.{layer}.v"] = new["k"], new["v"]

    def _send_cache(self, context: RoleContext, runner: DecoderRunner) -> None:
        """An owner's scrambled, token-permuted keys and values for every later inquirer."""
        by_compute: dict[str, dict[str, np.ndarray]] = {}
        for inquirer in self._later(context.role):
            compute = self.plan.compute_role(inquirer, context.role)
            message = by_compute.setdefault(compute, {"fp": _fp(runner)})
            for layer in range(self.settings.layers):
                k = context.state[f"own.{layer}.k"]
                v = context.state[f"own.{layer}.v"]
                keys = self._keys(context, runner, inquirer, context.role, layer)
                if keys is not None:
                    order = token_permutation(k.shape[1])  # the same order for K and V
                    k = keys.scramble_keys(k.astype(np.float64))[:, order]
                    v = keys.scramble_values(v.astype(np.float64))[:, order]
                message[f"kv.{inquirer}.{layer}.k"] = np.ascontiguousarray(k, dtype=np.float32)
                message[f"kv.{inquirer}.{layer}.v"] = np.ascontiguousarray(v, dtype=np.float32)
        for compute, message in by_compute.items():
            context.send(compute, message)
        for name in [n for n in context.state if n.startswith(("own.", "hidden", "positions"))]:
            del context.state[name]  # an owner's part of the prefill is done

    # -- step actions ---------------------------------------------------------------------------

    def _inquirer_step(self, block: int, layer: int, context: RoleContext) -> None:
        """Finish ``layer - 1`` of ``block`` (or the previous block), start ``layer``."""
        runner = self.runner_for(context.role)
        if block == 0 and layer == 0:
            offset = self._offset(context, runner)
            if "segment" not in context.state:  # the coordinator's query
                segment = np.asarray(self.segment_for(context, runner), dtype=np.int64)
                if segment.ndim != 1 or segment.size == 0:
                    raise ConfigError(f"{context.role}'s query must be a non-empty vector of ids")
                context.state["segment"] = segment
            self._start_block(context, runner, context.state["segment"], offset=offset)
        else:
            previous = self.settings.layers - 1 if layer == 0 else layer - 1
            remote = self._remote_parts(context, runner, previous)
            self._finish_layer(context, runner, previous, remote=remote)
            if layer == 0:
                self._next_token(context, runner)
        self._send_queries(context, runner, layer)

    def _next_token(self, context: RoleContext, runner: DecoderRunner) -> None:
        """The coordinator's block is done: its next token starts the next block."""
        logits = runner.logits(context.state["hidden"][-1:])[0]
        forced = context.inputs.get("forced")
        tokens = list(context.state.get("tokens", np.zeros(0, dtype=np.int64)))
        step = len(tokens)
        if forced is not None and step < len(np.asarray(forced).reshape(-1)):
            token = int(np.asarray(forced).reshape(-1)[step])
        else:
            token = int(np.argmax(logits))
        context.state["tokens"] = np.asarray([*tokens, token], dtype=np.int64)
        previous = context.state.get("logits")
        row = logits.astype(np.float32)[None]
        context.state["logits"] = row if previous is None else np.concatenate([previous, row])
        position = int(context.state["positions"][-1]) + 1
        self._start_block(context, runner, np.asarray([token]), offset=position)

    def _owner_done(self, context: RoleContext) -> None:
        runner = self.runner_for(context.role)
        last = self.settings.layers - 1
        self._finish_layer(context, runner, last, remote=self._remote_parts(context, runner, last))
        self._send_cache(context, runner)

    def _report(self, context: RoleContext) -> None:
        runner = self.runner_for(context.role)
        last = self.settings.layers - 1
        self._finish_layer(context, runner, last, remote=self._remote_parts(context, runner, last))
        self._next_token(context, runner)
        self.report(
            context,
            {"tokens": context.state["tokens"], "logits": context.state["logits"]},
        )

    def _compute(self, context: RoleContext) -> None:
        """Store arriving caches; answer every query of the pairs this role serves."""
        served = self.plan.served(context.role)
        queries = []
        for message in context.inbox:
            arrays = message.arrays
            if any(name.startswith("kv.") for name in arrays):
                for name, value in arrays.items():
                    if name.startswith("kv."):
                        _, inquirer, rest = name.split(".", 2)
                        if (inquirer, message.sender) not in served:
                            raise ProtocolError(
                                f"{message.sender} sent keys for inquirer {inquirer}, a pair "
                                f"{context.role} does not serve"
                            )
                        context.state[f"kv.{inquirer}.{message.sender}.{rest}"] = value
                context.state[f"fp.{message.sender}"] = arrays["fp"]
            else:
                queries.append(message)
        for message in queries:
            inquirer, arrays = message.sender, message.arrays
            layer = int(np.asarray(arrays["layer"]).reshape(-1)[0])
            reply: dict[str, np.ndarray] = {}
            for name, q in arrays.items():
                if not name.startswith("q."):
                    continue
                owner = name[2:]
                if (inquirer, owner) not in served:
                    raise ProtocolError(
                        f"{inquirer} sent queries for owner {owner}, a pair {context.role} does "
                        "not serve"
                    )
                prefix = f"kv.{inquirer}.{owner}.{layer}"
                if f"{prefix}.k" not in context.state:
                    raise ProtocolError(
                        f"{context.role} holds no keys of {owner} for {inquirer} at layer {layer}"
                    )
                theirs = context.state[f"fp.{owner}"].tobytes()
                if theirs != np.asarray(arrays["fp"], dtype=np.uint8).tobytes():
                    raise ProtocolError(
                        f"mismatched model configs: {inquirer} and {owner} run decoders with "
                        f"fingerprints {np.asarray(arrays['fp'], np.uint8).tobytes().hex()} and "
                        f"{theirs.hex()}"
                    )
                k, v = context.state[f"{prefix}.k"], context.state[f"{prefix}.v"]
                groups = q.shape[0] // k.shape[0]
                out, lse = attention_with_lse(
                    q,
                    repeat_kv(torch.from_numpy(k), groups),
                    repeat_kv(torch.from_numpy(v), groups),
                    scaling=self.settings.scaling,
                )
                reply[f"out.{owner}"] = out.numpy().astype(np.float32)
                reply[f"lse.{owner}"] = lse.numpy().astype(np.float32)
            context.send(inquirer, reply)

    # -- the declaration ------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        plan, layers = self.plan, self.settings.layers
        steps = [Step("segments", plan.owner_roles, self._segments)]
        finishing: str | None = None
        for inquirer in plan.inquirers[1:]:
            computes = tuple(
                dict.fromkeys(plan.compute_role(inquirer, o) for o in self._earlier(inquirer))
            )
            blocks = self.settings.max_new_tokens if inquirer == COORDINATOR else 1
            for block in range(blocks):
                for layer in range(layers):
                    action: Callable[[RoleContext], None] = partial(
                        self._inquirer_step, block, layer
                    )
                    roles: tuple[str, ...] = (inquirer,)
                    if finishing is not None:
                        done, action = (
                            finishing,
                            _both(finishing, self._owner_done, inquirer, action),
                        )
                        roles = (done, inquirer)
                        finishing = None
                    steps.append(Step(f"{inquirer}_b{block}_l{layer}_q", roles, action))
                    steps.append(
                        Step(f"{inquirer}_b{block}_l{layer}_attn", computes, self._compute)
                    )
            finishing = inquirer if inquirer != COORDINATOR else None
        steps.append(Step("report", (COORDINATOR,), self._report))
        return steps


def _both(
    first: str,
    first_action: Callable[[RoleContext], None],
    second: str,
    second_action: Callable[[RoleContext], None],
) -> Callable[[RoleContext], None]:
    """One step in which two roles act, each by its own action."""

    def act(context: RoleContext) -> None:
        if context.role == first:
            first_action(context)
        elif context.role == second:
            second_action(context)
        else:
            raise ProtocolError(f"{context.role} does not act in this step")

    return act
