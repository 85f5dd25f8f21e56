"""Where the embedded decoder is cached, what determines it, and reading a decoder folder.

A trained decoder is a plain Hugging Face folder (``config.json``, ``model.safetensors``, the
tokenizer's files) plus fedfm's ``report.json`` (format tag :data:`DECODER_FORMAT`, settings,
held-out perplexity, samples), so any transformers code can load it too. It lives at
``<cache_dir>/decoder-<name>-<key>``, the key hashing the variant, the training settings and the
text's source (folder and Python version); training in progress lives beside it in
``<...>.training`` (tokenizer and resumable state) and the finished folder appears only once
complete (written under ``<...>.saving``, then renamed).
"""

from __future__ import annotations

import json
import platform
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.data.stdlib_text import (
    Document,
    DocumentSplit,
    split_documents,
    stdlib_documents,
    stdlib_root,
)
from fedfm.errors import CheckpointError, ModelError
from fedfm.models.checkpoints import cache_key
from fedfm.models.decoder.config import (
    DECODER_FORMAT,
    DEFAULT_CACHE_DIR,
    DEFAULT_DECODER,
    DecoderTraining,
    DecoderVariant,
    check_variant_name,
)

REPORT_FILE = "report.json"
TEXT_SOURCE = "stdlib-docstrings/1"  # bump when the text extraction changes


@dataclass(frozen=True)
class DecoderSource:
    """An embedded decoder: its variant, how it is trained, on which text, and its cache folder.

    ``text_root`` is the folder whose ``.py`` docstrings are the text (default: this
    interpreter's standard library, :func:`fedfm.data.stdlib_text.stdlib_root`).
    """

    name: str = DEFAULT_DECODER
    cache_dir: Path = DEFAULT_CACHE_DIR
    training: DecoderTraining = field(default_factory=DecoderTraining)
    text_root: Path | None = None

    @property
    def variant(self) -> DecoderVariant:
        return check_variant_name(self.name)

    def text_identity(self) -> dict[str, Any]:
        """The text's source: extraction version, folder, Python version (its sources' version)."""
        root = Path(self.text_root) if self.text_root is not None else stdlib_root()
        return {"source": TEXT_SOURCE, "root": str(root), "python": platform.python_version()}

    def identity(self) -> dict[str, Any]:
        """Everything that determines the trained weights (hashed into the folder name)."""
        return {
            "name": self.name,
            "variant": asdict(self.variant),
            "training": self.training.identity(),
            "text": self.text_identity(),
        }

    @property
    def path(self) -> Path:
        """The finished decoder's folder."""
        return Path(self.cache_dir) / f"decoder-{self.name}-{cache_key(**self.identity())}"

    @property
    def work_path(self) -> Path:
        """Training in progress: the tokenizer and the resumable state."""
        return self.path.with_name(self.path.name + ".training")

    def documents(self) -> DocumentSplit:
        """The training and held-out documents (whole modules held out, seeded)."""
        root = Path(self.text_root) if self.text_root is not None else None
        split = split_documents(
            stdlib_documents(root),
            seed=self.training.seed,
            held_out_fraction=self.training.held_out_fraction,
        )
        cap = self.training.max_documents
        if cap is None:
            return split
        # a seeded subset of each side, in source order (not the first modules alphabetically)
        fraction = self.training.held_out_fraction
        held = max(1, round(cap * fraction / (1 - fraction)))
        rng = np.random.default_rng(self.training.seed)

        def subset(documents: tuple[Document, ...], count: int) -> tuple[Document, ...]:
            if count >= len(documents):
                return documents
            chosen = np.sort(rng.choice(len(documents), size=count, replace=False))
            return tuple(documents[index] for index in chosen)

        return DocumentSplit(train=subset(split.train, cap), held_out=subset(split.held_out, held))

    def train_command(self) -> str:
        """The ``fedfm train-llm`` command that makes this decoder."""
        words = ["fedfm", "train-llm", "--cache-dir", str(self.cache_dir)]
        if self.name != DEFAULT_DECODER:
            words += ["--model", self.name]
        defaults = DecoderTraining()
        for key, value in asdict(self.training).items():
            if value != getattr(defaults, key) and key not in {"eval_every", "checkpoint_every"}:
                words += [f"--{key.replace('_', '-')}", str(value)]
        if self.text_root is not None:
            words += ["--text-root", str(self.text_root)]
        return shlex.join(words)


def read_report(folder: Path) -> dict[str, Any]:
    """The ``report.json`` of a fedfm decoder folder; :class:`CheckpointError` if it is missing,
    unreadable or of another format."""
    path = Path(folder) / REPORT_FILE
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder} holds no fedfm decoder ({REPORT_FILE} is missing)"
        ) from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} is unreadable ({type(error).__name__}: {error})") from None
    found = report.get("format") if isinstance(report, dict) else None
    if found != DECODER_FORMAT:
        raise CheckpointError(f"{path} has format {found!r}, expected {DECODER_FORMAT!r}")
    return report


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No per-shard progress bars while fedfm saves and loads its small folders."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def load_folder(folder: Path, *, attn_implementation: str) -> tuple[Any, Any]:
    """Model and tokenizer from a local Hugging Face folder (nothing downloaded), checked
    against each other (:func:`fedfm.models.decoder.model.check_vocabulary`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedfm.models.decoder.model import check_attention, check_vocabulary

    check_attention(attn_implementation)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, attn_implementation=attn_implementation
            )
    except Exception as error:  # transformers raises many types (OS, value, safetensors errors)
        raise ModelError(
            f"{folder} does not hold a usable causal LM and tokenizer "
            f"({type(error).__name__}: {_first_line(error)})"
        ) from None
    check_vocabulary(model, tokenizer)
    return model.eval(), tokenizer


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
