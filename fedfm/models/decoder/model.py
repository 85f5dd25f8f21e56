"""The decoder as transformers builds it, and what every protocol does with one.

* :func:`build_decoder`: an embedded variant as ``LlamaForCausalLM`` (transformers' own classes:
  RMSNorm, SwiGLU MLP, rotary position embeddings), freshly initialised.
* :func:`register_attention`: swap attention in through transformers' ``AttentionInterface``
  (no forked model code); registers the causal mask a custom function needs beside it.
* :func:`check_vocabulary`, :func:`context_length`, :func:`encode_prompt`: the checks that turn
  a tokenizer of another model or a prompt longer than the context into a clear error, where
  transformers would index out of range or silently extrapolate rotary positions.
* :func:`greedy_generate`, :func:`token_blocks`, :func:`perplexity`,
  :func:`unigram_perplexity`: deterministic generation and the held-out measures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import (
    AttentionInterface,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from fedfm.errors import ConfigError, ModelError
from fedfm.models.decoder.config import DecoderVariant

BUILT_IN_ATTENTION = ("eager", "sdpa")


def build_decoder(
    variant: DecoderVariant, *, attn_implementation: str = "eager"
) -> LlamaForCausalLM:
    """``LlamaForCausalLM`` for ``variant`` with fresh weights (from torch's global generator,
    as transformers initialises them) and the given attention implementation."""
    check_attention(attn_implementation)
    config = LlamaConfig(**variant.llama_config())
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config)


def register_attention(
    name: str,
    function: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    *,
    mask: str = "eager",
) -> None:
    """Register ``function`` as attention implementation ``name`` for every transformers model.

    ``function`` has the signature of transformers' ``eager_attention_forward``:
    ``(module, query, key, value, attention_mask, *, scaling, dropout, **kwargs) -> (output,
    weights)``. transformers builds *no* attention mask for an implementation it does not know,
    so a function registered alone attends to future tokens; this also registers the mask
    builder of the built-in implementation ``mask`` (``eager``: an additive float mask, 0 where
    allowed and the dtype's minimum elsewhere; ``sdpa``: a boolean mask) under ``name``.
    Both registries are transformers' own and global to the process.
    """
    if name in BUILT_IN_ATTENTION:
        raise ConfigError(f"attention implementation {name!r} is built in; register another name")
    if mask not in BUILT_IN_ATTENTION:
        raise ConfigError(f"mask must be one of {BUILT_IN_ATTENTION}, got {mask!r}")
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask])


def check_attention(name: str) -> None:
    """:class:`ModelError` unless ``name`` is ``eager``, ``sdpa`` or a registered function."""
    if name in BUILT_IN_ATTENTION or name in AttentionInterface._global_mapping:
        return
    raise ModelError(
        f"attention implementation {name!r} is not registered: use {list(BUILT_IN_ATTENTION)} or "
        "register it first with fedfm.models.decoder.register_attention(name, function)"
    )


def context_length(model: PreTrainedModel) -> int:
    """The longest sequence the model was built for (``max_position_embeddings``)."""
    length = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(length, int) or length < 1:
        raise ModelError(
            f"{type(model).__name__} states no context length (max_position_embeddings)"
        )
    return length


def check_vocabulary(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """:class:`ModelError` if the tokenizer can produce ids the model has no embedding for.

    A model may have more rows than the tokenizer has tokens (vocabularies padded to a multiple
    of 64, say); the other way round is a tokenizer of another model.
    """
    weight = model.get_input_embeddings().weight
    rows = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else 0
    if len(tokenizer) > rows:
        raise ModelError(
            f"tokenizer has {len(tokenizer)} tokens but the model embeds only {rows}: the "
            "tokenizer belongs to another model (load both from the same folder)"
        )


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, text: str, *, context: int, reserve: int = 0
) -> torch.Tensor:
    """Token ids of ``text`` (with ``<s>`` if the tokenizer adds it), shape ``(1, n)``.

    :class:`ConfigError` if ``n + reserve`` exceeds ``context`` (``reserve``: tokens still to be
    generated): rotary models extrapolate silently past their context, so fedfm refuses.
    """
    ids = tokenizer(text, return_tensors="pt", verbose=False)["input_ids"]
    if ids.shape[1] + reserve > context:
        extra = f" plus {reserve} tokens to generate" if reserve else ""
        raise ConfigError(
            f"text is {ids.shape[1]} tokens{extra}, more than the model's context of {context} "
            "tokens: shorten it or generate fewer tokens"
        )
    return ids


@torch.no_grad()
def greedy_generate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, *, max_new_tokens: int
) -> list[int]:
    """The ``max_new_tokens`` greedy (argmax) continuation of ``prompt`` as token ids, with the
    model's key/value cache; stops early at ``</s>``. Deterministic for given weights."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_vocabulary(model, tokenizer)
    ids = encode_prompt(tokenizer, prompt, context=context_length(model), reserve=max_new_tokens)
    ids = ids.to(model.device)
    model.eval()
    output = model.generate(  # type: ignore[operator]
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return [int(token) for token in output[0, ids.shape[1] :]]


def document_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """``<s> text </s>`` token ids per text (no length limit: for packing)."""
    backend = tokenizer.backend_tokenizer
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    encoded = backend.encode_batch(list(texts), add_special_tokens=False)
    return [[bos, *item.ids, eos] for item in encoded]


def token_blocks(documents: Sequence[Sequence[int]], context: int) -> torch.Tensor:
    """The documents' ids one after another, cut into full blocks of ``context`` (the ragged end
    is dropped), shape ``(blocks, context)``."""
    stream = np.fromiter((token for ids in documents for token in ids), dtype=np.int64)
    count = len(stream) // context
    if count == 0:
        raise ConfigError(f"{len(stream)} tokens do not fill one block of {context}")
    return torch.from_numpy(stream[: count * context].reshape(count, context).copy())


@torch.no_grad()
def mean_loss(model: PreTrainedModel, blocks: torch.Tensor, *, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over every predicted position of ``blocks`` (moved
    to the model's device a batch at a time)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size].to(model.device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        targets = batch[:, 1:]
        total += float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            )
        )
        count += targets.numel()
    return total / count


def perplexity(model: PreTrainedModel, blocks: torch.Tensor, *, batch_size: int = 32) -> float:
    """Per-token perplexity, ``exp`` of :func:`mean_loss`."""
    return math.exp(mean_loss(model, blocks, batch_size=batch_size))


def unigram_perplexity(train: torch.Tensor, held_out: torch.Tensor, vocab_size: int) -> float:
    """Perplexity on ``held_out``'s predicted positions of the training tokens' frequencies
    (add-one smoothing): the baseline a model that ignores context reaches."""
    counts = torch.bincount(train.reshape(-1), minlength=vocab_size).double() + 1.0
    log_probs = torch.log(counts / counts.sum())
    return math.exp(-float(log_probs[held_out[:, 1:].reshape(-1)].mean()))


def describe(model: PreTrainedModel) -> dict[str, Any]:
    """Parameter count and the architecture fields a report shows."""
    config = model.config
    return {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "attn_implementation": config._attn_implementation,
        **{
            key: getattr(config, key, None)
            for key in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "tie_word_embeddings",
            )
        },
    }
