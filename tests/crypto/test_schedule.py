"""Refresh scheduling of traced polynomials, on headrooms alone (no TenSEAL).

:class:`~fedfm.crypto.schedule.LevelCircuit` runs :func:`~fedfm.crypto.circuit.evaluate_traced`
on integers standing for ciphertexts and refuses a product of an operand without headroom, so a
dry run checks the schedule's safety and counts its round trips. The specs are the distilled
student's defaults (``ApproxConfig``); the deployment parameter set leaves 5 rescales between
refreshes.
"""

from __future__ import annotations

from typing import Any

import pytest

from fedfm.approx.evaluate import evaluate_inv_sqrt, evaluate_inverse, polyval
from fedfm.approx.specs import ApproxConfig
from fedfm.crypto.backend import drive
from fedfm.crypto.circuit import Traced, dry_run, evaluate_traced, symbol
from fedfm.crypto.schedule import LevelCircuit, choose_refresh, last_uses
from fedfm.errors import InvariantError

FULL = 5  # CKKS_16384: rescales between refreshes
CONFIG = ApproxConfig()


def _traces() -> dict[str, tuple[Traced, Traced]]:
    """name -> (input symbol, traced output) of each polynomial a block refreshes inside."""
    out = {}
    for name, evaluate, spec in (
        ("inv_sqrt", evaluate_inv_sqrt, CONFIG.inv_sqrt),
        ("inverse", evaluate_inverse, CONFIG.inverse),
        ("exp", polyval, CONFIG.exp),
        ("gelu", polyval, CONFIG.gelu),
    ):
        x = symbol()
        out[name] = (x, evaluate(spec, x))
    return out


def _depth(node: Traced, memo: dict[int, int] | None = None) -> int:
    """Multiplicative depth of a traced node (its inputs at depth 0)."""
    memo = {} if memo is None else memo
    if id(node) not in memo:
        below = max((_depth(arg, memo) for arg in node.args), default=0)
        memo[id(node)] = below + (node.op in ("mul", "mul_c"))
    return memo[id(node)]


def _operations(output: Traced, x: Traced) -> list[Traced]:
    """The traced operations below ``output`` in evaluation order (input ``x`` left out)."""
    order: list[Traced] = []
    seen = {id(x)}

    def visit(node: Traced) -> None:
        for arg in node.args:
            if id(arg) not in seen:
                seen.add(id(arg))
                visit(arg)
        order.append(node)

    visit(output)
    return order


def _greedy_round_trips(output: Traced, x: Traced, headroom: int, need: int) -> int:
    """Round trips of the operand-only schedule (reimplemented here on headrooms)."""
    order = _operations(output, x)
    rooms = {id(x): headroom}
    trips = 0
    for node in order:
        operands = [rooms[id(arg)] for arg in node.args]
        if node.op in ("mul", "mul_c") and min(operands) < 1:
            trips += 1
            for arg in node.args:
                if rooms[id(arg)] < 1:
                    rooms[id(arg)] = FULL
            operands = [rooms[id(arg)] for arg in node.args]
        lowest = min(operands)
        rooms[id(node)] = lowest - 1 if node.op in ("mul", "mul_c") else lowest
    return trips + (rooms[id(output)] < need)


@pytest.mark.parametrize("name", ["inv_sqrt", "inverse", "exp", "gelu"])
@pytest.mark.parametrize("headroom", range(FULL + 1))
def test_schedule_is_safe_and_near_the_depth_bound(name: str, headroom: int) -> None:
    """Every product gets operands with headroom (the level circuit refuses others), the output
    has the headroom the caller asked for, and the round trips are within one of the bound that
    no schedule beats: the levels missing, ``depth + need - headroom``, in refreshes of ``FULL``."""
    x, output = _traces()[name]
    stats = dry_run(output, {x: headroom}, FULL, output_headroom=1, copies=3)
    missing = _depth(output) + 1 - headroom
    bound = max(0, -(-missing // FULL))
    assert bound <= stats.refreshes <= bound + 1
    # whole tensors travel: every refresh carries a multiple of the tensor's 3 ciphertexts
    assert stats.refreshed_ciphertexts == 3 * sum(
        int(p.rsplit(":", 1)[1]) // 3 for p in stats.places
    )
    assert all(int(p.rsplit(":", 1)[1]) % 3 == 0 for p in stats.places)


def test_inverse_square_root_round_trips_against_the_greedy_schedule() -> None:
    """The LayerNorms of the deployment block: the variance arrives with 3 levels left (norm1)
    or 2 (norm2, its input came through the attention's projection). Refreshing only the
    operand that ran out took 4 and 7 round trips, plus one for ``inv_std`` before the product
    with the centred values in norm1. The look-ahead takes 3 for norm1 leaving ``inv_std`` the
    centred values' 4 levels, and 2 for norm2 leaving it one level."""
    x, output = _traces()["inv_sqrt"]
    assert (_greedy_round_trips(output, x, 3, 4), _greedy_round_trips(output, x, 2, 1)) == (5, 7)
    assert dry_run(output, {x: 3}, FULL, output_headroom=4).refreshes == 3
    assert dry_run(output, {x: 2}, FULL, output_headroom=1).refreshes == 2


def test_softmax_inverse_and_gelu_need_fewer_round_trips() -> None:
    """The softmax's inverse (its input, the masked sum of the exp's outputs, arrives without
    headroom) took 4 round trips greedily and takes 3; the GELU (input with one level left)
    took 2 counting fc2's refresh of its output, and takes 1."""
    x, inverse = _traces()["inverse"]
    assert _greedy_round_trips(inverse, x, 0, 1) == 4
    assert dry_run(inverse, {x: 0}, FULL, output_headroom=1).refreshes == 3
    h, gelu = _traces()["gelu"]
    assert _greedy_round_trips(gelu, h, 1, 1) == 2
    assert dry_run(gelu, {h: 1}, FULL, output_headroom=1).refreshes == 1


def test_extra_refreshes_only_when_they_save_a_round_trip() -> None:
    """With levels to spare nothing is refreshed; when a refresh is forced, a live value is
    taken along only if that saves a later round trip."""
    x, gelu = _traces()["gelu"]
    assert dry_run(gelu, {x: FULL}, FULL, output_headroom=1).refreshes == 0
    # x * x runs out at headroom 1; x (the linear term, still live) is taken along so that the
    # output keeps a level for fc2; without that need, x is left alone.
    assert dry_run(gelu, {x: 1}, FULL, output_headroom=1).places == ["dry run:2"]
    assert dry_run(gelu, {x: 1}, FULL, output_headroom=0).places == ["dry run:1"]


def test_choose_refresh_keeps_forced_operands_and_live_values_only() -> None:
    """The chosen set holds the operand that ran out and only values read later."""
    x, output = _traces()["inv_sqrt"]
    order = _operations(output, x)
    needs = {id(output): 1}
    last = last_uses(order, needs)
    rooms: dict[int, int] = {id(x): 0}
    first_product = next(i for i, node in enumerate(order) if node.op in ("mul", "mul_c"))
    chosen = choose_refresh(order, first_product, rooms, last, FULL, needs)
    assert id(x) in chosen
    assert all(last.get(key, -1) >= first_product for key in chosen)


def test_level_circuit_refuses_a_product_without_headroom() -> None:
    """The dry run's circuit fails where the real one would (so a passing dry run means the
    schedule never reaches a product without a level)."""
    circuit = LevelCircuit(FULL)
    with pytest.raises(InvariantError, match="without headroom"):
        circuit.multiply(0, 3)
    x = symbol()
    work: Any = evaluate_traced(circuit, x * x, {x: [1, 1]}, "t")  # type: ignore[arg-type]
    assert drive(work, lambda items: items) == [0, 0]
    assert circuit.stats.refreshes == 0
