"""A byte-level BPE trained with ``tokenizers`` and wrapped for transformers.

Byte-level (GPT-2 style): every string maps to bytes first, so nothing is ever unknown and
``decode(encode(text)) == text`` for any text. The wrapper is a ``PreTrainedTokenizerFast`` that
prepends ``<s>`` (as Llama's tokenizer does); ``decode(..., skip_special_tokens=True)`` drops it
again. Token ids 0, 1, 2 are ``<s>``, ``</s>``, ``<pad>`` (:data:`SPECIAL_TOKENS`), matching
:meth:`DecoderVariant.llama_config`.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from fedfm.errors import ConfigError
from fedfm.models.decoder.config import (
    BOS_TOKEN,
    BYTE_ALPHABET,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
)


def train_bpe(texts: Iterable[str], *, vocab_size: int, context: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens (special tokens included) on ``texts``.

    ``context`` becomes ``model_max_length``. Deterministic for the same texts and size.
    """
    if vocab_size < BYTE_ALPHABET + len(SPECIAL_TOKENS):
        raise ConfigError(
            f"a byte-level BPE needs at least {BYTE_ALPHABET + len(SPECIAL_TOKENS)} tokens, "
            f"got vocab_size={vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos)],
    )
    return wrap(tokenizer, context=context)


def wrap(tokenizer: Tokenizer, *, context: int) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a ``tokenizers`` one with fedfm's special tokens."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=context,
        clean_up_tokenization_spaces=False,  # keep decode an exact inverse
    )
