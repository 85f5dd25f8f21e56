"""One call for protocols: the cached embedded decoder, or any Hugging Face causal LM.

:func:`load_decoder` returns ``(model, tokenizer)`` in eval mode with the requested attention
implementation. The embedded default is never trained behind a protocol's back: when its cache
folder is missing, :func:`load_decoder` refuses and names the ``fedfm train-llm`` command that
makes it, unless the caller passes ``train_if_missing=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub import constants as hub_constants

from fedfm.errors import ConfigError, ModelError
from fedfm.hub import hub_unreachable_reason
from fedfm.models.decoder.artefact import REPORT_FILE, DecoderSource, load_folder, read_report
from fedfm.models.decoder.config import (
    DEFAULT_CACHE_DIR,
    DEFAULT_DECODER,
    EMBEDDED_DECODERS,
    DecoderTraining,
)
from fedfm.models.decoder.model import check_attention
from fedfm.models.decoder.training import train_decoder


def load_decoder(
    name_or_path: str | Path | DecoderSource | None = None,
    *,
    cache_dir: str | Path | None = None,
    attn_implementation: str = "eager",
    training: DecoderTraining | None = None,
    train_if_missing: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[Any, Any]:
    """A causal LM and its tokenizer, ready for inference (``eval()``, float32, CPU).

    Parameters
    ----------
    name_or_path
        ``None`` or an embedded variant name (:data:`EMBEDDED_DECODERS`, default
        ``llama_fedfm_tiny``): the decoder fedfm trained, from ``cache_dir``. A
        :class:`DecoderSource`: that embedded decoder (its own cache folder, training settings
        and text). Otherwise a local Hugging Face folder or a hub name (:func:`load_causal_lm`).
    cache_dir
        Where ``fedfm train-llm`` caches the embedded decoder (its ``--cache-dir``; default
        ``runs/cache``).
    attn_implementation
        ``eager`` (the default: explicit softmax, the reference), ``sdpa``, or a name registered
        with :func:`fedfm.models.decoder.register_attention`.
    training
        The embedded decoder's training settings (default :class:`DecoderTraining`); part of
        its cache key.
    train_if_missing
        Train the embedded decoder now (minutes) if it is not cached, instead of refusing.

    Raises
    ------
    ConfigError
        The embedded decoder is not cached (the message names the command that makes it).
    ModelError
        A named model is not available (offline: not in the Hugging Face cache), a folder holds
        no causal LM, its tokenizer does not fit it, or the attention is not registered.
    """
    check_attention(attn_implementation)
    if isinstance(name_or_path, DecoderSource):
        if cache_dir is not None or training is not None:
            raise ConfigError("a DecoderSource names its own cache_dir and training settings")
        source: DecoderSource | None = name_or_path
    elif name_or_path is None or str(name_or_path) in EMBEDDED_DECODERS:
        source = DecoderSource(
            name=str(name_or_path or DEFAULT_DECODER),
            cache_dir=Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR,
            training=training or DecoderTraining(),
        )
    else:
        source = None
    if source is not None:
        return load_embedded(
            source,
            attn_implementation=attn_implementation,
            train_if_missing=train_if_missing,
            progress=progress,
            log=log,
        )
    if training is not None:
        raise ConfigError(f"training settings apply to the embedded decoders, not {name_or_path!r}")
    return load_causal_lm(str(name_or_path), attn_implementation=attn_implementation)


def load_embedded(
    source: DecoderSource,
    *,
    attn_implementation: str = "eager",
    train_if_missing: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[Any, Any]:
    """The embedded decoder of ``source`` from its cache folder (see :func:`load_decoder`)."""
    if not source.path.exists():
        if not train_if_missing:
            raise ConfigError(
                f"no trained decoder {source.name} at {source.path}: the model owner trains it "
                f"first, with `{source.train_command()}`"
            )
        train_decoder(source, progress=progress, log=log)
    read_report(source.path)
    return load_folder(source.path, attn_implementation=attn_implementation)


def load_causal_lm(
    name_or_path: str | Path, *, attn_implementation: str = "eager"
) -> tuple[Any, Any]:
    """Any Hugging Face causal LM and its tokenizer, from a local folder or the hub.

    A local folder is read as it is (a fedfm decoder folder's ``report.json`` is checked). A hub
    name is taken from the Hugging Face cache when the hub is unreachable or ``HF_HUB_OFFLINE`` is
    set, and downloaded by transformers only when the hub answers.
    """
    path = Path(name_or_path)
    if path.is_dir():
        if (path / REPORT_FILE).exists():
            read_report(path)
        return load_folder(path, attn_implementation=attn_implementation)
    name = str(name_or_path)
    if path.exists():
        raise ModelError(f"{path} is a file: pass the folder that holds the model and tokenizer")
    if path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1:
        raise ModelError(f"no model folder at {name_or_path}")
    check_attention(attn_implementation)
    reason = None if hub_constants.HF_HUB_OFFLINE else hub_unreachable_reason()
    offline = hub_constants.HF_HUB_OFFLINE or reason is not None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedfm.models.decoder.artefact import quiet_transformers
    from fedfm.models.decoder.model import check_vocabulary

    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
            model = AutoModelForCausalLM.from_pretrained(
                name, local_files_only=offline, attn_implementation=attn_implementation
            )
    except Exception as error:  # transformers raises OS, value, HTTP and safetensors errors
        why = reason or ("HF_HUB_OFFLINE is set" if offline else None)
        where = (
            f"not in the Hugging Face cache ({hub_constants.HF_HUB_CACHE}) and {why}"
            if why
            else f"could not be loaded from the hub ({type(error).__name__})"
        )
        raise ModelError(
            f"causal LM {name!r} is {where}: pass a local folder, or fetch the model into the "
            "Hugging Face cache first"
        ) from None
    check_vocabulary(model, tokenizer)
    return model.eval(), tokenizer
