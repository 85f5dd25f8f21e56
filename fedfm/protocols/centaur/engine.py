"""A small two-server MPC engine on the runtime: programs of instructions, a dealer, shares.

CrypTen's shape, without its globals: the maths of each operation (:mod:`fedfm.protocols.sharing`)
apart from the transport; one Beaver routine for every bilinear product; correlated randomness
behind one dealer (the client, P2).

A **program** is a list of :class:`Instruction` s that both compute parties (``developer`` = P0,
``cloud`` = P1) run in lock step. An instruction has ``rounds`` exchanges; its phase ``k`` runs in
the ``k``-th relay round trip after it starts, reads what the other party sent in phase ``k - 1``
and returns what to send in phase ``k``. Local instructions (``rounds = 0``) run inside the step
of the instruction before. :func:`schedule` turns a program into steps: one relay round trip
each, both compute roles acting in every one.

**Correlated randomness** (seed §4.1 "Privacy-Preserving Inference" and App. A, Algorithm 6: the
client P2 deals). Each instruction lists what it needs (:class:`Deal`). The client draws every
uniform value as two halves: the developer's from the stream it shares with the developer
(``context.shared_mask``, keyed by their key agreement), the cloud's from the stream it shares
with the cloud; a derived value (a triple's ``c = a ∘ b``, the input's one-hot matrix, a
permutation matrix) is shared as the developer's stream half plus an explicit remainder sent to
the cloud. So the developer receives nothing from the dealer but a length, and the cloud one
message per forward pass (the "trusted first party" compression of CrypTen's dealer).

Every message between the compute parties carries the request, the pass and the fixed-point
fraction; a receiver refuses a message whose tags are not its own (:class:`ProtocolError`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedfm.errors import InvariantError, ProtocolError
from fedfm.protocols.sharing import (
    beaver_close,
    beaver_open,
    decode,
    encode,
    ring_matmul,
    ring_multiply,
    truncate,
    uniform,
)
from fedfm.runtime.protocol import RoleContext

DEVELOPER, CLOUD, CLIENT = "developer", "cloud", "client"
COMPUTE = (DEVELOPER, CLOUD)
INDEX = {DEVELOPER: 0, CLOUD: 1}
TAG_KEYS = ("_request", "_pass", "_fraction")

Observer = Callable[[str, str, np.ndarray], None]  # (role, name, plaintext it reconstructed)
Profile = Callable[[str, float, int], None]  # (instruction, seconds, bytes it sent)


def _no_observer(_role: str, _name: str, _value: np.ndarray) -> None:
    return None


@dataclass(frozen=True)
class Deal:
    """One value the client deals, by name and shape.

    ``kind``: ``"uniform"`` (both halves from the two streams: nothing sent), ``"product"``
    (``of = (a, b, op)``: ``op(a, b)`` of two uniform deals; the cloud's half is sent),
    ``"secret"`` (a value the client computes from its secrets, ``source``; the cloud's half
    is sent).
    """

    name: str
    shape: tuple[int, ...]
    kind: str = "uniform"
    of: tuple[str, str, str] | None = None
    source: str = ""


class Party:
    """A compute party (developer or cloud) during one step: its shares, weights, streams."""

    def __init__(
        self,
        context: RoleContext,
        *,
        weights: Callable[[str], np.ndarray],
        encoded: Callable[[str, int], np.ndarray],
        fraction: int,
        purpose: str,
        observer: Observer,
        tags: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.context = context
        self.tags = dict(tags or {})  # attached to what this party sends the client
        self.role = context.role
        self.index = INDEX[context.role]
        self.fraction = fraction
        self.purpose = purpose
        self.observer = observer
        self._weights = weights
        self._encoded = encoded

    @property
    def peer(self) -> str:
        return CLOUD if self.role == DEVELOPER else DEVELOPER

    def get(self, name: str) -> np.ndarray:
        key = f"v.{name}"
        if key not in self.context.state:
            raise InvariantError(f"{self.role} has no value {name!r} in step {self.context.step}")
        return self.context.state[key]

    def put(self, name: str, value: np.ndarray) -> None:
        self.context.state[f"v.{name}"] = np.asarray(value)

    def drop(self, *names: str) -> None:
        for name in names:
            self.context.state.pop(f"v.{name}", None)

    def weight(self, name: str) -> np.ndarray:
        """A plaintext weight of Θ' (float64), as both compute parties hold it."""
        return self._weights(name)

    def encoded(self, name: str, fraction: int | None = None) -> np.ndarray:
        """A weight of Θ' in fixed point (cached per run)."""
        return self._encoded(name, self.fraction if fraction is None else fraction)

    def dealt(self, deal: Deal) -> np.ndarray:
        """This party's half of a dealt value."""
        if self.index == 0 or deal.kind == "uniform":
            count = int(np.prod(deal.shape))
            purpose = f"{self.purpose}/{deal.name}"
            return self.context.shared_mask(CLIENT, purpose, count).reshape(deal.shape)
        key = f"d.{deal.name}"
        if key not in self.context.state:
            raise ProtocolError(f"the cloud never received the dealt value {deal.name!r}")
        return self.context.state[key]

    def truncate(self, value: np.ndarray, bits: int | None = None) -> np.ndarray:
        return truncate(value, self.index, self.fraction if bits is None else bits)

    def constant(self, value: np.ndarray | float, fraction: int) -> np.ndarray:
        """A public constant as this party's share (party 0 holds it, party 1 zero)."""
        encoded = encode(value, fraction)
        return encoded if self.index == 0 else np.zeros_like(encoded)

    def send_to(self, role: str, arrays: Mapping[str, np.ndarray]) -> None:
        self.context.send(role, arrays)


class Instruction:
    """One operation of a program; see the module docstring."""

    name: str
    rounds: int

    def deals(self) -> list[Deal]:
        return []

    def run(
        self, party: Party, phase: int, inbox: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        raise NotImplementedError


@dataclass
class Local(Instruction):
    """Local arithmetic on one's own shares: ``action(party)``."""

    name: str
    action: Callable[[Party], None]
    rounds: int = 0

    def run(
        self, party: Party, phase: int, inbox: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        self.action(party)
        return {}


Operand = Callable[[Party], np.ndarray]


def value(name: str) -> Operand:
    return lambda party: party.get(name)


@dataclass
class Product(Instruction):
    """``out = x ∘ y`` of two shared operands with a Beaver triple (one round).

    ``op`` is ``"matmul"`` (batched) or ``"mul"`` (elementwise); ``truncate_bits`` shifts the
    result back (0: keep the product's scale).
    """

    name: str
    out: str
    x: Operand
    y: Operand
    x_shape: tuple[int, ...]
    y_shape: tuple[int, ...]
    op: str = "matmul"
    truncate_bits: int = 0
    rounds: int = 1

    def _product(self) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        return ring_matmul if self.op == "matmul" else ring_multiply

    def deals(self) -> list[Deal]:
        a, b = Deal(f"{self.name}.a", self.x_shape), Deal(f"{self.name}.b", self.y_shape)
        if self.op == "matmul":
            shape = (*self.x_shape[:-1], self.y_shape[-1])
        else:
            shape = tuple(np.broadcast_shapes(self.x_shape, self.y_shape))
        c = Deal(f"{self.name}.c", shape, "product", (a.name, b.name, self.op))
        return [a, b, c]

    def run(
        self, party: Party, phase: int, inbox: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        a_deal, b_deal, c_deal = self.deals()
        a, b = party.dealt(a_deal), party.dealt(b_deal)
        if phase == 0:
            x, y = self.x(party), self.y(party)
            if x.shape != self.x_shape or y.shape != self.y_shape:
                raise InvariantError(
                    f"{self.name}: operands {x.shape} x {y.shape}, dealt for "
                    f"{self.x_shape} x {self.y_shape}"
                )
            e, f = beaver_open(x, y, a, b)
            party.put(f"{self.name}.e", e)
            party.put(f"{self.name}.f", f)
            return {"e": e, "f": f}
        e = party.get(f"{self.name}.e") + _expect(inbox, "e", self.name)
        f = party.get(f"{self.name}.f") + _expect(inbox, "f", self.name)
        party.drop(f"{self.name}.e", f"{self.name}.f")
        z = beaver_close(party.index, e, f, a, b, party.dealt(c_deal), self._product())
        if self.truncate_bits:
            z = party.truncate(z, self.truncate_bits)
        party.put(self.out, z)
        return {}


@dataclass
class CloudApply(Instruction):
    """Seed App. A, Algorithms 1-3 (and the tanh of Algorithm 5): the developer sends its share
    of a permuted input to the cloud, the cloud reconstructs it, applies ``function`` on
    permuted plaintext and re-shares the output (a fresh OS-CSPRNG mask as the developer's
    share). Two rounds; the developer stores its share in a third phase."""

    name: str
    out: str
    x: str
    function: Callable[[Party, np.ndarray], np.ndarray]
    in_fraction: int
    out_fraction: int
    rounds: int = 2

    def run(
        self, party: Party, phase: int, inbox: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if phase == 0:
            return {"share": party.get(self.x)} if party.index == 0 else {}
        if phase == 1 and party.index == 1:
            plain = decode(party.get(self.x) + _expect(inbox, "share", self.name), self.in_fraction)
            party.observer(party.role, self.name, plain)
            result = encode(self.function(party, plain), self.out_fraction)
            mask = uniform(result.shape)
            party.put(self.out, result - mask)
            return {"share": mask}
        if phase == 2 and party.index == 0:
            party.put(self.out, _expect(inbox, "share", self.name))
        return {}


@dataclass
class Parallel(Instruction):
    """Independent instructions sharing their rounds (messages kept apart by name)."""

    name: str
    parts: Sequence[Instruction]
    rounds: int = field(init=False)

    def __post_init__(self) -> None:
        self.rounds = max(part.rounds for part in self.parts)

    def deals(self) -> list[Deal]:
        return [deal for part in self.parts for deal in part.deals()]

    def run(
        self, party: Party, phase: int, inbox: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        sent: dict[str, np.ndarray] = {}
        for part in self.parts:
            if phase <= part.rounds:
                prefix = f"{part.name}/"
                mine = {k[len(prefix) :]: v for k, v in inbox.items() if k.startswith(prefix)}
                sent |= {f"{prefix}{k}": v for k, v in part.run(party, phase, mine).items()}
        return sent


@dataclass
class OpenToClient(Instruction):
    """Both compute parties send their share of ``x`` to the client (the output)."""

    name: str
    x: str
    rounds: int = 0

    def run(
        self, party: Party, phase: int, inbox: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        party.send_to(CLIENT, {"output": party.get(self.x)} | party.tags)
        return {}


def _expect(inbox: Mapping[str, np.ndarray], key: str, name: str) -> np.ndarray:
    if key not in inbox:
        raise ProtocolError(f"instruction {name!r} expected {key!r} from the other party")
    return inbox[key]


# -- programs and their schedule --------------------------------------------------------------


@dataclass
class Program:
    """Instructions in order, and the public facts the client's deals need."""

    instructions: list[Instruction] = field(default_factory=list)
    secrets: list[Deal] = field(default_factory=list)  # the input, permutation matrices
    _schedule: list[list[tuple[int, int]]] | None = None

    def add(self, instruction: Instruction) -> None:
        self.instructions.append(instruction)
        self._schedule = None

    def deals(self) -> list[Deal]:
        found = [deal for instruction in self.instructions for deal in instruction.deals()]
        return [*self.secrets, *found]

    def check_names(self) -> None:
        names = [instruction.name for instruction in self.instructions]
        if len(set(names)) != len(names):
            raise InvariantError("a program repeats an instruction name")

    def schedule(self) -> list[list[tuple[int, int]]]:
        """Steps of ``(instruction index, phase)`` (module docstring)."""
        if self._schedule is not None:
            return self._schedule
        steps: list[list[tuple[int, int]]] = [[]]
        cursor = 0
        for index, instruction in enumerate(self.instructions):
            for phase in range(instruction.rounds + 1):
                while len(steps) <= cursor + phase:
                    steps.append([])
                steps[cursor + phase].append((index, phase))
            cursor += instruction.rounds
        self._schedule = steps
        return steps

    def rounds(self) -> int:
        return len(self.schedule())


def tags(request: str, forward_pass: int, fraction: int) -> dict[str, np.ndarray]:
    return {
        "_request": np.frombuffer(request.encode(), np.uint8),
        "_pass": np.asarray([forward_pass], np.int64),
        "_fraction": np.asarray([fraction], np.int64),
    }


def check_tags(
    arrays: Mapping[str, np.ndarray], sender: str, request: str, forward_pass: int, fraction: int
) -> None:
    """:class:`ProtocolError` if a message is from another request or pass, or encodes with
    another number of fractional bits."""
    if any(key not in arrays for key in TAG_KEYS):
        raise ProtocolError(f"a message from {sender} carries no request/pass/fraction tags")
    theirs = bytes(np.asarray(arrays["_request"], np.uint8)).decode(errors="replace")
    if theirs != request or int(arrays["_pass"][0]) != forward_pass:
        raise ProtocolError(
            f"a share from {sender} belongs to request {theirs!r} pass {int(arrays['_pass'][0])}, "
            f"not to this one ({request!r} pass {forward_pass}): refused"
        )
    if int(arrays["_fraction"][0]) != fraction:
        raise ProtocolError(
            f"{sender} encodes fixed point with {int(arrays['_fraction'][0])} fractional bits, "
            f"this party with {fraction}: mismatched fixed-point settings"
        )


def run_compute_step(
    program: Program,
    step: int,
    party: Party,
    *,
    request: str,
    forward_pass: int,
    profile: Profile | None = None,
) -> None:
    """One relay round trip of a compute party: read the peer's message, run the scheduled
    phases, send the peer what they produced (with tags); ``profile`` gets each phase's time
    and bytes."""
    context = party.context
    inbox: dict[str, np.ndarray] = {}
    for message in context.inbox:
        if message.sender == party.peer:
            check_tags(message.arrays, message.sender, request, forward_pass, party.fraction)
            inbox |= {k: v for k, v in message.arrays.items() if k not in TAG_KEYS}
    outgoing: dict[str, np.ndarray] = {}
    for index, phase in program.schedule()[step]:
        instruction = program.instructions[index]
        prefix = f"{instruction.name}:"
        mine = {k[len(prefix) :]: v for k, v in inbox.items() if k.startswith(prefix)}
        started = time.perf_counter()
        sent = instruction.run(party, phase, mine)
        if profile is not None:
            size = sum(np.asarray(v).nbytes for v in sent.values())
            profile(instruction.name, time.perf_counter() - started, size)
        outgoing |= {f"{prefix}{k}": v for k, v in sent.items()}
    if outgoing:
        context.send(party.peer, outgoing | tags(request, forward_pass, party.fraction))


# -- the dealer ---------------------------------------------------------------------------------


OPS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "matmul": ring_matmul,
    "mul": ring_multiply,
}


def deal(
    context: RoleContext,
    deals: Sequence[Deal],
    *,
    purpose: str,
    secrets: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """The client's dealing for one forward pass: the cloud's explicit halves, by name.

    ``secrets`` holds the values of ``"secret"`` deals (the one-hot input, permutation matrices).
    """
    full: dict[str, np.ndarray] = {}
    explicit: dict[str, np.ndarray] = {}
    for item in deals:
        count = int(np.prod(item.shape))
        first = context.shared_mask(DEVELOPER, f"{purpose}/{item.name}", count).reshape(item.shape)
        if item.kind == "uniform":
            second = context.shared_mask(CLOUD, f"{purpose}/{item.name}", count).reshape(item.shape)
            full[item.name] = first + second
            continue
        if item.kind == "product":
            if item.of is None:
                raise InvariantError(f"product deal {item.name} names no factors")
            a, b, op = item.of
            whole = OPS[op](full[a], full[b])
        elif item.kind == "secret":
            whole = np.asarray(secrets[item.source], dtype=np.uint64)
        else:
            raise InvariantError(f"unknown deal kind {item.kind!r}")
        explicit[item.name] = whole - first
    return explicit


def permutation_matrix(permutation: np.ndarray) -> np.ndarray:
    """The integer matrix ``P`` with ``X P = X[:, permutation]`` (ring elements 0 and 1)."""
    size = len(permutation)
    matrix = np.zeros((size, size), dtype=np.uint64)
    matrix[permutation, np.arange(size)] = 1
    return matrix


def one_hot(ids: np.ndarray, vocab: int) -> np.ndarray:
    matrix = np.zeros((len(ids), vocab), dtype=np.uint64)
    matrix[np.arange(len(ids)), ids] = 1
    return matrix


def plain(value: Any) -> np.ndarray:
    """A float64 array (helper for functions applied on the cloud's plaintext)."""
    return np.asarray(value, dtype=np.float64)
