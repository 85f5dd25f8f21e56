"""FedRAG's data: standard-library docstrings split by package family across owners, a
completion task built from them, the owners' indexes and the coordinator's relevance head.

* **Documents** are the decoder's *held-out* modules (text the embedded decoder never trained
  on, :func:`fedfm.data.stdlib_text.split_documents`), by group (:func:`documents_by_group`):
  the families are dealt to the owners round-robin, so each institution holds other topics.
* **The task** (Table 3-style, "answer contains substring", App. D): a query is the beginning
  of a document's first sentence (at least 5 words, the last 3 cut off) and the answer is the
  next word (alphabetic, 4+ letters, not already in the query). The system must retrieve the
  document and the decoder continue the sentence from it; correct if the generated text
  contains the answer.
* **The relevance head** of the re-ranker: logistic regression on the MiniLM cross-encoder's
  features (:func:`fedfm.protocols.fedrag.reranking.features`) of (query, its document)
  positives and (query, another document of its group) negatives, built from the decoder's
  *training* modules (disjoint from the evaluation documents).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedfm.data.stdlib_text import Document, documents_by_group, split_documents
from fedfm.errors import DataError

MIN_WORDS, CUT = 8, 3


@dataclass(frozen=True)
class Question:
    query: str
    answer: str
    owner: int  # which owner holds the source document
    document: int  # its index among that owner's documents


@dataclass(frozen=True)
class FedragData:
    owners: tuple[tuple[Document, ...], ...]
    questions: tuple[Question, ...]


def question_of(text: str) -> tuple[str, str] | None:
    """``(query, answer)`` from a document's first sentence, or ``None`` if it has none."""
    first = re.split(r"(?<=[.!?])\s|\n\n", text.strip(), maxsplit=1)[0]
    words = first.split()
    if len(words) < MIN_WORDS:
        return None
    prefix, answer = words[: len(words) - CUT], words[len(words) - CUT].strip(".,:;()'\"`")
    if (
        len(answer) < 4
        or not answer.isalpha()
        or answer.lower() in {w.lower().strip(".,:;()") for w in prefix}
    ):
        return None
    return " ".join(prefix), answer


def build_data(
    *,
    owners: int = 2,
    per_owner: int = 120,
    questions: int = 24,
    seed: int = 0,
    documents: Sequence[Document] | None = None,
) -> FedragData:
    """Owners' documents by family and the questions (module docstring); seeded, public.

    ``documents``: the documents to deal by group (default: the embedded decoder's held-out
    standard-library modules; parsing the whole standard library takes seconds, so tests pass
    a few packages' docstrings)."""
    if owners < 2:
        raise DataError(f"FedRAG needs at least 2 owners, got {owners}")
    if documents is None:
        documents = split_documents(seed=0).held_out
    groups = documents_by_group(list(documents))
    if len(groups) < owners:
        raise DataError(
            f"{owners} owners need documents of at least {owners} groups, got {sorted(groups)}"
        )
    names = sorted(groups)
    rng = np.random.default_rng(seed)
    shares: list[list[Document]] = [[] for _ in range(owners)]
    for number, group in enumerate(names):
        shares[number % owners] += groups[group]
    held: list[tuple[Document, ...]] = []
    for share in shares:
        order = rng.permutation(len(share))[:per_owner]
        held.append(tuple(share[i] for i in sorted(order)))
    found: list[Question] = []
    for owner, documents in enumerate(held):
        for index, document in enumerate(documents):
            qa = question_of(document.text)
            if qa is not None:
                found.append(Question(qa[0], qa[1], owner, index))
    if len(found) < questions:
        raise DataError(f"only {len(found)} questions in the documents, {questions} asked")
    pick = rng.permutation(len(found))[:questions]
    return FedragData(tuple(held), tuple(found[i] for i in sorted(pick)))


def embed(texts: list[str]) -> np.ndarray:
    """MiniLM sentence embeddings (the coordinator's embedding model; owners index with it)."""
    from fedfm.models.text_encoders import build_encoder

    return build_encoder("minilm").encode(texts)


def train_relevance_head(
    *, pairs: int = 120, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """``(weight, bias, report)`` of the relevance head (module docstring); ``report`` holds
    its held-out pair accuracy."""
    from sklearn.linear_model import LogisticRegression

    from fedfm.protocols.fedrag.reranking import encoder_runner

    encoder = encoder_runner()
    train = split_documents(seed=0).train
    by_group = documents_by_group(train)
    rng = np.random.default_rng(seed)
    usable = [(d, question_of(d.text)) for d in train]
    usable = [(d, qa) for d, qa in usable if qa is not None]
    order = rng.permutation(len(usable))[:pairs]
    rows, labels = [], []
    for index in order:
        document, (query, _) = usable[index]
        siblings = [d for d in by_group[document.group] if d.text != document.text]
        negative = siblings[int(rng.integers(len(siblings)))]
        q = encoder.query_ids(query)
        for candidate, label in ((document, 1), (negative, 0)):
            rows.append(encoder.joint_features(q, encoder.document_ids(candidate.text)))
            labels.append(label)
    x, y = np.asarray(rows), np.asarray(labels)
    cut = int(0.75 * len(x)) // 2 * 2
    head = LogisticRegression(C=1.0, max_iter=2000).fit(x[:cut], y[:cut])
    accuracy = float(head.score(x[cut:], y[cut:])) if cut < len(x) else float("nan")
    final = LogisticRegression(C=1.0, max_iter=2000).fit(x, y)
    return (
        final.coef_[0].copy(),
        final.intercept_.copy(),
        {"held_out_pair_accuracy": accuracy, "pairs": float(len(x))},
    )
