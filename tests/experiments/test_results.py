"""The result writers every benchmark shares."""

from __future__ import annotations

from fedfm.experiments.results import markdown_table


def test_a_pipe_in_a_cell_or_header_stays_inside_its_cell() -> None:
    table = markdown_table(
        [{"attack": "W/O | W | Rand", "value": 0.5, "missing": None}],
        [("attack", "attack"), ("value", "max |logit diff|"), ("missing", "control")],
    )
    header, rule, row = table.splitlines()
    # every line has the same number of unescaped separators: one per column, plus one
    for line in (header, rule, row):
        assert line.replace("\\|", "").count("|") == 4
    assert row == "| W/O \\| W \\| Rand | 0.5 | - |"
    assert header == "| attack | max \\|logit diff\\| | control |"
