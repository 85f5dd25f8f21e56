"""Text in the double-blind protocol: a BERT-family encoder instead of a ViT.

What changes from the image path (spec ``001`` §3.2 embeds on the server; a token lookup in a
30,522-row table under CKKS is out of reach, so here the data owner embeds):

* **setup**: the server sends its embedding layer (:func:`embedding_arrays`, from
  :meth:`~fedfm.models.fhe_text.FheTextClassifier.embedding_tables`) and ``input = "text"``; the
  data owner embeds its token ids itself (:func:`embed_tokens`), encrypts the ``(N, T, D)``
  hidden states and uploads them with its **key masks in plaintext** (``True`` at real tokens):
  the server evaluates attention with them (:meth:`~fedfm.crypto.backend.Evaluator.
  evaluate_text_block`), so it learns every text's token count. A data owner that would rather
  not tell sets ``hide-text-lengths`` in its node config: it uploads all-true masks, the model
  then attends to padding as to text (its outputs change; the accuracy cost is the data owner's,
  measured by ``fedfm paper-text --hide-text-lengths``).
* **blocks**: the server permutes each batch's key mask with its rows.
* **the last block** carries each batch's key mask in label order ``pi_{L+1}``: the side adapter
  pools the mean over real tokens. A row's length lets the client link it to its text when no
  other of its texts has that length: the permutation hides a row only among texts of one
  length (red team ``text_rows_linked_by_length``). Hiding lengths does not hide the rows: a
  revealed block's output still carries its input's tokens, which the client embedded itself
  (red team ``text_rows_linked_by_content``; ``docs/text_encoder.md``).

Everything else (batches, permutations, refreshes, the loss, secure aggregation) is the image
path's. Nothing here imports transformers: a data owner's process embeds with numpy and torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedfm.errors import DataError, ProtocolError

if TYPE_CHECKING:  # annotations only: transformers stays out of a data owner's process
    from typing_extensions import TypeIs

    from fedfm.models.fhe_text import FheTextClassifier

TEXT_INPUT = "text"
"""The setup config's ``input`` for a text model (absent: images)."""

EMBEDDING = "embedding"
"""The prefix of the embedding arrays in the setup request."""

EMBEDDING_NAMES = ("word", "position", "segment", "norm_weight", "norm_bias")


def is_text_model(model: object) -> TypeIs[FheTextClassifier]:
    """Whether ``model`` is a text encoder (an :class:`~fedfm.models.fhe_text.
    FheTextClassifier`) rather than a ViT."""
    return callable(getattr(model, "embedding_tables", None))


@dataclass(frozen=True)
class TextClientData:
    """A data owner's private texts as token ids ``(N, T)`` (int64, right-padded) with their key
    masks ``(N, T)`` (``True`` at real tokens, the tokenizer's attention mask) and labels, split
    train/eval. ``T`` is the server model's ``max_tokens``."""

    train_tokens: np.ndarray
    train_key_mask: np.ndarray
    train_labels: np.ndarray
    eval_tokens: np.ndarray
    eval_key_mask: np.ndarray
    eval_labels: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        for name in ("train", "eval"):
            tokens = getattr(self, f"{name}_tokens")
            mask = getattr(self, f"{name}_key_mask")
            labels = getattr(self, f"{name}_labels")
            if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
                raise DataError(
                    f"{name} token ids must be integers (texts, tokens), got {tokens.dtype} "
                    f"{tokens.shape}"
                )
            if mask.shape != tokens.shape or mask.dtype != np.bool_:
                raise DataError(
                    f"{name} key mask must be booleans of the token ids' shape {tokens.shape}, "
                    f"got {mask.dtype} {mask.shape}"
                )
            if len(tokens) and not mask.any(axis=1).all():
                raise DataError(f"{name}: a text without a real token (an all-false key mask row)")
            if len(tokens) != len(labels):
                raise DataError(f"{name}: {len(tokens)} texts but {len(labels)} labels")
            if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise DataError(
                    f"{name} labels span [{labels.min()}, {labels.max()}], outside "
                    f"0..{self.num_classes - 1}"
                )
        if self.train_tokens.shape[1] != self.eval_tokens.shape[1]:
            raise DataError(
                f"training texts have {self.train_tokens.shape[1]} tokens, held-out ones "
                f"{self.eval_tokens.shape[1]}"
            )
        if len(self.train_labels) == 0:
            raise DataError("this client's partition has no training texts")


def embedding_arrays(model: FheTextClassifier) -> tuple[dict[str, np.ndarray], float]:
    """The setup request's embedding arrays (named ``embedding.<name>``) and LayerNorm ``eps``."""
    tables, eps = model.embedding_tables()
    return {f"{EMBEDDING}.{name}": value for name, value in tables.items()}, eps


def embed_tokens(tables: dict[str, np.ndarray], eps: float, token_ids: np.ndarray) -> np.ndarray:
    """``LayerNorm(word[ids] + position[:T] + segment)``: the encoder's embedding, computed by
    the data owner with the tables the server sent (float32 ``(N, T, D)``).

    Raises
    ------
    ProtocolError
        Tables missing or of inconsistent shapes (what the server sent).
    DataError
        Token ids outside the table, or more tokens than the model's positions.
    """
    missing = [name for name in EMBEDDING_NAMES if name not in tables]
    if missing:
        raise ProtocolError(f"the setup lacks embedding tables {missing}")
    word, position = tables["word"], tables["position"]
    width = word.shape[-1] if word.ndim == 2 else -1
    if (
        word.ndim != 2
        or position.ndim != 2
        or position.shape[1] != width
        or any(tables[name].shape != (width,) for name in EMBEDDING_NAMES[2:])
    ):
        raise ProtocolError(
            "the setup's embedding tables have inconsistent shapes: "
            + ", ".join(f"{name} {tables[name].shape}" for name in EMBEDDING_NAMES)
        )
    if not (isinstance(eps, float) and eps > 0):
        raise ProtocolError(f"the setup's embedding eps must be a positive float, got {eps!r}")
    if token_ids.shape[1] > position.shape[0]:
        raise DataError(
            f"texts of {token_ids.shape[1]} tokens exceed the server model's "
            f"{position.shape[0]} positions; tokenize with max_length={position.shape[0]}"
        )
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= word.shape[0]):
        raise DataError(
            f"token ids span [{token_ids.min()}, {token_ids.max()}], outside the server "
            f"model's table of {word.shape[0]}: tokenize with the model's own tokenizer"
        )
    summed = word[token_ids] + position[None, : token_ids.shape[1]] + tables["segment"]
    normed = torch.nn.functional.layer_norm(
        torch.from_numpy(np.ascontiguousarray(summed, dtype=np.float32)),
        (width,),
        torch.from_numpy(tables["norm_weight"].astype(np.float32)),
        torch.from_numpy(tables["norm_bias"].astype(np.float32)),
        eps,
    )
    return normed.numpy()


def check_uploaded_masks(mask: object, count: int, tokens: int, what: str) -> np.ndarray:
    """A data owner's uploaded key masks: ``count`` boolean rows of ``tokens``, none empty."""
    if (
        not isinstance(mask, np.ndarray)
        or mask.dtype != np.bool_
        or mask.shape != (count, tokens)
        or (count and not mask.any(axis=1).all())
    ):
        shape = getattr(mask, "shape", None)
        raise ProtocolError(
            f"{what} key mask must be booleans of shape {(count, tokens)} with a real token "
            f"per text, got {getattr(mask, 'dtype', type(mask).__name__)} {shape}"
        )
    return mask


def check_label_order_masks(masks: list[np.ndarray], sizes: list[int], tokens: int) -> None:
    """The last block's key masks: one boolean ``(rows, tokens)`` mask per batch, no empty row."""
    if len(masks) != len(sizes):
        raise ProtocolError(
            f"the last block carries {len(masks)} key masks for {len(sizes)} batches"
        )
    for index, (mask, rows) in enumerate(zip(masks, sizes, strict=True)):
        check_uploaded_masks(mask, rows, tokens, f"batch {index}'s")
