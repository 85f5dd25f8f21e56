"""The embedded decoder's variants and training settings: one table, no heavy imports.

The ``fedfm train-llm`` command reads its option defaults from :class:`DecoderTraining` and the
variant names from :data:`EMBEDDED_DECODERS`, so this module imports neither torch nor
transformers.

Sizing (the default, ``llama_fedfm_tiny``), for a few minutes of training on two CPU cores:

* **vocabulary 2048** byte-level BPE tokens. The training text is about 1.5 MB, so every merge
  of a larger vocabulary is seen fewer times: at 4096 the embedding table alone would be a third
  of the model's parameters and its rarest rows would hardly be trained; at 1024 a token covers
  fewer bytes, so a context of 128 tokens holds less text. 2048 keeps the table at a fifth of the
  parameters with tied input and output embeddings.
* **hidden 128, 4 layers, 4 heads of 32, SwiGLU width 384** (3x, rounded to a multiple of 64 as
  Llama rounds 8/3x), RMSNorm, RoPE: the Llama block as transformers builds it.
* **context 128 tokens**: longer than most docstrings' first paragraph, short enough that the
  per-token cost of attention stays small beside the MLPs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedfm.errors import ConfigError

DECODER_FORMAT = "fedfm-decoder/1"
STATE_FORMAT = "fedfm-decoder-state/1"
DEFAULT_DECODER = "llama_fedfm_tiny"
DEFAULT_CACHE_DIR = Path("runs/cache")  # shared with the ViT teacher's cache
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
BYTE_ALPHABET = 256  # a byte-level BPE starts from every byte


@dataclass(frozen=True)
class DecoderVariant:
    """The architecture of an embedded decoder (a ``LlamaConfig``) and its tokenizer's size."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    context: int
    num_kv_heads: int | None = None  # None: as many as query heads (no grouped-query attention)
    rope_theta: float = 10000.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        smallest = BYTE_ALPHABET + len(SPECIAL_TOKENS)
        if self.vocab_size < smallest:
            raise ConfigError(
                f"vocab_size must be at least {smallest} (every byte plus the special tokens), "
                f"got {self.vocab_size}"
            )
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "context"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        kv_heads = self.num_kv_heads or self.num_heads
        if self.num_heads % kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {kv_heads}"
            )

    def llama_config(self) -> dict[str, Any]:
        """Keyword arguments of ``transformers.LlamaConfig`` (token ids follow
        :data:`SPECIAL_TOKENS`: 0, 1, 2)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads or self.num_heads,
            "max_position_embeddings": self.context,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_dropout": 0.0,
            "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
            "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
            "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        }


# Variants as data (timm style).
EMBEDDED_DECODERS: dict[str, DecoderVariant] = {
    DEFAULT_DECODER: DecoderVariant(
        vocab_size=2048,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        intermediate_size=384,
        context=128,
    ),
    # Two layers of width 32 and a 320-token vocabulary: tests and smoke runs, seconds to train.
    "llama_fedfm_micro": DecoderVariant(
        vocab_size=320,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        context=32,
    ),
}


@dataclass(frozen=True)
class DecoderTraining:
    """How the embedded decoder is trained: data, optimiser and schedule (one table).

    AdamW with linear warm-up then cosine decay to ``lr * min_lr_ratio``; gradients clipped at
    ``clip_norm``. Training blocks are ``context`` tokens of the packed training documents
    (``<s> text </s>`` one after another), visited in a seeded order per epoch. ``seed`` seeds the
    weights' initialisation, that order and the held-out split: all public, none is a secret.
    ``eval_every`` and ``checkpoint_every`` change what is printed and saved, not the weights.
    """

    steps: int = 600
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    held_out_fraction: float = 0.1
    max_documents: int | None = None  # cap the training documents (quick runs and tests)
    eval_every: int = 100
    checkpoint_every: int = 25

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got {self}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(
                f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}"
            )
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ConfigError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if self.max_documents is not None and self.max_documents < 1:
            raise ConfigError(f"max_documents must be >= 1, got {self.max_documents}")

    def identity(self) -> dict[str, Any]:
        """The settings that determine the trained weights (the cache key's part)."""
        settings = asdict(self)
        del settings["eval_every"], settings["checkpoint_every"]
        return settings


# What each training setting means (the ``fedfm train-llm`` options' help).
TRAINING_HELP = {
    "steps": "optimiser steps",
    "batch_size": "blocks of `context` tokens per step",
    "lr": "peak AdamW learning rate",
    "min_lr_ratio": "final learning rate as a fraction of the peak (cosine decay)",
    "warmup_steps": "steps of linear warm-up",
    "weight_decay": "AdamW weight decay of the weight matrices",
    "clip_norm": "gradient norm clipping",
    "seed": "initialisation, batch order and held-out split (public)",
    "held_out_fraction": "share of each group's text held out, as whole modules",
    "max_documents": "cap the training documents (quick runs)",
    "eval_every": "steps between held-out evaluations (not part of the cache key)",
    "checkpoint_every": "steps between saved states (not part of the cache key)",
}


def check_variant_name(name: str) -> DecoderVariant:
    """The embedded variant called ``name``; :class:`ConfigError` naming the choices."""
    if name not in EMBEDDED_DECODERS:
        raise ConfigError(
            f"unknown embedded decoder {name!r}: use one of {sorted(EMBEDDED_DECODERS)}, or pass "
            "a Hugging Face causal LM name or local folder to load_decoder"
        )
    return EMBEDDED_DECODERS[name]
