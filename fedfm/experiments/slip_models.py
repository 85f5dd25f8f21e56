"""The models SLIP's harness measures, on shipped text (spec 003 §5; issue 21 item 4).

``minilm``
    The packaged pretrained MiniLM (all-MiniLM-L6-v2, a BERT encoder: a real singular-value
    spectrum) with mean pooling, L2 normalisation and a linear head: a logistic regression
    (HELIX's :func:`~fedfm.experiments.helix_evaluation.train_head`) fitted on the embeddings of
    the docstring task's training split (seven module families of the standard library,
    :func:`fedfm.data.stdlib_text.build_splits`). Utility: top-1 accuracy on the task's queries.
``llama_fedfm_tiny`` (or any causal LM by name or folder)
    The shared decoder (:func:`fedfm.models.decoder.load_decoder`, trained once by ``fedfm
    train-llm``). Utility: perplexity on its held-out docstrings (whole modules it never saw).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.data.stdlib_text import build_splits
from fedfm.errors import ConfigError

MINILM = "minilm"
MINILM_TOKENS = 32  # docstrings state their topic early (HELIX uses 64; half the ring work)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No load reports or progress bars from transformers."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()


class MinilmClassifier(torch.nn.Module):
    """MiniLM, mean pooling, L2 normalisation, a linear head (``self.head``)."""

    def __init__(self, encoder: Any, weight: np.ndarray, bias: np.ndarray) -> None:
        super().__init__()
        self.encoder = encoder
        self.config = encoder.config  # Charlie sets its attention implementation here
        self.head = torch.nn.Linear(weight.shape[0], weight.shape[1])
        with torch.no_grad():
            self.head.weight.copy_(torch.from_numpy(weight.T.copy()).float())
            self.head.bias.copy_(torch.from_numpy(bias).float())

    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        hidden = hidden.last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return pooled / pooled.norm(dim=1, keepdim=True).clamp(min=1e-12)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=self.head(self.pooled(input_ids, attention_mask)))


@dataclass
class Task:
    """A model, its evaluation inputs and how its utility is measured."""

    name: str
    model: Any
    inputs: dict[str, torch.Tensor]  # the evaluation batch (classification) or blocks
    labels: np.ndarray | None  # classification labels; None for language modelling
    train: dict[str, torch.Tensor] | None = None  # public text an adversary may fine-tune on

    @property
    def classification(self) -> bool:
        return self.labels is not None

    def batches(self, size: int) -> list[dict[str, torch.Tensor]]:
        """The evaluation inputs in batches of ``size`` rows."""
        count = next(iter(self.inputs.values())).shape[0]
        return [
            {key: value[start : start + size] for key, value in self.inputs.items()}
            for start in range(0, count, size)
        ]


def tokenize(tokenizer: Any, texts: list[str], tokens: int = MINILM_TOKENS) -> dict[str, Any]:
    batch = tokenizer(texts, padding=True, truncation=True, max_length=tokens, return_tensors="pt")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def minilm_task(*, train_per_class: int = 60, queries_per_class: int = 10, seed: int = 0) -> Task:
    """The packaged MiniLM with a head fitted on the docstring task (module docstring)."""
    from transformers import AutoModel, AutoTokenizer

    from fedfm.experiments.helix_evaluation import train_head
    from fedfm.models.text_encoders import packaged_minilm_path

    path = packaged_minilm_path()
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        encoder = AutoModel.from_pretrained(
            str(path), local_files_only=True, add_pooling_layer=False
        ).eval()
    data = build_splits(
        seed=seed,
        public_size=16,
        train_per_class=train_per_class,
        queries_per_class=queries_per_class,
        ood_size=16,
    )
    classes = len(data.classes)
    model = MinilmClassifier(encoder, np.zeros((384, classes)), np.zeros(classes)).eval()
    train = tokenize(tokenizer, data.train.texts)
    with torch.no_grad():
        embeddings = torch.cat(
            [
                model.pooled(train["input_ids"][s : s + 64], train["attention_mask"][s : s + 64])
                for s in range(0, len(data.train.texts), 64)
            ]
        )
    head = train_head(embeddings.double().numpy(), data.train.labels, seed=seed)
    model = MinilmClassifier(encoder, head.weight, head.bias).eval()
    return Task(MINILM, model, tokenize(tokenizer, data.queries.texts), data.queries.labels, train)


def decoder_task(
    name: str | Any = "llama_fedfm_tiny",
    *,
    cache_dir: Path = Path("runs/cache"),
    blocks: int = 8,
    train_blocks: int = 0,
) -> Task:
    """The decoder ``name`` (embedded: from ``cache_dir``; refuses, naming ``fedfm
    train-llm``, when it is not trained; or a ``DecoderSource``) on ``blocks`` held-out blocks
    of its context, and ``train_blocks`` blocks of its training split (public text)."""
    from fedfm.models.decoder import (
        DecoderSource,
        document_ids,
        load_decoder,
        token_blocks,
    )
    from fedfm.models.decoder.config import EMBEDDED_DECODERS

    if isinstance(name, DecoderSource):
        source = name
        model, tokenizer = load_decoder(source, attn_implementation="eager", progress=False)
        split = source.documents()
        held, public = split.held_out, split.train
        name = source.name
    elif name not in EMBEDDED_DECODERS:
        model, tokenizer = load_decoder(name, attn_implementation="eager", progress=False)
        from fedfm.data.stdlib_text import split_documents

        split = split_documents(seed=0)
        held, public = split.held_out, split.train
    else:
        source = DecoderSource(name=name, cache_dir=cache_dir)
        model, tokenizer = load_decoder(source, attn_implementation="eager", progress=False)
        split = source.documents()
        held, public = split.held_out, split.train
    context = int(model.config.max_position_embeddings)
    evaluation = token_blocks(document_ids(tokenizer, [d.text for d in held]), context)
    if len(evaluation) < blocks:
        raise ConfigError(f"{name}: {len(evaluation)} held-out blocks, {blocks} asked")
    train = None
    if train_blocks:
        pool = token_blocks(document_ids(tokenizer, [d.text for d in public]), context)
        order = np.random.default_rng(1).permutation(len(pool))[:train_blocks]
        train = {"input_ids": pool[np.sort(order)]}
    return Task(name, model.eval(), {"input_ids": evaluation[:blocks]}, None, train)


def load_task(name: str, *, cache_dir: Path = Path("runs/cache"), **options: Any) -> Task:
    """``minilm`` or a decoder name/folder (module docstring)."""
    if name == MINILM:
        return minilm_task(**options)
    return decoder_task(name, cache_dir=cache_dir, **options)


@torch.no_grad()
def risk(task: Task, model: Any, inputs: dict[str, torch.Tensor] | None = None) -> float:
    """Mean cross-entropy (nats) of ``model`` on the task's evaluation inputs: the risk of
    Definition 3 (next-token loss for a decoder, label loss for the classifier)."""
    inputs = inputs or task.inputs
    logits = model(**inputs).logits.float()
    if task.labels is not None:
        labels = torch.from_numpy(task.labels)
        return float(torch.nn.functional.cross_entropy(logits, labels))
    ids = inputs["input_ids"]
    return float(
        torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )
    )


def utility(task: Task, logits: torch.Tensor) -> float:
    """Top-1 accuracy (classifier) or perplexity (decoder) of ``logits`` on the task."""
    if task.labels is not None:
        return float((logits.argmax(-1).numpy() == task.labels).mean())
    ids = task.inputs["input_ids"]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    return float(torch.exp(loss))
