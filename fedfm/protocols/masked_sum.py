"""The runtime's worked example: a sum of two parties' vectors by a third that sees neither.

Roles: ``alice`` and ``bob`` each hold a private int64 vector ``x`` (same length); ``carol`` adds.
Arithmetic is modulo 2**64 (int64 viewed as uint64), so the result is exact.

1. ``mask`` (alice, bob): both derive the same one-time pad ``m`` (a ChaCha20 keystream from
   their key agreement, :meth:`~fedfm.runtime.RoleContext.shared_mask`) and the same permutation
   ``p`` (:meth:`~fedfm.runtime.RoleContext.shared_generator`). Alice sends ``p(x_a + m)`` to
   carol, bob sends ``p(x_b - m)``.
2. ``sum`` (carol): adds them; the pads cancel. She sends ``p(x_a + x_b)`` to alice.
3. ``reveal`` (alice): undoes ``p`` and publishes ``x_a + x_b``.

Carol sees two uniformly random vectors and the sum in an order she does not know; the relay
sees ciphertext and the published sum. Carol must not run on alice's or bob's node (she would
hold the pad), which the declaration's ``separated`` enforces.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.runtime.protocol import Protocol, RoleContext, Step
from fedfm.runtime.transport import ConfigValue

ALICE, BOB, CAROL = "alice", "bob", "carol"
PAD, ORDER = "pad", "order"  # purposes of the shared randomness


def _partner(role: str) -> str:
    return BOB if role == ALICE else ALICE


def _mask(context: RoleContext) -> None:
    x = context.input("x")
    if x.ndim != 1 or x.dtype.kind not in "iu":
        raise ConfigError(f"{context.role}'s input 'x' must be an integer vector, not {x.dtype}")
    words = np.ascontiguousarray(x, dtype=np.int64).view(np.uint64)
    peer = _partner(context.role)
    pad = context.shared_mask(peer, PAD, words.size)
    order = context.shared_generator(peer, ORDER).permutation(words.size)
    masked = words + pad if context.role == ALICE else words - pad
    context.send(CAROL, {"masked": masked[order]})


def _sum(context: RoleContext) -> None:
    first, second = context.receive(ALICE)["masked"], context.receive(BOB)["masked"]
    if first.shape != second.shape or first.dtype != np.uint64 or second.dtype != np.uint64:
        raise ProtocolError(
            f"alice and bob sent {first.dtype}{first.shape} and {second.dtype}{second.shape}; "
            "their vectors must have the same length"
        )
    context.send(ALICE, {"permuted_sum": first + second})


def _reveal(context: RoleContext) -> None:
    permuted = context.receive(CAROL)["permuted_sum"]
    order = context.shared_generator(BOB, ORDER).permutation(permuted.size)
    total = np.empty_like(permuted)
    total[order] = permuted
    context.publish("sum", total.view(np.int64))


def masked_sum(config: Mapping[str, ConfigValue] | None = None) -> Protocol:
    """The declaration; ``config`` holds the run config keys meant for the protocol (none)."""
    if config:
        raise ConfigError(
            f"masked-sum takes no parameters; unknown run config keys {sorted(config)}"
        )
    return Protocol(
        name="masked-sum",
        roles=(ALICE, BOB, CAROL),
        channels=((ALICE, BOB), (ALICE, CAROL), (BOB, CAROL)),
        separated=((ALICE, CAROL), (BOB, CAROL)),
        steps=(
            Step("mask", (ALICE, BOB), _mask),
            Step("sum", (CAROL,), _sum),
            Step("reveal", (ALICE,), _reveal),
        ),
    )
