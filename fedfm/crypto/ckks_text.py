"""A block of the FHE-friendly BERT-family encoder on packed CKKS ciphertexts.

The slot layout, the linear layers, LayerNorm and multi-head attention are those of
:mod:`fedfm.crypto.ckks_vit` (one ciphertext per feature, samples x tokens in the slots); what a
text block adds:

* **post-LayerNorm**: ``h = LN1(x + attention(x))``, ``out = LN2(h + MLP(h))``. The first
  LayerNorm's weight and bias fold into the intermediate layer as a ViT's do; the residual
  stream needs them applied (one scalar product per feature: a level off the critical path),
  and so does the block's output, which the data owner decrypts;
* **a key mask** (:class:`~fedfm.crypto.ckks_vit.KeyMask`): texts are padded on the right and
  padding keys must get attention weight zero. The mask enters the logits' existing valid-token
  product; no level of its own. The server holds it in plaintext: it learns each text's length
  (``docs/ckks.md``);
* **a channel-scaled GELU**: the per-channel scales fold into the two MLP matrices
  (:meth:`~fedfm.approx.modules.ChannelScaledGELU.folded_linear_layers`), so the circuit
  evaluates the plain polynomial (the quartic of the text default costs one level more than a
  ViT's quadratic: the refresh schedule plans it).

Every query token is evaluated, padding included, as the plaintext model does, so an encrypted
block's output matches :meth:`~fedfm.models.fhe_text.FheTextClassifier.block` at every position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedfm.approx.evaluate import polyval
from fedfm.approx.modules import ApproxGELU, ApproxLayerNorm, ApproxSoftmax, ChannelScaledGELU
from fedfm.approx.specs import PolySpec
from fedfm.crypto.backend import Work
from fedfm.crypto.circuit import Circuit, evaluate_traced, symbol
from fedfm.crypto.ckks_vit import (
    AttentionLayers,
    KeyMask,
    Linear,
    Tensor,
    _bound,
    _flat,
    _shape,
    add,
    folded_linear,
    layer_norm,
    linear,
    multi_head_attention,
    unfolded_linear,
)
from fedfm.crypto.packing import SlotLayout
from fedfm.errors import ModelError

if TYPE_CHECKING:  # annotations only: transformers stays out of a data owner's ClientApp process
    from fedfm.models.fhe_text import FheTextClassifier


@dataclass(frozen=True)
class TextBlockLayers:
    """One block as the circuit evaluates it: plain arrays, GELU scales folded."""

    attention: AttentionLayers
    softmax: ApproxSoftmax
    attention_norm: ApproxLayerNorm
    intermediate: Linear
    gelu: PolySpec
    output: Linear
    output_norm: ApproxLayerNorm


def block_layers(model: FheTextClassifier, index: int) -> TextBlockLayers:
    """Block ``index`` of ``model`` as :class:`TextBlockLayers`; :class:`ModelError` when a part
    is not polynomial (exact softmax, GELU or LayerNorm)."""
    parts = model.block_modules(index)
    where = f"block {index}"
    softmax = parts.softmax
    if softmax.exp_spec is None or softmax.inverse_spec is None:
        raise ModelError(f"{where}: CKKS needs the polynomial softmax (exp and inverse)")
    attention_norm, output_norm = parts.attention_norm, parts.output_norm
    if not (
        isinstance(attention_norm, ApproxLayerNorm)
        and isinstance(output_norm, ApproxLayerNorm)
        and attention_norm.spec is not None
        and output_norm.spec is not None
    ):
        raise ModelError(f"{where}: CKKS needs both LayerNorms with the polynomial inverse sqrt")
    activation = parts.activation
    if not isinstance(activation, ApproxGELU) or activation.spec is None:
        raise ModelError(f"{where}: the MLP activation is not the polynomial GELU")
    intermediate, output = parts.intermediate, parts.output
    if isinstance(activation, ChannelScaledGELU):
        intermediate, output = activation.folded_linear_layers(intermediate, output)
    width = parts.query.in_features
    if width % parts.heads:
        raise ModelError(f"{where}: width {width} is not a multiple of {parts.heads} heads")
    scale = (width // parts.heads) ** -0.5
    return TextBlockLayers(
        attention=AttentionLayers(
            query=Linear.of(parts.query).times(scale),
            key=Linear.of(parts.key),
            value=Linear.of(parts.value),
            output=Linear.of(parts.attention_output),
            heads=parts.heads,
        ),
        softmax=softmax,
        attention_norm=attention_norm,
        intermediate=Linear.of(intermediate),
        gelu=activation.spec,
        output=Linear.of(output),
        output_norm=output_norm,
    )


def check_encryptable(model: FheTextClassifier) -> None:
    """Refuse a text model with a block that is not entirely polynomial."""
    for index in range(model.num_blocks):
        block_layers(model, index)


def affine(
    circuit: Circuit,
    norm: ApproxLayerNorm,
    centring: float,
    normed: Tensor,
    valid: np.ndarray,
    place: str,
) -> Work[Tensor]:
    """A LayerNorm's output with its weight and bias applied (one level): ``normed`` from
    :func:`~fedfm.crypto.ckks_vit.layer_norm` is zero outside ``valid``, the bias is added there
    only."""
    weight = np.asarray(norm.weight.detach().double().numpy()) / (centring * np.sqrt(_bound(norm)))
    bias = np.asarray(norm.bias.detach().double().numpy())
    if np.any(np.abs(weight) <= 1e-12):
        raise ModelError(f"{place}: a LayerNorm weight of zero is not supported under CKKS")
    (flat,) = yield from circuit.ensure([_flat(normed)], 1, place)
    normed = _shape(flat, len(normed))
    return [
        [
            circuit.add_vector(circuit.scale_by(ct, float(weight[i])), None, bias[i] * valid[c])
            for c, ct in enumerate(feature)
        ]
        for i, feature in enumerate(normed)
    ]


def mlp(
    circuit: Circuit,
    layers: TextBlockLayers,
    layout: SlotLayout,
    normed: Tensor,
    centring: float,
    samples: int,
    place: str,
) -> Work[Tensor]:
    """``output(gelu(intermediate(h)))`` with ``h`` the first LayerNorm's output, its weight and
    bias folded into the intermediate layer (``normed`` is the LayerNorm before them)."""
    (flat,) = yield from circuit.ensure([_flat(normed)], 1, f"{place}/fc1")
    normed = _shape(flat, len(normed))
    fc1 = layers.intermediate.after_norm(layers.attention_norm, centring)
    # at half the batch capacity and below, two hidden features per ciphertext (as a ViT's MLP)
    folded = layout.folds(samples)
    hidden = folded_linear(circuit, layout, fc1, normed) if folded else linear(circuit, fc1, normed)
    h = symbol()
    activated = yield from evaluate_traced(
        circuit, polyval(layers.gelu, h), {h: _flat(hidden)}, f"{place}/gelu", output_headroom=1
    )
    width = len(hidden)
    del hidden, normed
    (activated,) = yield from circuit.ensure([activated], 1, f"{place}/fc2")
    tensor = _shape(activated, width)
    if folded:
        return unfolded_linear(circuit, layout, layers.output, tensor)
    return linear(circuit, layers.output, tensor)


def block(
    circuit: Circuit,
    model: FheTextClassifier,
    index: int,
    layout: SlotLayout,
    x: Tensor,
    samples: int,
    keys: KeyMask,
) -> Work[Tensor]:
    """Block ``index`` of ``model`` on ``x`` (token copies valid); the output has no copies."""
    layers = block_layers(model, index)
    place = f"block{index + 1}"
    valid = layout.valid(samples)
    (flat,) = yield from circuit.ensure([_flat(x)], 1, f"{place}/qkv")
    x = _shape(flat, len(x))
    attended = yield from multi_head_attention(
        circuit, layers.softmax, layers.attention, layout, x, samples, place, keys
    )
    first = layers.attention_norm
    residual = add(circuit, x, attended)
    del x, attended  # a column of MiniLM's hidden states is 150 MB: free what is done with
    normed, centring = yield from layer_norm(
        circuit, first, residual, valid, ("valid", samples), f"{place}/norm1"
    )
    del residual
    # the residual's affine and the intermediate layer each take a level of ``normed``: one
    # refresh serves both
    (flat,) = yield from circuit.ensure([_flat(normed)], 1, f"{place}/fc1")
    normed = _shape(flat, len(normed))
    hidden = yield from affine(circuit, first, centring, normed, valid, f"{place}/residual")
    transformed = yield from mlp(circuit, layers, layout, normed, centring, samples, place)
    second = layers.output_norm
    normed, centring = yield from layer_norm(
        circuit, second, add(circuit, hidden, transformed), valid, ("valid", samples),
        f"{place}/norm2",
    )  # fmt: skip
    return (yield from affine(circuit, second, centring, normed, valid, f"{place}/output"))
