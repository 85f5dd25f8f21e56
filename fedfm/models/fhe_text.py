"""FHE-friendly BERT-family text encoders: a Hugging Face model with polynomial non-linearities.

:func:`to_fhe_text` copies a post-LayerNorm encoder (``BertModel``, e.g. the packaged MiniLM, or
``DistilBertModel``) built by transformers' own classes and changes it without forking its code:

* **attention** through :data:`ATTENTION_IMPLEMENTATION`, a function registered with
  ``transformers.AttentionInterface`` (and a boolean padding mask registered with
  ``AttentionMaskInterface``); it computes ``A = QK^T * scale`` (Eq. 10) and calls the
  :class:`FheSoftmax` attached to each self-attention module, an
  :class:`~fedfm.approx.ApproxSoftmax` that gives padding keys weight exactly zero (a 0/1
  product after the polynomial: an additive ``-inf`` mask would blow up a Taylor exp);
* **GELU** (``intermediate_act_fn`` / ``ffn.activation``) swapped for
  :class:`~fedfm.approx.ApproxGELU`;
* **the blocks' LayerNorms** swapped for :class:`~fedfm.approx.ApproxLayerNorm` (same weights).
  The embedding LayerNorm stays exact: the client computes the token embeddings in plaintext,
  as it computes a ViT's patch embedding.

:class:`FheTextClassifier` adds a linear head on the mean over real tokens and decomposes the
model as :class:`~fedfm.models.fhe_vit.FheViT` does: :meth:`~FheTextClassifier.embed` (the
client), :meth:`~FheTextClassifier.block` ``k`` (what the server evaluates, given the key mask),
:meth:`~FheTextClassifier.head`. Inputs are token ids padded on the right with the tokenizer's
pad id; the key mask is ``input_ids != pad_token_id``.

Models load offline only (:func:`load_text_encoder`): the packaged MiniLM (``"minilm"``), or a
Hugging Face name or folder already on this machine; nothing is downloaded.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModel,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.activations import GELUActivation, NewGELUActivation, PytorchGELUTanh
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fedfm.approx.modules import ApproxGELU, ApproxLayerNorm, ApproxSoftmax, ChannelScaledGELU
from fedfm.approx.specs import ApproxConfig
from fedfm.errors import ConfigError, DataError, ModelError
from fedfm.models.intermediates import Intermediates
from fedfm.models.text_encoders import packaged_minilm_path

ATTENTION_IMPLEMENTATION = "fedfm_fhe"
# Post-LayerNorm encoders whose blocks this module knows how to reach (``<model>.<path>``).
ENCODER_LAYERS = {"bert": "encoder.layer", "distilbert": "transformer.layer"}
DEFAULT_MAX_TOKENS = 64
_TANH_GELU = (NewGELUActivation, PytorchGELUTanh)
_UNSUPPORTED = (nn.ReLU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Softmax)


class FheSoftmax(nn.Module):
    """The attention softmax of one block: an :class:`ApproxSoftmax` under a key mask.

    While :attr:`recording` is set, the last un-normalised attention matrix is kept in
    :attr:`last_logits` (zero at masked entries), for Stage I of distillation.
    """

    def __init__(self, softmax: ApproxSoftmax) -> None:
        super().__init__()
        self.softmax = softmax
        self.recording = False
        self.last_logits: torch.Tensor | None = None

    def forward(self, logits: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if self.recording:
            self.last_logits = logits if keep is None else logits * keep.to(logits.dtype)
        return self.softmax(logits, keep)


def _keep_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean "may attend" mask from what transformers passes (boolean, or additive float)."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def fhe_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``AttentionInterface`` function: ``softmax(QK^T * scale) V`` with the module's
    :class:`FheSoftmax` (inputs ``(batch, heads, tokens, head_dim)``, as eager attention)."""
    softmax = getattr(module, "fhe_softmax", None)
    if not isinstance(softmax, FheSoftmax):
        raise ModelError(
            f"{type(module).__name__} has no FHE-friendly softmax: build the model with "
            "fedfm.models.fhe_text.to_fhe_text, not with attn_implementation alone"
        )
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    logits = torch.matmul(query, key.transpose(2, 3)) * scaling
    weights = softmax(logits, _keep_mask(attention_mask))
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


AttentionInterface.register(ATTENTION_IMPLEMENTATION, fhe_attention)
AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)  # boolean, True = attend


def check_encoder_config(config: PretrainedConfig) -> str:
    """The layer path of a supported post-LayerNorm encoder config; :class:`ModelError` otherwise
    (decoders, encoder-decoders, other architectures)."""
    model_type = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        raise ModelError(
            f"{model_type} config is a decoder (is_decoder / is_encoder_decoder): the "
            "FHE-friendly text model needs a bidirectional encoder such as BERT or MiniLM"
        )
    if model_type not in ENCODER_LAYERS:
        raise ModelError(
            f"model type {model_type!r} is not a supported BERT-family encoder "
            f"(supported: {sorted(ENCODER_LAYERS)})"
        )
    return ENCODER_LAYERS[model_type]


def check_tokenizer(tokenizer: Any, config: PretrainedConfig) -> int:
    """The tokenizer's pad id, after checking its ids fit the model's embedding table."""
    vocabulary = len(tokenizer)
    if vocabulary > config.vocab_size:
        raise ModelError(
            f"tokenizer/model mismatch: the tokenizer has {vocabulary} tokens, the model's "
            f"embedding table {config.vocab_size}; load the tokenizer that belongs to the model"
        )
    if tokenizer.pad_token_id is None:
        raise ModelError("the tokenizer has no padding token; the key mask needs one")
    return int(tokenizer.pad_token_id)


def load_text_encoder(source: str | Path = "minilm") -> tuple[PreTrainedModel, Any]:
    """The encoder and its tokenizer, offline: ``"minilm"`` (packaged) or a Hugging Face name or
    folder already on this machine.

    Raises
    ------
    ModelError
        If the model is not on this machine (never downloaded), is not a supported encoder, or
        its tokenizer does not fit it.
    """
    path = packaged_minilm_path() if str(source) == "minilm" else source
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except OSError as error:
        raise ModelError(
            f"text encoder {str(source)!r} is not available on this machine ({error}); fedfm "
            "does not download models: pass a local folder, or fetch it into the Hugging Face "
            "cache first"
        ) from None
    check_encoder_config(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModel.from_pretrained(str(path), local_files_only=True)
    except OSError as error:
        raise ModelError(f"text encoder {str(source)!r} is incomplete: {error}") from None
    check_tokenizer(tokenizer, model.config)
    return model.eval(), tokenizer


def _gelu(approx: ApproxConfig, approximate: str, channels: int, source: nn.Module) -> ApproxGELU:
    if approx.gelu is not None and approx.gelu_channel_scale:
        scaled = ChannelScaledGELU(approx.gelu, channels, approximate=approximate)
        if isinstance(source, ChannelScaledGELU):  # a copy keeps the calibrated scale
            scaled.channel_scale.copy_(source.channel_scale)
        return scaled
    return ApproxGELU(approx.gelu, approximate=approximate)


def _swap_modules(module: nn.Module, approx: ApproxConfig, channels: int) -> None:
    """Replace the non-linearities under ``module``; ``channels`` is the GELU's input width."""
    for name, child in module.named_children():
        if isinstance(child, GELUActivation | nn.GELU | ApproxGELU):
            # transformers' GELUActivation is exact; its tanh variants are other classes
            exact = isinstance(child, GELUActivation)
            approximate = "none" if exact else getattr(child, "approximate", "none")
            setattr(module, name, _gelu(approx, approximate, channels, child))
        elif isinstance(child, _TANH_GELU):
            setattr(module, name, _gelu(approx, "tanh", channels, child))
        elif isinstance(child, nn.LayerNorm | ApproxLayerNorm):
            setattr(module, name, ApproxLayerNorm.replacing(child, approx.inv_sqrt))
        elif isinstance(child, _UNSUPPORTED):
            raise ModelError(
                f"module {name} is a {type(child).__name__}, which has no FHE-friendly replacement"
            )
        else:
            _swap_modules(child, approx, channels)


def _self_attentions(layer: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a block: those that dispatch through AttentionInterface."""
    found = [
        m
        for m in layer.modules()
        if type(m).__name__.endswith("SelfAttention") and hasattr(m, "config")
    ]
    if len(found) != 1:
        raise ModelError(
            f"expected one self-attention module in {type(layer).__name__}, found {len(found)}"
        )
    return found


@dataclass(frozen=True)
class TextBlockModules:
    """The parts of one post-LayerNorm block, in evaluation order, whatever the architecture
    names them: ``h = attention_norm(x + attention_output(attention(x)))``, then
    ``output_norm(h + output(activation(intermediate(h))))``."""

    query: nn.Linear
    key: nn.Linear
    value: nn.Linear
    heads: int
    softmax: ApproxSoftmax
    attention_output: nn.Linear
    attention_norm: nn.Module
    intermediate: nn.Linear
    activation: nn.Module
    output: nn.Linear
    output_norm: nn.Module


def _block_modules(layer: nn.Module) -> TextBlockModules:
    attention: Any = _self_attentions(layer)[0]
    softmax = getattr(attention, "fhe_softmax", None)
    if not isinstance(softmax, FheSoftmax):
        raise ModelError("build the FHE-friendly text model with to_fhe_text")
    parts: Any = layer
    if hasattr(parts, "ffn"):  # DistilBERT's TransformerBlock
        return TextBlockModules(
            query=attention.q_lin,
            key=attention.k_lin,
            value=attention.v_lin,
            heads=int(attention.n_heads),
            softmax=softmax.softmax,
            attention_output=attention.out_lin,
            attention_norm=parts.sa_layer_norm,
            intermediate=parts.ffn.lin1,
            activation=parts.ffn.activation,
            output=parts.ffn.lin2,
            output_norm=parts.output_layer_norm,
        )
    return TextBlockModules(  # BERT's BertLayer
        query=attention.query,
        key=attention.key,
        value=attention.value,
        heads=int(attention.num_attention_heads),
        softmax=softmax.softmax,
        attention_output=parts.attention.output.dense,
        attention_norm=parts.attention.output.LayerNorm,
        intermediate=parts.intermediate.dense,
        activation=parts.intermediate.intermediate_act_fn,
        output=parts.output.dense,
        output_norm=parts.output.LayerNorm,
    )


class FheTextClassifier(nn.Module):
    """A BERT-family encoder whose non-linearities follow an :class:`ApproxConfig`, with a linear
    head on the mean over real tokens. Build it with :func:`to_fhe_text`.

    With ``ApproxConfig.exact()`` it computes what the Hugging Face model it was built from
    computes (and the head on its mean-pooled output).
    """

    def __init__(
        self,
        encoder: PreTrainedModel,
        head: nn.Linear,
        approx: ApproxConfig,
        *,
        pad_token_id: int,
        max_tokens: int,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.classifier = head
        self.approx = approx
        self.pad_token_id = pad_token_id
        self.max_tokens = max_tokens
        layer_path = check_encoder_config(encoder.config)
        layers: Any = encoder
        for part in layer_path.split("."):
            layers = getattr(layers, part)
        self.layers: nn.ModuleList = layers
        self._softmaxes: list[FheSoftmax] = []
        for layer in self.layers:
            softmax = getattr(_self_attentions(layer)[0], "fhe_softmax", None)
            if not isinstance(softmax, FheSoftmax):
                raise ModelError("build the FHE-friendly text model with to_fhe_text")
            self._softmaxes.append(softmax)

    @property
    def num_blocks(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.encoder.config.hidden_size)

    def key_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``True`` at real tokens, ``False`` at padding: shape ``(batch, tokens)``."""
        return input_ids != self.pad_token_id

    def trimmed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` without the trailing columns that are padding in every row (padding
        never changes the real tokens' outputs, so this only saves time)."""
        real = self.key_mask(input_ids).any(dim=0).nonzero()
        return input_ids[:, : int(real.max()) + 1] if len(real) else input_ids[:, :1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token, position (and segment) embeddings and their LayerNorm: the client's step,
        the first block's input ``b_0``.

        Raises :class:`DataError` for sequences longer than :attr:`max_tokens`.
        """
        if input_ids.ndim != 2 or input_ids.dtype != torch.long:
            raise DataError(
                f"token ids must be an int64 tensor (batch, tokens), got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        if input_ids.shape[1] > self.max_tokens:
            raise DataError(
                f"sequences of {input_ids.shape[1]} tokens exceed the configured "
                f"{self.max_tokens}; tokenize with max_length={self.max_tokens} and truncation"
            )
        embeddings: Any = self.encoder.embeddings
        embedded: torch.Tensor = embeddings(input_ids=input_ids)
        return embedded

    def embedding_tables(self) -> tuple[dict[str, np.ndarray], float]:
        """What a data owner needs to compute :meth:`embed` itself, and the LayerNorm's ``eps``:
        the token table, the first :attr:`max_tokens` rows of the position table, the segment-0
        row (zero for models without segments) and the LayerNorm's weight and bias.

        The double-blind protocol sends these to the data owners at setup (a token lookup in a
        30,522-row table under CKKS is out of reach), so the model owner reveals its embedding
        layer, and only that (``docs/text_encoder.md``).
        """
        embeddings: Any = self.encoder.embeddings
        word = embeddings.word_embeddings.weight
        segments = getattr(embeddings, "token_type_embeddings", None)
        segment = segments.weight[0] if segments is not None else torch.zeros(word.shape[1])
        norm = embeddings.LayerNorm
        tables = {
            "word": word,
            "position": embeddings.position_embeddings.weight[: self.max_tokens],
            "segment": segment,
            "norm_weight": norm.weight,
            "norm_bias": norm.bias,
        }
        arrays = {
            name: value.detach().cpu().numpy().astype(np.float32) for name, value in tables.items()
        }
        return arrays, float(norm.eps)

    def block(self, index: int, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """Block ``index`` (0-based): ``b_l = B_l(b_{l-1})``; ``key_mask`` from :meth:`key_mask`."""
        return self.block_with_logits(index, hidden, key_mask)[0]

    def block_with_logits(
        self, index: int, hidden: torch.Tensor, key_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``index`` and its un-normalised attention matrix (Eq. 10; zero at padding keys)."""
        if not 0 <= index < self.num_blocks:
            raise ModelError(f"block index {index} out of range 0..{self.num_blocks - 1}")
        softmax = self._softmaxes[index]
        softmax.recording = True
        try:
            out = self.layers[index](hidden, attention_mask=key_mask[:, None, None, :])
        finally:
            softmax.recording = False
        hidden = out[0] if isinstance(out, tuple) else out
        logits = softmax.last_logits
        softmax.last_logits = None
        if logits is None:
            raise ModelError(f"block {index} did not run its FHE-friendly attention")
        return hidden, logits

    def block_modules(self, index: int) -> TextBlockModules:
        """The layers of block ``index`` by role (what an encrypted evaluator folds and runs)."""
        if not 0 <= index < self.num_blocks:
            raise ModelError(f"block index {index} out of range 0..{self.num_blocks - 1}")
        return _block_modules(self.layers[index])

    def pool(self, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """Mean over the real tokens of the last block's output."""
        weights = key_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)

    def head(self, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """Mean pooling and the linear classifier on ``b_L``."""
        logits: torch.Tensor = self.classifier(self.pool(hidden, key_mask))
        return logits

    def forward_intermediates(self, input_ids: torch.Tensor) -> Intermediates:
        """Everything distillation aligns; padding positions are zero in every tensor."""
        input_ids = self.trimmed(input_ids)
        key_mask = self.key_mask(input_ids)
        tokens = key_mask.unsqueeze(-1).to(torch.get_default_dtype())
        pairs = (key_mask[:, :, None] & key_mask[:, None, :])[:, None].to(tokens.dtype)
        hidden = self.embed(input_ids)
        embedding = hidden * tokens
        attention, states = [], []
        for index in range(self.num_blocks):
            hidden, logits = self.block_with_logits(index, hidden, key_mask)
            attention.append(logits * pairs)
            states.append(hidden * tokens)
        return Intermediates(embedding, attention, states, self.head(hidden, key_mask))

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The mean-pooled output of the last block (the head's input)."""
        input_ids = self.trimmed(input_ids)
        key_mask = self.key_mask(input_ids)
        hidden = self.embed(input_ids)
        for index in range(self.num_blocks):
            hidden = self.block(index, hidden, key_mask)
        return self.pool(hidden, key_mask)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(self.encode(input_ids))
        return logits

    def with_approx(self, approx: ApproxConfig) -> FheTextClassifier:
        """A copy with the same weights but other approximations (calibrate it unless exact)."""
        return to_fhe_text(
            self.encoder,
            approx,
            head=self.classifier,
            pad_token_id=self.pad_token_id,
            max_tokens=self.max_tokens,
        )


def to_fhe_text(
    encoder: PreTrainedModel,
    approx: ApproxConfig,
    *,
    head: nn.Linear | None = None,
    num_classes: int | None = None,
    pad_token_id: int,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> FheTextClassifier:
    """Copy ``encoder`` (and ``head``) and make its blocks FHE-friendly as ``approx`` says; the
    sources are untouched.

    ``head`` is the classifier on the mean-pooled output; without one, a new linear layer with
    ``num_classes`` outputs.

    Raises
    ------
    ModelError
        For decoders and unsupported architectures, a model that does not dispatch attention
        through ``AttentionInterface``, or non-polynomial layers without a replacement.
    ConfigError
        For a ``max_tokens`` the model's position table cannot hold, or neither ``head`` nor
        ``num_classes``.
    """
    config = encoder.config
    check_encoder_config(config)
    positions = getattr(config, "max_position_embeddings", max_tokens)
    if not 1 <= max_tokens <= positions:
        raise ConfigError(
            f"max_tokens must be in 1..{positions} (the model's position table), got {max_tokens}"
        )
    if head is None:
        if num_classes is None or num_classes < 2:
            raise ConfigError(f"a new head needs num_classes >= 2, got {num_classes}")
        head = nn.Linear(int(config.hidden_size), num_classes)
    if head.in_features != config.hidden_size:
        raise ModelError(
            f"head takes {head.in_features} features, the encoder gives {config.hidden_size}"
        )
    encoder = copy.deepcopy(encoder)
    encoder.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    if encoder.config._attn_implementation != ATTENTION_IMPLEMENTATION:
        raise ModelError(
            f"{type(encoder).__name__} does not dispatch attention through AttentionInterface"
        )
    layers: Any = encoder
    for part in ENCODER_LAYERS[config.model_type].split("."):
        layers = getattr(layers, part)
    channels = int(getattr(config, "intermediate_size", 0) or getattr(config, "hidden_dim", 0))
    for layer in layers:
        _swap_modules(layer, approx, channels)
        attention = _self_attentions(layer)[0]
        attention.fhe_softmax = FheSoftmax(ApproxSoftmax(approx.exp, approx.inverse))
    return FheTextClassifier(
        encoder,
        copy.deepcopy(head),
        approx,
        pad_token_id=pad_token_id,
        max_tokens=max_tokens,
    )
