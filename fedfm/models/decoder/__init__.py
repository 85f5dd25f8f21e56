"""The decoder-only LLM that FedRAG, SLIP and CENTAUR share (one copy, here).

The embedded default is a small Llama (transformers' ``LlamaForCausalLM``: RMSNorm, SwiGLU,
rotary embeddings) with a byte-level BPE, trained here in minutes on standard-library docstrings
by ``fedfm train-llm`` and cached under ``runs/cache``; any Hugging Face causal LM loads the
same way by name or folder. Protocols call::

    from fedfm.models.decoder import load_decoder
    model, tokenizer = load_decoder(cache_dir=..., attn_implementation="eager")

Modules: :mod:`~fedfm.models.decoder.config` (variants and training settings: one table, no
torch), :mod:`~fedfm.models.decoder.tokenizer`, :mod:`~fedfm.models.decoder.model` (build,
attention registration, checks, generation, perplexity), :mod:`~fedfm.models.decoder.artefact`
(cache folder), :mod:`~fedfm.models.decoder.training`, :mod:`~fedfm.models.decoder.loading`.
Public names load on first use, so reading the config does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfm.models.decoder.artefact import DecoderSource, read_report
    from fedfm.models.decoder.config import (
        DEFAULT_DECODER,
        EMBEDDED_DECODERS,
        DecoderTraining,
        DecoderVariant,
    )
    from fedfm.models.decoder.loading import load_causal_lm, load_decoder
    from fedfm.models.decoder.model import (
        build_decoder,
        check_vocabulary,
        context_length,
        document_ids,
        encode_prompt,
        greedy_generate,
        mean_loss,
        perplexity,
        register_attention,
        token_blocks,
        unigram_perplexity,
    )
    from fedfm.models.decoder.tokenizer import train_bpe
    from fedfm.models.decoder.training import train_decoder

_HOME = {
    "DecoderSource": "artefact",
    "read_report": "artefact",
    "DEFAULT_DECODER": "config",
    "EMBEDDED_DECODERS": "config",
    "DecoderTraining": "config",
    "DecoderVariant": "config",
    "load_causal_lm": "loading",
    "load_decoder": "loading",
    "build_decoder": "model",
    "check_vocabulary": "model",
    "context_length": "model",
    "document_ids": "model",
    "mean_loss": "model",
    "token_blocks": "model",
    "unigram_perplexity": "model",
    "encode_prompt": "model",
    "greedy_generate": "model",
    "perplexity": "model",
    "register_attention": "model",
    "train_bpe": "tokenizer",
    "train_decoder": "training",
}
__all__ = [
    "DEFAULT_DECODER",
    "EMBEDDED_DECODERS",
    "DecoderSource",
    "DecoderTraining",
    "DecoderVariant",
    "build_decoder",
    "check_vocabulary",
    "context_length",
    "document_ids",
    "encode_prompt",
    "greedy_generate",
    "load_causal_lm",
    "load_decoder",
    "mean_loss",
    "perplexity",
    "read_report",
    "register_attention",
    "token_blocks",
    "train_bpe",
    "train_decoder",
    "unigram_perplexity",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
