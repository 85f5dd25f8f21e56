"""The red team's text-path attacks (fedfm.experiments.text_attacks): lengths reach the server
and link permuted rows for the client, unless the data owner hides them."""

from __future__ import annotations

import numpy as np
import pytest

from fedfm.experiments.red_team import PROTOCOL_SUITES, protocol_suite
from fedfm.experiments.text_attacks import (
    length_leak,
    small_text_model,
    texts_of_lengths,
)

# 90 texts: 50 of distinct lengths 10..59, 40 of length 64 (cut at the limit)
LENGTHS = np.concatenate([np.arange(10, 60), np.full(40, 64)])


@pytest.fixture(scope="module")
def leaks():
    model = small_text_model()
    data = texts_of_lengths(np.random.default_rng(0).permutation(LENGTHS), seed=1)
    return data, length_leak(model, data, hide=False), length_leak(model, data, hide=True)


def test_lengths_reach_the_server_unless_the_data_owner_hides_them(leaks) -> None:
    data, shown, hidden = leaks
    assert shown.server_reads == 1.0  # every text's token count, from the uploaded masks
    cut = float(np.mean(data.train_key_mask.sum(axis=1) == 64))
    assert hidden.server_reads == pytest.approx(cut)  # all-real masks: right only at 64


def test_the_client_links_rows_by_length_unless_lengths_are_hidden(leaks) -> None:
    data, shown, hidden = leaks
    lengths = data.train_key_mask.sum(axis=1)
    unique = np.isin(lengths, np.flatnonzero(np.bincount(lengths) == 1))
    # about the share of rows drawn from texts of a length no other text has, all named right
    assert shown.rows == 64 and shown.rows_linked > 0.5 * unique.mean()
    assert shown.rows_linked <= unique.mean() + 0.25
    assert hidden.rows_linked <= 1 / 64  # every row reads 64 tokens: nothing to link by


def test_the_text_suite_is_registered() -> None:
    assert PROTOCOL_SUITES["double_blind_text"].endswith("text_attacks:red_team_suite")
    assert callable(protocol_suite("double_blind_text"))
