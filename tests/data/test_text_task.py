"""The tokenized docstring task (fedfm.data.text_task) with the packaged MiniLM's tokenizer."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from fedfm.data.text_task import TokenizedTexts, load_text_task, tokenize
from fedfm.errors import ConfigError, DataError


@functools.cache
def minilm_tokenizer():
    from transformers import AutoTokenizer

    from fedfm.models.text_encoders import packaged_minilm_path

    return AutoTokenizer.from_pretrained(str(packaged_minilm_path()), local_files_only=True)


TEXTS = ["Return a new path.", "Join the worker threads and close the pool " * 8]


def test_tokenize_pads_on_the_right_and_cuts_at_the_configured_length() -> None:
    tokenizer = minilm_tokenizer()
    ids = tokenize(TEXTS, tokenizer, max_tokens=16)
    assert ids.shape == (2, 16) and ids.dtype == torch.long
    short = len(tokenizer(TEXTS[0])["input_ids"])
    assert (ids[0, short:] == tokenizer.pad_token_id).all()
    assert (ids[0, :short] != tokenizer.pad_token_id).all()
    assert (ids[1] != tokenizer.pad_token_id).all()  # the long text fills every position


def test_longer_sequences_are_refused_without_truncation() -> None:
    with pytest.raises(DataError, match=r"1 text\(s\) are longer than the configured 16 tokens"):
        tokenize(TEXTS, minilm_tokenizer(), max_tokens=16, truncate=False)
    assert tokenize(TEXTS[:1], minilm_tokenizer(), max_tokens=16, truncate=False).shape == (1, 16)


def test_subset_and_loader_keep_texts_ids_and_labels_together() -> None:
    ids = tokenize(TEXTS * 2, minilm_tokenizer(), max_tokens=8)
    data = TokenizedTexts(TEXTS * 2, ids, torch.tensor([0, 1, 0, 1]), 2)
    part = data.subset(np.array([3, 0]))
    assert part.texts == [TEXTS[1], TEXTS[0]] and part.labels.tolist() == [1, 0]
    assert torch.equal(part.input_ids, ids[[3, 0]])
    batches = list(data.loader(3))
    assert [len(labels) for _, labels in batches] == [3, 1]
    with pytest.raises(DataError, match="labels must have shape"):
        TokenizedTexts(TEXTS, ids[:2], torch.zeros(3, dtype=torch.long), 2)


@pytest.mark.slow
def test_text_task_splits_are_disjoint_balanced_and_tokenized() -> None:
    splits = load_text_task(minilm_tokenizer(), aux_per_class=5, pool_per_class=4,
                            test_per_class=3)  # fmt: skip
    assert len(splits.classes) == 7
    assert [len(splits.aux), len(splits.pool), len(splits.test)] == [35, 28, 21]
    assert np.bincount(splits.aux.labels.numpy()).tolist() == [5] * 7
    assert (splits.public.labels == -1).all()
    texts = [set(split.texts) for split in (splits.aux, splits.pool, splits.test, splits.public)]
    assert sum(len(t) for t in texts) == len(set().union(*texts))
    assert splits.aux.input_ids.shape[1] == 64


@pytest.mark.slow
def test_unlabelled_texts_leave_out_the_test_texts_and_the_pool() -> None:
    from fedfm.data.text_task import unlabelled_texts

    splits = load_text_task(minilm_tokenizer(), aux_per_class=5, pool_per_class=4,
                            test_per_class=3)  # fmt: skip
    texts = unlabelled_texts(minilm_tokenizer(), exclude=splits, count=3000, max_tokens=32)
    assert len(texts) == 3000 and len(set(texts.texts)) == 3000
    assert not set(texts.texts) & (set(splits.test.texts) | set(splits.pool.texts))
    assert (texts.labels == -1).all() and texts.input_ids.shape == (3000, 32)
    again = unlabelled_texts(minilm_tokenizer(), exclude=splits, count=3000, max_tokens=32)
    assert again.texts == texts.texts  # a seeded draw
    with pytest.raises(ConfigError, match="count must be >= 1"):
        unlabelled_texts(minilm_tokenizer(), exclude=splits, count=0)
