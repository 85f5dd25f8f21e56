"""Plaintext centralized RAG: the utility reference (spec 002 §7.4, "Baseline").

One party holds every segment and runs the decoder with transformers' own eager attention and
its key/value cache: greedy decoding (or the forced tokens, for perplexity) of exactly
``max_new_tokens`` tokens, no early stop at ``</s>`` (the protocol generates the same count).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedfm.errors import ConfigError
from fedfm.protocols.fedrag.decoder import DecoderRunner, eager_model


@torch.no_grad()
def plaintext_generate(
    runner: DecoderRunner,
    segments: Sequence[np.ndarray],
    max_new_tokens: int,
    *,
    forced: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens (T,), logits (T, vocab))`` of the centralized model on the concatenated
    segments; with ``forced``, token ``t + 1`` is ``forced[t]`` (teacher forcing)."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in segments])
    if ids.size + max_new_tokens > runner.geometry.context:
        raise ConfigError(
            f"{ids.size} prompt tokens plus {max_new_tokens} to generate exceed the model's "
            f"context of {runner.geometry.context}"
        )
    tokens, rows = [], []
    with eager_model(runner.model) as model:
        output = model(input_ids=torch.as_tensor(ids)[None], use_cache=True)
        for step in range(max_new_tokens):
            logits = output.logits[0, -1].float()
            rows.append(logits.numpy().copy())
            if forced is not None and step < len(forced):
                token = int(forced[step])
            else:
                token = int(torch.argmax(logits))
            tokens.append(token)
            if step + 1 < max_new_tokens:
                output = model(
                    input_ids=torch.tensor([[token]]),
                    cache=output.past_key_values,
                    use_cache=True,
                )
    return np.asarray(tokens, dtype=np.int64), np.stack(rows)


def perplexity_of(logits: np.ndarray, targets: np.ndarray) -> float:
    """``exp`` of the mean negative log-likelihood of ``targets`` under ``logits`` rows."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    picked = log_probs[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)]
    return float(np.exp(-picked.mean()))
