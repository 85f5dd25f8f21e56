"""The red team's text-path attacks (fedfm.experiments.text_attacks): lengths reach the server
and link permuted rows for the client, unless the data owner hides them; the rows' content links
them whether or not it does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfm.experiments.red_team import PROTOCOL_SUITES, protocol_suite
from fedfm.experiments.text_attacks import (
    BATCH,
    length_leak,
    link_rows_by_content,
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


def test_the_client_links_rows_by_content_even_with_lengths_hidden(leaks) -> None:
    """Hiding lengths leaves the rows' content: the first revealed block's output correlates
    with the client's own embeddings (block 1 with reveal all, the last block with reveal last),
    and only with the right texts."""
    data, _, hidden = leaks
    assert hidden.content_block == 1 and hidden.rows_linked_by_content > 0.9
    model = small_text_model()
    last = length_leak(model, data, hide=True, reveal="last")
    assert last.content_block == model.num_blocks and last.rows_linked_by_content > 0.9
    # the same rows against texts the client does not hold (same lengths, other tokens)
    tokens = torch.from_numpy(data.train_tokens)
    with torch.no_grad():
        hidden_states = model.block(0, model.embed(tokens), torch.ones_like(tokens, dtype=bool))
    order = np.random.default_rng(0).permutation(len(data.train_tokens))[:BATCH]
    right = link_rows_by_content(model, data.train_tokens, hidden_states.numpy()[order])
    assert (right == order).mean() > 0.9
    strangers = texts_of_lengths(data.train_key_mask.sum(axis=1), seed=2).train_tokens
    wrong = link_rows_by_content(model, strangers, hidden_states.numpy()[order])
    assert (wrong == order).mean() <= 2 / BATCH


def test_the_text_suite_is_registered() -> None:
    assert PROTOCOL_SUITES["double_blind_text"].endswith("text_attacks:red_team_suite")
    assert callable(protocol_suite("double_blind_text"))
