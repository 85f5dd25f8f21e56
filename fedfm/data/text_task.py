"""The text classification task of the double-blind text model: docstrings by module family.

Texts and labels come from :func:`fedfm.data.stdlib_text.build_splits` (seven families of the
standard library; a seeded draw per family). The splits, like :class:`fedfm.data.DataSplits`:

* ``aux``: ``D_aux``, the model owner's labelled in-distribution texts (teacher head,
  distillation);
* ``pool``: the data owners' texts, which later federated code partitions
  (:meth:`TokenizedTexts.subset`);
* ``test``: held-out texts of the same families (the HELIX "queries" draw);
* ``public``: unlabelled texts of other standard-library modules (argparse, logging, ...), the
  out-of-distribution ``D_aux`` variant (labels ``-1``).

Tokenization pads on the right to a fixed :data:`MAX_TOKENS` with the tokenizer's pad id.
64 tokens: a docstring states its topic in its first sentence or two (median 32 tokens under
MiniLM's WordPiece, 71 % of the drawn texts fit whole), and the encrypted evaluation's cost
grows with the token count (one ciphertext slot group of ``2T - 2`` slots per text and feature,
``T - 1`` rotations per attention), so 128 would double it for the remaining third's tails.
Longer texts are cut explicitly (``truncate=True``) or refused (:class:`DataError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fedfm.data.stdlib_text import TASK_FAMILIES, build_splits, stdlib_docstrings
from fedfm.errors import ConfigError, DataError

MAX_TOKENS = 64
UNLABELLED = -1
TEXT_DATASET = "docstrings"
"""The name of this task where a dataset is named (the double-blind apps' run config)."""
# The split of ``fedfm paper-text``'s table and of the double-blind apps' text task: 20 labelled
# D_aux texts per family for the teacher's head (as fedfm distill-text), 100 pool texts per family
# for the data owners (700: K = 20 clients hold 35 each on average, two batches of 16), 60 test
# texts per family (420: one text is 0.24 points). The smallest family has 325 docstrings.
TEXT_SPLIT: dict[str, int] = {"aux_per_class": 20, "pool_per_class": 100, "test_per_class": 60}


@dataclass(frozen=True, eq=False)
class TokenizedTexts:
    """Texts, their token ids ``(N, T)`` int64 (right-padded) and int64 labels ``(N,)``."""

    texts: list[str]
    input_ids: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    name: str = "texts"

    @property
    def groups(self) -> None:
        """No natural ids (:func:`fedfm.data.partition.partition` offers iid and dirichlet)."""
        return None

    def __post_init__(self) -> None:
        count = len(self.texts)
        if self.input_ids.ndim != 2 or len(self.input_ids) != count:
            raise DataError(
                f"token ids must have shape ({count}, T), got {tuple(self.input_ids.shape)}"
            )
        if self.labels.shape != (count,):
            raise DataError(f"labels must have shape ({count},), got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, indices: Sequence[int] | np.ndarray) -> TokenizedTexts:
        """The texts at ``indices`` (in that order), e.g. one data owner's partition."""
        index = np.asarray(indices, dtype=np.int64)
        selector = torch.from_numpy(index)
        return replace(
            self,
            texts=[self.texts[i] for i in index.tolist()],
            input_ids=self.input_ids[selector],
            labels=self.labels[selector],
        )

    def loader(self, batch_size: int, *, shuffle: bool = False, seed: int = 0) -> Any:
        """A ``torch.utils.data.DataLoader`` of ``(input_ids, labels)`` batches."""
        from torch.utils.data import DataLoader, TensorDataset

        generator = torch.Generator().manual_seed(seed) if shuffle else None
        return DataLoader(
            TensorDataset(self.input_ids, self.labels),
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
        )


@dataclass(frozen=True)
class TextSplits:
    """The task's class names and its four tokenized splits (module docstring)."""

    classes: tuple[str, ...]
    max_tokens: int
    aux: TokenizedTexts
    pool: TokenizedTexts
    test: TokenizedTexts
    public: TokenizedTexts


def tokenize(
    texts: Sequence[str], tokenizer: Any, *, max_tokens: int = MAX_TOKENS, truncate: bool = True
) -> torch.Tensor:
    """Token ids ``(len(texts), max_tokens)``, right-padded with the tokenizer's pad id.

    Raises :class:`DataError` if a text is longer than ``max_tokens`` and ``truncate`` is off.
    """
    if max_tokens < 2:
        raise ConfigError(f"max_tokens must be >= 2 (the special tokens), got {max_tokens}")
    if not texts:
        raise DataError("no texts to tokenize")
    if tokenizer.padding_side != "right":
        raise DataError("the text model expects right padding (tokenizer.padding_side='right')")
    if not truncate:
        lengths = [len(ids) for ids in tokenizer(list(texts))["input_ids"]]
        longest = max(lengths)
        if longest > max_tokens:
            raise DataError(
                f"{sum(n > max_tokens for n in lengths)} text(s) are longer than the configured "
                f"{max_tokens} tokens (up to {longest}); raise max_tokens or truncate"
            )
    encoded = tokenizer(
        list(texts),
        padding="max_length",
        truncation=True,
        max_length=max_tokens,
        return_tensors="pt",
    )
    ids: torch.Tensor = encoded["input_ids"].long()
    return ids


def load_text_task(
    tokenizer: Any,
    *,
    max_tokens: int = MAX_TOKENS,
    seed: int = 0,
    aux_per_class: int = 100,
    pool_per_class: int = 100,
    test_per_class: int = 100,
    public_size: int = 700,
) -> TextSplits:
    """The tokenized splits of the module docstring (a seeded draw; texts cut at ``max_tokens``).

    Raises :class:`DataError` if a family has fewer docstrings than requested.
    """
    for name, count in (("aux", aux_per_class), ("pool", pool_per_class), ("test", test_per_class)):
        if count < 1:
            raise ConfigError(f"{name}_per_class must be >= 1, got {count}")
    data = build_splits(
        seed=seed,
        public_size=public_size,
        train_per_class=aux_per_class + pool_per_class,
        queries_per_class=test_per_class,
        ood_size=1,
    )
    classes = data.classes
    labels = data.train.labels
    aux_index, pool_index = [], []
    for label in range(len(classes)):
        members = np.flatnonzero(labels == label)  # already a seeded shuffle within the family
        aux_index += members[:aux_per_class].tolist()
        pool_index += members[aux_per_class:].tolist()

    def tokenized(texts: list[str], targets: np.ndarray) -> TokenizedTexts:
        return TokenizedTexts(
            texts,
            tokenize(texts, tokenizer, max_tokens=max_tokens),
            torch.from_numpy(np.asarray(targets, dtype=np.int64)),
            len(classes),
        )

    train = tokenized(data.train.texts, labels)
    return TextSplits(
        classes=classes,
        max_tokens=max_tokens,
        aux=train.subset(aux_index),
        pool=train.subset(pool_index),
        test=tokenized(data.queries.texts, data.queries.labels),
        public=tokenized(data.public, np.full(len(data.public), UNLABELLED)),
    )


def unlabelled_texts(
    tokenizer: Any,
    *,
    exclude: TextSplits,
    count: int,
    max_tokens: int = MAX_TOKENS,
    seed: int = 0,
) -> TokenizedTexts:
    """Up to ``count`` standard-library docstrings of every module (task families, OOD and
    public alike) that are not in ``exclude``'s ``test`` or ``pool`` split, as an unlabelled
    ``D_aux`` (labels ``-1``): distillation needs no labels, only texts. A seeded draw; the
    data owners' pool and the held-out test texts never enter it.

    Raises :class:`ConfigError` for ``count < 1``.
    """
    if count < 1:
        raise ConfigError(f"count must be >= 1, got {count}")
    held_out = set(exclude.test.texts) | set(exclude.pool.texts)
    texts = [item.text for item in stdlib_docstrings() if item.text not in held_out]
    order = np.random.default_rng(seed).permutation(len(texts))[:count]
    chosen = [texts[i] for i in sorted(order.tolist())]
    return TokenizedTexts(
        chosen,
        tokenize(chosen, tokenizer, max_tokens=max_tokens),
        torch.full((len(chosen),), UNLABELLED, dtype=torch.int64),
        len(exclude.classes),
    )


def adaptation_task(tokenizer: Any, *, max_tokens: int = MAX_TOKENS, seed: int = 0) -> TextSplits:
    """The task of ``fedfm paper-text`` and the double-blind apps: :data:`TEXT_SPLIT` (and D_aux's
    size of public texts), the split its kept students were distilled beside."""
    return load_text_task(
        tokenizer,
        max_tokens=max_tokens,
        seed=seed,
        **TEXT_SPLIT,
        public_size=len(TASK_FAMILIES) * TEXT_SPLIT["aux_per_class"],
    )
