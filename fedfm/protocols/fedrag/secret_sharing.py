"""The secret-sharing baseline: PermLLM-style cross-node attention on the same runtime.

The seed compares with PermLLM "applying its cryptographic operations solely to the attention
computation" (§7.1). CrypTen does not install with this torch, so this is written on the fedfm
runtime, with the same roles, steps shape, decoder and network presets as FedRAG. For each
(inquirer ``I``, context owner ``O``) pair and layer, with the pair's compute role as the
*dealer* ``D`` of correlated randomness (it never sees an input):

1. ``I`` computes its queries ``Q`` and tells ``D`` the shapes.
2. ``D`` deals two Beaver triples over the ring ``Z_{2^64}`` (fixed point, :data:`FRACTION`
   bits): ``(A, B, C = A B)`` for ``Q K^T`` (``A`` to ``I``, ``B`` to ``O``, ``C`` shared) and
   ``(A2, B2, C2 = A2 B2)`` for ``W V`` (``A2`` and ``C2`` shared, ``B2`` to ``O``). Masks come
   from the OS CSPRNG through ChaCha20.
3. ``I`` opens ``E = Q - A`` to ``O``; ``O`` opens ``F = K^T - B`` to ``I``.
4. Each holds a share of ``S = Q K^T`` (``I``: ``C_I + A F + E F``; ``O``: ``C_O + E B``),
   truncated; both permute rows and columns by ``rho, pi`` from their pair randomness and send
   their shares to ``D``.
5. The secure softmax, PermLLM's way: ``D`` reconstructs the *permuted* scores ``rho S pi``
   (PermLLM's leakage: permuted plaintext scores at a third party), computes ``W = softmax``
   and the log-sum-exp in the clear and secret-shares both back.
6. ``I`` and ``O`` open ``E2 = W - A2``; ``O`` also opens ``F2 = pi^T V - B2`` to ``I``.
7. Shares of ``Z = W (pi^T V)``; ``O`` sends its shares of ``Z`` and the log-sum-exp to ``I``,
   which reconstructs, un-permutes ``rho`` and merges with its local attention (Eq. 6).

Seven relay round trips per layer per pair instead of FedRAG's two, and ``n x m`` ring matrices
on the wire. The ring arithmetic (fixed point, shares, local truncation) is
:mod:`fedfm.protocols.sharing`, shared with CENTAUR. Fixed point costs accuracy (about ``2^-16``
per value): its logit error is reported beside FedRAG's. Owners keep their keys and values
(nobody holds them scrambled).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from fedfm.errors import ProtocolError
from fedfm.protocols.fedrag.decoder import DecoderRunner
from fedfm.protocols.fedrag.generation import Generation, _both
from fedfm.protocols.fedrag.plan import COORDINATOR
from fedfm.protocols.sharing import (
    FRACTION,
    SCALE,
    decode,
    encode,
    ring_matmul,
    share,
    truncate,
    uniform,
)
from fedfm.runtime.protocol import RoleContext, Step

__all__ = [
    "FRACTION",
    "SCALE",
    "SecretSharingGeneration",
    "decode",
    "encode",
    "ring_matmul",
    "share",
    "truncate",
    "uniform",
]


class SecretSharingGeneration(Generation):
    """The generation steps with the seven-round-trip attention exchange above."""

    # -- owners keep their keys and values ----------------------------------------------------

    def _send_cache(self, context: RoleContext, runner: DecoderRunner) -> None:
        for layer in range(self.settings.layers):
            context.state[f"ctx.{layer}.k"] = context.state.pop(f"own.{layer}.k")
            context.state[f"ctx.{layer}.v"] = context.state.pop(f"own.{layer}.v")
        for name in [n for n in context.state if n.startswith(("own.", "hidden", "positions"))]:
            del context.state[name]

    def _pair_generator(
        self, context: RoleContext, inquirer: str, owner: str, layer: int, block: int
    ) -> np.random.Generator:
        peer = owner if context.role == inquirer else inquirer
        purpose = f"fedrag-ss/{self.settings.request}/{inquirer}<-{owner}/b{block}/l{layer}"
        return context.shared_generator(peer, purpose)

    # -- 1. the inquirer's queries ---------------------------------------------------------------

    def _send_queries(self, context: RoleContext, runner: DecoderRunner, layer: int) -> None:
        q, _, _ = runner.qkv(layer, context.state["hidden"], context.state["positions"])
        context.state["ss.q"] = q
        by_compute: dict[str, dict[str, np.ndarray]] = {}
        for owner in self._earlier(context.role):
            length = int(context.state[f"length.{owner}"][0])
            message = by_compute.setdefault(self.plan.compute_role(context.role, owner), {})
            message[f"{owner}.shape"] = np.asarray([q.shape[0], q.shape[1], q.shape[2], length])
        for compute, message in by_compute.items():
            context.send(compute, message)

    # -- 2. the dealer --------------------------------------------------------------------------

    def _deal(self, context: RoleContext) -> None:
        for message in context.inbox:
            inquirer = message.sender
            to_inquirer: dict[str, np.ndarray] = {}
            for name, shape in message.arrays.items():
                owner = name[: -len(".shape")]
                if (inquirer, owner) not in self.plan.served(context.role):
                    raise ProtocolError(
                        f"the dealer {context.role} does not serve {inquirer}<-{owner}"
                    )
                heads, n, d, m = (int(v) for v in shape)
                a, b = uniform((heads, n, d)), uniform((heads, d, m))
                c_i, c_o = share(ring_matmul(a, b))
                a2_i, a2_o = share(uniform((heads, n, m)))
                b2 = uniform((heads, m, d))
                c2_i, c2_o = share(ring_matmul(a2_i + a2_o, b2))
                to_inquirer |= {
                    f"{owner}.a": a,
                    f"{owner}.c": c_i,
                    f"{owner}.a2": a2_i,
                    f"{owner}.c2": c2_i,
                }
                context.send(
                    owner,
                    {
                        "b": b,
                        "c": c_o,
                        "a2": a2_o,
                        "b2": b2,
                        "c2": c2_o,
                        "for": np.frombuffer(inquirer.encode(), np.uint8),
                    },
                )
            context.send(inquirer, to_inquirer)

    # -- 3. open E and F ------------------------------------------------------------------------

    def _triples(self, context: RoleContext, inquirer: str) -> None:
        """Store the triples the dealer(s) sent (inquirer: one message per dealer)."""
        for message in context.inbox:
            arrays = message.arrays
            if context.role == inquirer and any(name.endswith(".a") for name in arrays):
                for name, value in arrays.items():
                    context.state[f"ss.{name}"] = value
            elif "for" in arrays:
                for name in ("b", "c", "a2", "b2", "c2"):
                    context.state[f"ss.{name}"] = arrays[name]

    def _open1(self, inquirer: str, layer: int, context: RoleContext) -> None:
        self._triples(context, inquirer)
        if context.role == inquirer:
            q = encode(context.state["ss.q"])
            for owner in self._earlier(inquirer):
                context.send(owner, {"e": q - context.state[f"ss.{owner}.a"]})
        else:
            kt = encode(np.swapaxes(self._context_keys(context, layer), 1, 2))
            context.send(inquirer, {"f": kt - context.state["ss.b"]})

    # -- 4. shares of the scores, permuted, to the dealer ---------------------------------------

    def _scores(self, inquirer: str, layer: int, block: int, context: RoleContext) -> None:
        if context.role == inquirer:
            for owner in self._earlier(inquirer):
                f = context.receive(owner)["f"]
                a, c = context.state[f"ss.{owner}.a"], context.state[f"ss.{owner}.c"]
                e = encode(context.state["ss.q"]) - a
                s = truncate(c + ring_matmul(a, f) + ring_matmul(e, f), 0)
                rng = self._pair_generator(context, inquirer, owner, layer, block)
                rho, pi = rng.permutation(s.shape[1]), rng.permutation(s.shape[2])
                context.state[f"ss.{owner}.rho"] = rho
                context.send(
                    self.plan.compute_role(inquirer, owner),
                    {f"{inquirer}.{owner}": s[:, rho][:, :, pi]},
                )
        else:
            e = context.receive(inquirer)["e"]
            s = truncate(context.state["ss.c"] + ring_matmul(e, context.state["ss.b"]), 1)
            rng = self._pair_generator(context, inquirer, context.role, layer, block)
            rho, pi = rng.permutation(s.shape[1]), rng.permutation(s.shape[2])
            context.state["ss.pi"] = pi
            context.send(
                self.plan.compute_role(inquirer, context.role),
                {f"{inquirer}.{context.role}": s[:, rho][:, :, pi]},
            )

    # -- 5. the dealer's softmax on permuted scores (PermLLM's secure softmax) ------------------

    def _collect(self, context: RoleContext) -> None:
        shares: dict[str, dict[str, np.ndarray]] = {}
        for message in context.inbox:
            for name, value in message.arrays.items():
                shares.setdefault(name, {})[message.sender] = value
        for name, parts in shares.items():
            inquirer, _, owner = name.partition(".")
            if (inquirer, owner) not in self.plan.served(context.role):
                raise ProtocolError(f"the dealer {context.role} does not serve {inquirer}<-{owner}")
            if set(parts) != {inquirer, owner}:
                raise ProtocolError(
                    f"the dealer got the scores of {inquirer}<-{owner} from {sorted(parts)}"
                )
            scores = decode(parts[inquirer] + parts[owner]) * self.settings.scaling
            lse = torch.logsumexp(torch.from_numpy(scores), dim=-1).numpy()
            weights = np.exp(scores - lse[..., None])
            w_i, w_o = share(encode(weights))
            l_i, l_o = share(encode(lse))
            context.send(inquirer, {f"{owner}.w": w_i, f"{owner}.lse": l_i})
            context.send(owner, {"w": w_o, "lse": l_o})

    # -- 6. open E2 (and F2) --------------------------------------------------------------------

    def _open2(self, inquirer: str, layer: int, context: RoleContext) -> None:
        """Step 6: ``I`` and ``O`` open ``E2``; ``O`` opens ``F2`` and keeps it for step 7."""
        if context.role == inquirer:
            for message in context.inbox:
                for name, value in message.arrays.items():
                    context.state[f"ss.{name}"] = value
            for owner in self._earlier(inquirer):
                e2 = context.state[f"ss.{owner}.w"] - context.state[f"ss.{owner}.a2"]
                context.send(owner, {"e2": e2})
            return
        shares = context.receive(self.plan.compute_role(inquirer, context.role))
        context.state["ss.w"], context.state["ss.lse"] = shares["w"], shares["lse"]
        v = self._context_values(context, layer)[:, context.state["ss.pi"]]
        f2 = encode(v) - context.state["ss.b2"]
        context.state["ss.f2"] = f2
        context.send(inquirer, {"e2": context.state["ss.w"] - context.state["ss.a2"], "f2": f2})

    def _context_values(self, context: RoleContext, layer: int) -> np.ndarray:
        groups = self.runner_for(context.role).geometry.groups
        return np.repeat(context.state[f"ctx.{layer}.v"], groups, axis=0)

    def _context_keys(self, context: RoleContext, layer: int) -> np.ndarray:
        groups = self.runner_for(context.role).geometry.groups
        return np.repeat(context.state[f"ctx.{layer}.k"], groups, axis=0)

    # -- 7. shares of the output ----------------------------------------------------------------

    def _product(self, inquirer: str, context: RoleContext) -> None:
        if context.role == inquirer:
            for owner in self._earlier(inquirer):
                message = context.receive(owner)
                mine = context.state[f"ss.{owner}.w"] - context.state[f"ss.{owner}.a2"]
                e2, f2 = mine + message["e2"], message["f2"]
                a2, c2 = context.state[f"ss.{owner}.a2"], context.state[f"ss.{owner}.c2"]
                context.state[f"ss.{owner}.z"] = truncate(
                    c2 + ring_matmul(a2, f2) + ring_matmul(e2, f2), 0
                )
        else:
            e2_i = context.receive(inquirer)["e2"]
            e2 = e2_i + (context.state["ss.w"] - context.state["ss.a2"])
            f2 = context.state["ss.f2"]
            z = truncate(
                context.state["ss.c2"]
                + ring_matmul(context.state["ss.a2"], f2)
                + ring_matmul(e2, context.state["ss.b2"]),
                1,
            )
            context.send(inquirer, {"z": z, "lse": context.state["ss.lse"]})
            for name in [n for n in context.state if n.startswith("ss.")]:
                del context.state[name]

    # -- 8. the inquirer reconstructs -------------------------------------------------------------

    def _remote_parts(
        self, context: RoleContext, runner: DecoderRunner, layer: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        parts = {}
        for owner in self._earlier(context.role):
            message = context.receive(owner)
            z = decode(context.state.pop(f"ss.{owner}.z") + message["z"])
            lse = decode(context.state.pop(f"ss.{owner}.lse") + message["lse"])
            rho = context.state.pop(f"ss.{owner}.rho")
            out, restored = np.empty_like(z), np.empty_like(lse)
            out[:, rho], restored[:, rho] = z, lse
            parts[owner] = (
                torch.from_numpy(out.astype(np.float32)),
                torch.from_numpy(restored.astype(np.float32)),
            )
        for name in [n for n in context.state if n.startswith("ss.")]:
            del context.state[name]
        return parts

    # -- the declaration ------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        plan, layers = self.plan, self.settings.layers
        steps = [Step("segments", plan.owner_roles, self._segments)]
        finishing: str | None = None
        for inquirer in plan.inquirers[1:]:
            owners = self._earlier(inquirer)
            computes = tuple(dict.fromkeys(plan.compute_role(inquirer, o) for o in owners))
            parties = (inquirer, *owners)
            blocks = self.settings.max_new_tokens if inquirer == COORDINATOR else 1
            for block in range(blocks):
                for layer in range(layers):
                    name = f"{inquirer}_b{block}_l{layer}"
                    action: Callable[[RoleContext], None] = partial(
                        self._inquirer_step, block, layer
                    )
                    roles: tuple[str, ...] = (inquirer,)
                    if finishing is not None:
                        action = _both(finishing, self._owner_done, inquirer, action)
                        roles, finishing = (finishing, inquirer), None
                    steps += [
                        Step(f"{name}_q", roles, action),
                        Step(f"{name}_deal", computes, self._deal),
                        Step(f"{name}_open1", parties, partial(self._open1, inquirer, layer)),
                        Step(
                            f"{name}_scores", parties, partial(self._scores, inquirer, layer, block)
                        ),
                        Step(f"{name}_softmax", computes, self._collect),
                        Step(f"{name}_open2", parties, partial(self._open2, inquirer, layer)),
                        Step(f"{name}_product", parties, partial(self._product, inquirer)),
                    ]
            finishing = inquirer if inquirer != COORDINATOR else None
        steps.append(Step("report", (COORDINATOR,), self._report))
        return steps
