"""Where a traced polynomial's refreshes go: level bookkeeping without ciphertexts.

:func:`fedfm.crypto.circuit.evaluate_traced` executes a traced DAG node by node. A product whose
operand has no headroom forces a refresh (a round trip to the data owner). Refreshing only that
operand wastes the round trip: a value computed earlier and used later (the ``0.5 u`` of Newton's
inverse square root, the ``a`` of Goldschmidt's inverse, the linear term of a polynomial) runs out
of levels a few products later and forces another. When a round trip is needed anyway,
:func:`choose_refresh` adds the live values that, refreshed with the forced ones, save later round
trips, and no more: it tries every set of extra live values (smallest first) and keeps the first
whose remaining round trips, played out by :func:`simulate`, equal those of refreshing every live
value. The inputs here are the node's headrooms alone, so the choice is a deterministic function
of the public circuit (it never depends on data).

:class:`LevelCircuit` runs :func:`~fedfm.crypto.circuit.evaluate_traced` on integers standing for
ciphertexts (their headroom; :func:`fedfm.crypto.circuit.dry_run`): a dry run that counts round
trips and refreshed ciphertexts of a schedule without TenSEAL and refuses a product of an
operand without headroom, as :class:`~fedfm.crypto.circuit.Circuit` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Protocol

from fedfm.crypto.backend import Work
from fedfm.errors import InvariantError

# Operations that use a level of their operands (a rescale); the others keep it.
LEVEL_OPERATIONS = frozenset({"mul", "mul_c"})
# Extra live values tried as sets; beyond this many, all of them are refreshed (2**10 dry runs).
MAX_CANDIDATES = 10


class Node(Protocol):
    """What the scheduler reads of a traced operation (:class:`~fedfm.crypto.circuit.Traced`)."""

    op: str
    args: tuple[Any, ...]


def result_headroom(op: str, operands: Sequence[int]) -> int:
    """Headroom of an operation's result from its operands' (which must allow the operation)."""
    lowest = min(operands)
    return lowest - 1 if op in LEVEL_OPERATIONS else lowest


def last_uses(order: Sequence[Node], needs: dict[int, int]) -> dict[int, int]:
    """For each node (by ``id``), the index in ``order`` of the last operation reading it; the
    values the caller needs (the output, inputs it uses afterwards) are read after the last
    operation (``len(order)``)."""
    last: dict[int, int] = {}
    for index, node in enumerate(order):
        for arg in node.args:
            last[id(arg)] = index
    for key in needs:
        last[key] = len(order)
    return last


def short(headroom: dict[int, int], needs: dict[int, int]) -> list[int]:
    """The needed values (by ``id``) with less headroom than the caller needs."""
    return [key for key, need in needs.items() if headroom[key] < need]


def _forced(node: Node, headroom: dict[int, int]) -> list[int]:
    """Operands (by ``id``) that must be refreshed before ``node`` runs."""
    if node.op not in LEVEL_OPERATIONS:
        return []
    return list(dict.fromkeys(id(arg) for arg in node.args if headroom[id(arg)] < 1))


def _live(headroom: dict[int, int], last: dict[int, int], index: int, full: int) -> list[int]:
    """Values computed so far that an operation at ``index`` or later reads, below ``full``."""
    return [key for key, room in headroom.items() if last.get(key, -1) >= index and room < full]


def simulate(
    order: Sequence[Node],
    start: int,
    headroom: dict[int, int],
    last: dict[int, int],
    full: int,
    needs: dict[int, int],
    sizes: dict[int, int] | None = None,
) -> tuple[int, int]:
    """Round trips and refreshed ciphertexts of ``order[start:]`` (and of the final refresh of
    what the caller ``needs``: id -> headroom) when every refresh takes every live value below
    ``full`` headroom along.

    ``headroom`` holds the values computed before ``start`` (it is not modified); ``sizes``
    the ciphertexts of each value (default 1; a computed value has its operands' count).
    """
    counts = dict(sizes or {})
    rooms = dict(headroom)
    trips = refreshed = 0
    for index in range(start, len(order)):
        node = order[index]
        if _forced(node, rooms):
            chosen = set(_live(rooms, last, index, full)) | set(_forced(node, rooms))
            for key in chosen:
                rooms[key] = full
            trips += 1
            refreshed += sum(_size(counts, key) for key in chosen)
        rooms[id(node)] = result_headroom(node.op, [rooms[id(arg)] for arg in node.args])
        if node.args:
            counts[id(node)] = _size(counts, id(node.args[0]))
    missing = short(rooms, needs)
    return trips + bool(missing), refreshed + sum(_size(counts, key) for key in missing)


def _size(sizes: dict[int, int], key: int) -> int:
    return sizes.get(key, 1)


def choose_refresh(
    order: Sequence[Node],
    index: int,
    headroom: dict[int, int],
    last: dict[int, int],
    full: int,
    needs: dict[int, int],
    sizes: dict[int, int] | None = None,
) -> list[int]:
    """The values (by ``id``) to refresh before ``order[index]``, whose operands need it.

    The forced operands, plus the set of other live values below ``full`` headroom with the
    fewest ciphertexts (``sizes``, default 1 each) that leaves as few later round trips as
    refreshing them all (ties: fewest refreshed ciphertexts later, then the earliest computed).
    ``needs`` maps the values the caller uses afterwards (the output, possibly inputs) to the
    headroom its next operation needs of them.
    """
    forced = _forced(order[index], headroom)
    if not forced:
        return []
    candidates = [key for key in _live(headroom, last, index, full) if key not in forced]
    counts = sizes or {}

    def outcome(extra: Sequence[int]) -> tuple[int, int]:
        rooms = dict(headroom)
        for key in (*forced, *extra):
            rooms[key] = full
        return simulate(order, index, rooms, last, full, needs, counts)

    if len(candidates) > MAX_CANDIDATES:
        return forced + candidates
    fewest = outcome(candidates)[0]
    best: tuple[int, int, tuple[int, ...]] | None = None
    for size in range(len(candidates) + 1):
        for extra in combinations(candidates, size):
            trips, later = outcome(extra)
            if trips != fewest:
                continue
            cost = (sum(_size(counts, key) for key in extra), later, extra)
            if best is None or cost[:2] < best[:2]:
                best = cost
    if best is None:
        raise InvariantError("internal: refreshing every live value did not reach its own count")
    return forced + list(best[2])


# -- a dry run on headrooms ------------------------------------------------------------------------
@dataclass
class LevelStats:
    """What a :class:`LevelCircuit` counted."""

    refreshes: int = 0
    refreshed_ciphertexts: int = 0
    places: list[str] = field(default_factory=list)


class LevelCircuit:
    """The arithmetic :func:`~fedfm.crypto.circuit.evaluate_traced` uses, on integers that stand
    for ciphertexts: each is its own headroom. Refreshes yield like the real circuit's (the
    driver may answer them with anything: they come back at ``full`` headroom)."""

    def __init__(self, full: int) -> None:
        if full < 1:
            raise InvariantError(f"a refresh must leave headroom, got {full}")
        self.full_headroom = full
        self.stats = LevelStats()

    def headroom(self, ct: int) -> int:
        return ct

    def refresh(self, cts: list[int], place: str) -> Work[list[int]]:
        yield list(cts)
        self.stats.refreshes += 1
        self.stats.refreshed_ciphertexts += len(cts)
        self.stats.places.append(f"{place}:{len(cts)}")
        return [self.full_headroom] * len(cts)

    def _product(self, *cts: int) -> int:
        if min(cts) < 1:
            raise InvariantError("a ciphertext without headroom reached a product")
        return min(cts) - 1

    def multiply(self, a: int, b: int) -> int:
        return self._product(a, b)

    def scale_by(self, ct: int, value: float) -> int:
        return self._product(ct)

    def add(self, a: int, b: int) -> int:
        return min(a, b)

    def sub(self, a: int, b: int) -> int:
        return min(a, b)

    def add_scalar(self, ct: int, value: float) -> int:
        return ct

    def negate(self, ct: int) -> int:
        return ct
