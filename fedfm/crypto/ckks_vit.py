"""The FHE-friendly ViT on packed CKKS ciphertexts: embedding, blocks, permutations, the loss.

A *tensor* here is ``list[list[ciphertext]]``, indexed ``[feature][ciphertext]``, in the slot
layout of :mod:`fedfm.crypto.packing`. Every function mirrors the plaintext module it replaces
(:class:`~fedfm.models.fhe_vit.FheViT`, :class:`~fedfm.approx.ApproxLayerNorm`,
:class:`~fedfm.approx.ApproxSoftmax`, :class:`~fedfm.approx.ApproxGELU`): the polynomials are the
model's own specs, traced through :mod:`fedfm.approx.evaluate`; the constants that the plaintext
model applies after a division (LayerNorm's weight, bias and ``1/sqrt(bound)``, softmax's
``1/bound``) are folded into the next linear layer, which costs no level.

Slots that hold no real token (token copies after attention, empty groups) are kept bounded by
plaintext masks inside existing products, so no polynomial diverges there: the centred inputs of a
LayerNorm are zero outside its mask, attention logits are zero outside real tokens and the
softmax normaliser is 1 there. Token copies are rebuilt (:func:`restore_copies`) before a block
whose input came out of another block.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn

from fedfm.approx.evaluate import evaluate_inv_sqrt, evaluate_inverse, polyval
from fedfm.approx.modules import ApproxGELU, ApproxLayerNorm, ApproxSoftmax
from fedfm.approx.specs import PolySpec
from fedfm.crypto.backend import Work, lockstep
from fedfm.crypto.benes import SwapLayer, benes_layers, drop_identity_layers, pad_permutation
from fedfm.crypto.circuit import Ciphertext, Circuit, ProductSum, evaluate_traced, symbol
from fedfm.crypto.packing import SlotLayout
from fedfm.errors import InvariantError, ModelError, ProtocolError

if TYPE_CHECKING:  # annotations only: timm stays out of a data owner's ClientApp process
    from fedfm.models.fhe_vit import FheAttention, FheViT

Tensor = list[list[Ciphertext]]
_Spec = TypeVar("_Spec")


def _polynomial(spec: _Spec | None, what: str) -> _Spec:
    """``spec``, or :class:`ModelError` when ``what`` is exact (CKKS evaluates polynomials only)."""
    if spec is None:
        raise ModelError(f"CKKS evaluates polynomials only: {what} is exact, not approximated")
    return spec


def _array(parameter: torch.Tensor | None, size: int) -> np.ndarray:
    if parameter is None:
        return np.zeros(size)
    return parameter.detach().double().numpy().copy()


# The softmax's exponential runs on logits / SOFTMAX_INPUT_SCALE with its output divided by
# SOFTMAX_OUTPUT_SCALE (coefficients c_k s^k / o: the same polynomial, no extra level): the
# distilled student's logits reach 17, where x^6 is 2^24.5 and the numerators 2^15.5, beyond a
# masked refresh's calibrated bound (2^REFRESH_VALUE_BITS); scaled, every power, term and sum stays
# below 2^13 on all digits (docs/ckks.md, "Masked refreshes"). The softmax is invariant to the
# numerators' scale; the normaliser's bound and the projection's 1/bound carry the factor.
SOFTMAX_INPUT_SCALE = 4.0
SOFTMAX_OUTPUT_SCALE = 16.0


def _scaled_exp(spec: PolySpec) -> PolySpec:
    """``p(s y) / o`` as a polynomial in ``y = x / s``: what the circuit evaluates for ``p(x)``."""
    return replace(
        spec,
        name=f"{spec.name}(x/{SOFTMAX_INPUT_SCALE:g})/{SOFTMAX_OUTPUT_SCALE:g}",
        coefficients=tuple(
            c * SOFTMAX_INPUT_SCALE**k / SOFTMAX_OUTPUT_SCALE
            for k, c in enumerate(spec.coefficients)
        ),
        domain=(spec.domain[0] / SOFTMAX_INPUT_SCALE, spec.domain[1] / SOFTMAX_INPUT_SCALE),
        max_abs_error=spec.max_abs_error / SOFTMAX_OUTPUT_SCALE,
    )


def _bound(module: ApproxLayerNorm | ApproxSoftmax) -> float:
    bound = float(module.input_bound)
    if not math.isfinite(bound) or bound <= 0:
        raise ModelError(f"{type(module).__name__} is not calibrated: no input bound")
    return bound


def check_encryptable(model: FheViT) -> None:
    """Refuse models whose blocks are not entirely polynomial or hold unsupported layers."""
    approx = model.approx
    if None in (approx.exp, approx.inverse, approx.gelu, approx.inv_sqrt):
        raise ModelError(
            "CKKS evaluates polynomials only: every approximation (exp, inverse, gelu, inv_sqrt) "
            f"must be set, got {approx.describe()}"
        )
    for index in range(model.num_blocks):
        block_layers(model, index)


@dataclass(frozen=True)
class VitBlockLayers:
    """One ViT block's layers by role, checked to be what the circuit evaluates."""

    attention: FheAttention
    attention_norm: ApproxLayerNorm
    mlp_norm: ApproxLayerNorm
    fc1: nn.Linear
    gelu: PolySpec
    fc2: nn.Linear


def block_layers(model: FheViT, index: int) -> VitBlockLayers:
    """Block ``index`` of ``model`` by role; :class:`ModelError` for a part CKKS cannot evaluate
    (layer scale, q/k norms, an exact non-linearity, another block structure)."""
    parts = model.block_modules(index)
    where = f"block {index}"
    if not all(isinstance(m, nn.Identity) for m in parts.unsupported):
        raise ModelError(f"{where}: layer scale and q/k norms are not supported")
    attention_norm, mlp_norm = parts.attention_norm, parts.mlp_norm
    if not (isinstance(attention_norm, ApproxLayerNorm) and isinstance(mlp_norm, ApproxLayerNorm)):
        raise ModelError(f"{where}: the LayerNorms are not the approximated LayerNorm")
    activation = parts.activation
    if not isinstance(activation, ApproxGELU):
        raise ModelError(f"{where}: the MLP activation is not the approximated GELU")
    fc1, fc2 = parts.fc1, parts.fc2
    if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)):
        raise ModelError(f"{where}: the MLP's layers are not linear layers")
    return VitBlockLayers(
        attention=parts.attention,
        attention_norm=attention_norm,
        mlp_norm=mlp_norm,
        fc1=fc1,
        gelu=_polynomial(activation.spec, f"{where}'s GELU"),
        fc2=fc2,
    )


@dataclass(frozen=True)
class Linear:
    """``y = x W^T + b`` as plain arrays (after folding)."""

    weight: np.ndarray  # (out, in)
    bias: np.ndarray  # (out,)

    @classmethod
    def of(cls, module: nn.Linear) -> Linear:
        return cls(_array(module.weight, 0), _array(module.bias, module.out_features))

    def after_norm(self, norm: ApproxLayerNorm, centring: float) -> Linear:
        """Fold ``weight * c / (centring * sqrt(bound)) + bias`` of the LayerNorm into this layer.

        The encrypted LayerNorm outputs ``c * centring * y`` where the plaintext one outputs
        ``c * y / sqrt(bound) * weight + bias``.
        """
        gamma = _array(norm.weight, norm.dim) / (centring * math.sqrt(_bound(norm)))
        beta = _array(norm.bias, norm.dim)
        return Linear(self.weight * gamma[None, :], self.bias + self.weight @ beta)

    def rows(self, start: int, stop: int) -> Linear:
        return Linear(self.weight[start:stop], self.bias[start:stop])

    def times(self, factor: float) -> Linear:
        """The layer followed by a scaling of its output: ``(x W^T + b) * factor``."""
        return Linear(self.weight * factor, self.bias * factor)

    def on_scaled_input(self, factor: float) -> Linear:
        """The layer applied to ``x * factor``: ``(x * factor) W^T + b``."""
        return Linear(self.weight * factor, self.bias)


def linear(circuit: Circuit, layer: Linear, x: Tensor) -> Tensor:
    """Each output feature as a weighted sum of the input features (one level, no rotation)."""
    if len(x) != layer.weight.shape[1]:
        raise ProtocolError(f"linear layer expects {layer.weight.shape[1]} features, got {len(x)}")
    per_ciphertext = [
        circuit.linear([feature[c] for feature in x], layer.weight, layer.bias)
        for c in range(len(x[0]))
    ]
    return [list(outputs) for outputs in zip(*per_ciphertext, strict=True)]


def folded_linear(circuit: Circuit, layout: SlotLayout, layer: Linear, x: Tensor) -> Tensor:
    """``layer`` on ``x`` with two output features per ciphertext: feature ``o`` in the lower
    half of the groups, feature ``pairs + o`` in the upper half (``pairs = ceil(out / 2)``).

    ``x`` must be zero outside the lower half (a LayerNorm's output is, by its mask): then ``x``
    plus its copies moved to the upper half (one rotation per input feature) are the inputs of
    one scalar-weight layer with ``pairs`` outputs; the biases of both halves are one vector.
    Half the ciphertexts for everything up to :func:`unfolded_linear` (at half the batch
    capacity and below, e.g. 64 samples at N = 8192).
    """
    shift = layout.half_shift
    moved = [[circuit.rotate(ct, -shift) for ct in feature] for feature in x]
    out, width = layer.weight.shape
    pairs = -(-out // 2)
    weight = np.zeros((pairs, 2 * width))
    weight[:, :width] = layer.weight[:pairs]
    weight[: out - pairs, width:] = layer.weight[pairs:]
    summed = linear(circuit, Linear(weight, np.zeros(pairs)), x + moved)
    bias = np.zeros((pairs, layout.slots))
    bias[:, :shift] = layer.bias[:pairs, None]
    bias[: out - pairs, shift : 2 * shift] = layer.bias[pairs:, None]
    # encoded afresh each time (no cache key): one plaintext per output feature and block would
    # otherwise stay in memory for the evaluator's lifetime (a megabyte each at N = 16384)
    return [
        [circuit.add_vector(ct, None, bias[o]) for ct in feature]
        for o, feature in enumerate(summed)
    ]


def unfolded_linear(circuit: Circuit, layout: SlotLayout, layer: Linear, x: Tensor) -> Tensor:
    """``layer`` on the folded features of :func:`folded_linear` (``x[o]`` holds features ``o``
    and ``len(x) + o``): one rotation per ciphertext brings the upper halves down, and the
    output (one feature per ciphertext) is right in the lower half; the upper half holds
    bounded cross terms that later masks remove, as they remove other empty slots."""
    moved = [[circuit.rotate(ct, layout.half_shift) for ct in feature] for feature in x]
    out, width = layer.weight.shape
    pairs = len(x)
    weight = np.zeros((out, 2 * pairs))
    weight[:, :pairs] = layer.weight[:, :pairs]
    weight[:, pairs : pairs + width - pairs] = layer.weight[:, pairs:]
    return linear(circuit, Linear(weight, layer.bias), x + moved)


def _flat(tensor: Tensor) -> list[Ciphertext]:
    return [ct for feature in tensor for ct in feature]


def _shape(flat: list[Ciphertext], features: int) -> Tensor:
    width = len(flat) // features
    return [flat[i * width : (i + 1) * width] for i in range(features)]


def add(circuit: Circuit, a: Tensor, b: Tensor) -> Tensor:
    pairs = zip(a, b, strict=True)
    return [[circuit.add(x, y) for x, y in zip(fa, fb, strict=True)] for fa, fb in pairs]


# -- embedding ------------------------------------------------------------------------------------
def embedding_table(model: FheViT) -> tuple[Linear, np.ndarray]:
    """The patch projection as a linear layer and the per-token additive term ``(T, D)``."""
    vit = model.vit
    conv, cls_token, pos_embed = vit.patch_embed.proj, vit.cls_token, vit.pos_embed
    if (
        vit.no_embed_class
        or cls_token is None
        or pos_embed is None
        or not isinstance(vit.norm_pre, nn.Identity)
    ):
        raise ModelError("the CKKS embedding needs a class token with its position embedding")
    weight = conv.weight.detach().double().numpy().reshape(conv.out_channels, -1)
    bias = _array(conv.bias, conv.out_channels)
    position = pos_embed.detach().double().numpy()[0].copy()
    position[0] += cls_token.detach().double().numpy()[0, 0] - bias  # no patch at token 0
    return Linear(weight, bias), position


def embed(
    circuit: Circuit, model: FheViT, layout: SlotLayout, patches: Tensor, samples: int
) -> Tensor:
    """``b_0``: patch projection plus class token and position embedding (one level).

    ``patches`` holds ``C * p * p`` features with token 0 empty (the client encrypts zeros there).
    """
    projection, position = embedding_table(model)
    hidden = linear(circuit, projection, patches)
    per_token = np.broadcast_to(position, (samples, *position.shape))
    slots = layout.pack(np.ascontiguousarray(per_token)) * layout.occupied(samples)[None]
    # cached plaintexts are keyed by value (an object id could be reused by another model)
    key = hashlib.sha256(slots.tobytes()).hexdigest()
    return [
        [circuit.add_vector(ct, ("embed", key, f, c), slots[f, c]) for c, ct in enumerate(feature)]
        for f, feature in enumerate(hidden)
    ]


# -- LayerNorm, attention, MLP --------------------------------------------------------------------
def layer_norm(
    circuit: Circuit,
    norm: ApproxLayerNorm,
    x: Tensor,
    mask: np.ndarray,
    mask_key: tuple[object, ...],
    place: str,
    inv_std_headroom: int | None = None,
) -> Work[tuple[Tensor, float]]:
    """The LayerNorm's output *before* its weight and bias, and the factor to fold with them.

    ``c_i = a (x_i - mean)`` with ``a = 1/sqrt(D * bound)`` (zero outside ``mask``), so that
    ``u = sum_i c_i**2 + eps/bound`` is the scaled variance; ``y = 1/sqrt(u)`` by the model's
    Newton spec; the output ``c_i * y`` equals ``centred * inv_std * a * sqrt(bound)``.

    ``inv_std_headroom`` is the headroom the refresh schedule of ``y`` plans to leave it: by
    default that of the centred values, so that ``y`` does not lower the output's level; a
    caller whose next layer refreshes its input anyway asks for less (fewer round trips here).
    """
    dim = len(x)
    bound = _bound(norm)
    centring = 1.0 / math.sqrt(dim * bound)
    (x,) = yield from circuit.ensure([_flat(x)], 1, place)
    x = _shape(x, dim)
    count = len(x[0])
    totals = []
    for c in range(count):
        total = x[0][c]
        for feature in x[1:]:
            total = circuit.add(total, feature[c])
        totals.append(total)
    centred = [
        [
            circuit.masked_sum(
                [
                    (x[i][c], ("ln", centring, *mask_key, c), mask[c] * centring),
                    (totals[c], ("ln", -centring / dim, *mask_key, c), mask[c] * -centring / dim),
                ]
            )
            for c in range(count)
        ]
        for i in range(dim)
    ]
    (flat,) = yield from circuit.ensure([_flat(centred)], 1, place)
    centred = _shape(flat, dim)
    variance = [
        circuit.add_scalar(
            circuit.product_sum([(centred[i][c], centred[i][c]) for i in range(dim)]),
            norm.eps / bound,
        )
        for c in range(count)
    ]
    u = symbol()
    inv_std = yield from evaluate_traced(
        circuit,
        evaluate_inv_sqrt(_polynomial(norm.spec, "the LayerNorm's inverse square root"), u),
        {u: variance},
        f"{place}/inv_sqrt",
        output_headroom=(
            min(circuit.headroom(ct) for ct in _flat(centred))
            if inv_std_headroom is None
            else inv_std_headroom
        ),
    )
    tensors = yield from circuit.ensure([_flat(centred), inv_std], 1, place)
    centred, inv_std = _shape(tensors[0], dim), tensors[1]
    out = [[circuit.multiply(feature[c], inv_std[c]) for c in range(count)] for feature in centred]
    return out, centring


def _baby_shifts(circuit: Circuit, ct: Ciphertext, layout: SlotLayout) -> list[Ciphertext]:
    """``ct`` rotated left by ``0 .. baby_steps - 1`` slots (one rotation by one slot each)."""
    shifts = [ct]
    for _ in range(1, min(layout.baby_steps, layout.tokens)):
        shifts.append(circuit.rotate(shifts[-1], 1))
    return shifts


def _token_shifts(layout: SlotLayout) -> list[tuple[int, int]]:
    """Token shift ``d`` as ``(a, g)``: baby step ``a`` plus giant step ``g`` (``d = a + g``)."""
    baby = layout.baby_steps
    return [(d % baby, d - d % baby) for d in range(layout.tokens)]


@dataclass(frozen=True)
class KeyMask:
    """Which keys each query may attend to, per token shift, for texts padded on the right.

    ``shifts[d, c]`` is a slot vector of ciphertext ``c``: 1 at query token ``t`` of a sample
    when its key ``(t + d) mod T`` (the token the shift by ``d`` brings there) is a real token,
    0 when it is padding. Attention folds it into the logits' existing valid-token mask and
    removes what the exponential's constant term leaves at masked keys: no level of its own.
    """

    shifts: np.ndarray  # (tokens, ciphertexts, slots)
    digest: str

    @classmethod
    def of(cls, layout: SlotLayout, key_mask: np.ndarray) -> KeyMask:
        """From a boolean ``(samples, tokens)`` mask (``True`` at real tokens)."""
        keys = np.asarray(key_mask, dtype=bool)
        if keys.ndim != 2 or keys.shape[1] != layout.tokens or len(keys) < 1:
            raise ProtocolError(
                f"a key mask must be (samples, {layout.tokens}) booleans, got shape {keys.shape}"
            )
        if not keys.any(axis=1).all():
            raise ProtocolError("every sample needs at least one real token in its key mask")
        # shifted[d][:, t] = keys[:, (t + d) mod T]
        shifted = np.stack([np.roll(keys, -d, axis=1) for d in range(layout.tokens)])
        slots = np.stack([layout.pack(s[:, :, None].astype(np.float64))[0] for s in shifted])
        digest = hashlib.sha256(repr(keys.shape).encode() + np.packbits(keys).tobytes())
        return cls(slots, digest.hexdigest())


def attention(
    circuit: Circuit,
    attn: FheAttention,
    norm: ApproxLayerNorm,
    layout: SlotLayout,
    x: Tensor,
    samples: int,
    place: str,
) -> Work[Tensor]:
    """``attn(norm(x))`` for the token layout with copies (the block's first half)."""
    normed, centring = yield from layer_norm(
        circuit, norm, x, layout.occupied(samples), ("occupied", samples), f"{place}/norm1"
    )
    qkv = Linear.of(attn.qkv).after_norm(norm, centring)
    dim = len(x)
    (flat,) = yield from circuit.ensure([_flat(normed)], 1, f"{place}/qkv")
    normed = _shape(flat, dim)
    projections = AttentionLayers(
        query=qkv.rows(0, dim).times(attn.scale),
        key=qkv.rows(dim, 2 * dim),
        value=qkv.rows(2 * dim, 3 * dim),
        output=Linear.of(attn.proj),
        heads=attn.num_heads,
    )
    return (
        yield from multi_head_attention(
            circuit, attn.softmax, projections, layout, normed, samples, place
        )
    )


@dataclass(frozen=True)
class AttentionLayers:
    """The linear layers of multi-head self-attention (the query's already times its scale)."""

    query: Linear
    key: Linear
    value: Linear
    output: Linear
    heads: int


def multi_head_attention(
    circuit: Circuit,
    softmax: ApproxSoftmax,
    layers: AttentionLayers,
    layout: SlotLayout,
    x: Tensor,
    samples: int,
    place: str,
    keys: KeyMask | None = None,
) -> Work[Tensor]:
    """Self-attention on ``x`` (token copies valid, one level of headroom) up to and including
    the output projection; ``keys`` masks padding keys (all keys take part without it)."""
    dim = len(x)
    head_dim = dim // layers.heads
    q = linear(circuit, layers.query, x)
    k = linear(circuit, layers.key, x)
    v = linear(circuit, layers.value, x)
    tensors = yield from circuit.ensure([_flat(q), _flat(k), _flat(v)], 1, f"{place}/logits")
    q, k, v = (_shape(t, dim) for t in tensors)
    # The heads are independent until the projection: their refresh-free parts (logits, the
    # weighted sum of values) are spread over the worker processes, their refreshes travel
    # together.
    per_head = [
        [t[h * head_dim : (h + 1) * head_dim] for t in (q, k, v)] for h in range(layers.heads)
    ]
    scores = circuit.spread(_head_logits, [(q_h, k_h) for q_h, k_h, _ in per_head], layout=layout)
    try:
        weighted = yield from lockstep(
            [
                _head_weights(
                    circuit, softmax, layout, logits, backwards, v_h, samples, place, keys
                )
                for (logits, backwards), (_, _, v_h) in zip(scores, per_head, strict=True)
            ]
        )
    finally:
        if keys is not None:  # one batch's masks: not worth keeping for the evaluator's lifetime
            digest = keys.digest
            circuit.forget_vectors(lambda k: isinstance(k, tuple) and digest in k[1:2])
    heads_out = circuit.spread(_head_values, weighted, layout=layout)
    out = [feature for head in heads_out for feature in head]
    (flat,) = yield from circuit.ensure([_flat(out)], 1, f"{place}/proj")
    # 1/bound of the softmax (its numerators were divided by SOFTMAX_OUTPUT_SCALE) is folded
    # into the projection.
    unscale = SOFTMAX_OUTPUT_SCALE / _bound(softmax)
    return linear(circuit, layers.output.on_scaled_input(unscale), _shape(flat, dim))


# One attention head in three parts: logits and the weighted sum of values need no refresh (and
# can run in a worker process: Circuit.spread); the softmax between them does.
#
# With groups of 2T - 2 slots (SlotLayout.wraps) the last token's shift by T - 1 lands in the next
# group: that one logit comes from the shift by -1, selected by the valid-token mask the logits
# get anyway (no extra level), and its value vector from the same two shifts of v.


def _head_logits(
    circuit: Circuit, q: Tensor, k: Tensor, *, layout: SlotLayout
) -> list[list[Ciphertext]]:
    """``[logits, backwards]`` of one head: ``logits[c * tokens + d]`` pairs each token ``t`` of
    ciphertext ``c`` with key token ``t + d``; ``backwards[c]`` with key token ``t - 1`` (only
    for wrapping layouts, else empty).

    With ``d = a + g``: ``sum_j q_j rot_d(k_j) = rot_g(sum_j rot_-g(q_j) rot_a(k_j))``, so a
    feature needs only its baby shifts of k and giant shifts of q; each sum is rotated once at
    the end. The shifts of one feature at a time are made and dropped (memory O(tokens)).
    """
    count, tokens = len(q[0]), layout.tokens
    shifts = _token_shifts(layout)
    giants = sorted({giant for _, giant in shifts})
    logits: list[Ciphertext] = []
    backwards: list[Ciphertext] = []
    for c in range(count):
        sums = [ProductSum(circuit) for _ in range(tokens)]
        backward = ProductSum(circuit)
        for j in range(len(q)):
            keys = _baby_shifts(circuit, k[j][c], layout)
            queries = {giant: circuit.rotate(q[j][c], -giant) for giant in giants}
            for (a, giant), total in zip(shifts, sums, strict=True):
                total.add(queries[giant], keys[a])
            if layout.wraps:
                backward.add(q[j][c], circuit.rotate(k[j][c], -1))
        logits += [
            circuit.rotate(total.result(), giant)
            for (_, giant), total in zip(shifts, sums, strict=True)
        ]
        if layout.wraps:
            backwards.append(backward.result())
    return [logits, backwards]


def _head_weights(
    circuit: Circuit,
    softmax: ApproxSoftmax,
    layout: SlotLayout,
    logits: list[Ciphertext],
    backwards: list[Ciphertext],
    v: Tensor,
    samples: int,
    place: str,
    keys: KeyMask | None = None,
) -> Work[list[Any]]:
    """The softmax of one head's logits (times its bound) and the head's values, ready for
    :func:`_head_values`: ``[weights, v, wrapped]`` with ``wrapped`` the values shifted by
    ``T - 1`` for wrapping layouts (else empty). With ``keys``, padding keys get weight zero:
    their logits are zeroed by the valid-token mask's product and the exponential's constant
    term ``p(0)`` is subtracted there (``m p(x) = p(m x) - p(0) (1 - m)`` for 0/1 ``m``)."""
    valid = layout.valid(samples)
    count, tokens = len(v[0]), layout.tokens
    last = layout.last_token(samples) if layout.wraps else None
    logits, backwards = yield from circuit.ensure([logits, backwards], 1, f"{place}/mask")
    masked = []
    shrink = 1.0 / SOFTMAX_INPUT_SCALE  # in the mask's product: no level of its own
    for i, ct in enumerate(logits):
        c, d = divmod(i, tokens)
        keep = valid[c] * shrink
        # without a key mask the mask is the same for every shift (one cached plaintext)
        tag: tuple[object, ...] = (samples, c)
        if keys is not None:
            keep = keep * keys.shifts[d, c]
            tag = (keys.digest, c, d)
        if last is None or d < tokens - 1:
            masked.append(circuit.masked_sum([(ct, ("valid/s", *tag), keep)]))
            continue
        masked.append(
            circuit.masked_sum(
                [
                    (ct, ("valid but last/s", *tag), keep * (1 - last[c])),
                    (backwards[c], ("last/s", *tag), keep * last[c]),
                ]
            )
        )
    a = symbol()
    exp = _scaled_exp(_polynomial(softmax.exp_spec, "the softmax's exp"))
    numerators = yield from evaluate_traced(
        circuit, polyval(exp, a), {a: masked}, f"{place}/exp", output_headroom=1
    )
    if keys is not None:
        constant = exp.coefficients[0]  # p(0): what a zeroed logit leaves
        unkept = valid[:, None, :] * (1 - keys.shifts.transpose(1, 0, 2))  # (c, d, slots)
        numerators = [
            circuit.add_vector(ct, ("unkept", keys.digest, c, d), -constant * unkept[c, d])
            for i, ct in enumerate(numerators)
            for c, d in [divmod(i, tokens)]
        ]
    bound = _bound(softmax) / SOFTMAX_OUTPUT_SCALE  # of the scaled numerators' sum
    scaled = []
    for c in range(count):
        total = numerators[c * tokens]
        for ct in numerators[c * tokens + 1 : (c + 1) * tokens]:
            total = circuit.add(total, ct)
        scaled.append(total)
    (scaled,) = yield from circuit.ensure([scaled], 1, f"{place}/normaliser")
    scaled = [
        circuit.add_vector(
            circuit.masked_sum([(ct, ("inv", samples, c, bound), valid[c] / bound)]),
            ("one", samples, c),
            1.0 - valid[c],
        )
        for c, ct in enumerate(scaled)
    ]
    s, n = symbol(), symbol()
    # The numerators wait for the inverse: planned with it, they may travel in one of its
    # refreshes, so that the weights keep the level their products with the values need.
    inputs = {s: scaled, n: numerators}
    inverse = yield from evaluate_traced(
        circuit,
        evaluate_inverse(_polynomial(softmax.inverse_spec, "the softmax's inverse"), s),
        inputs,
        f"{place}/inverse",
        output_headroom=2,
        keep={n: 2},
    )
    numerators = inputs[n]
    numerators, inverse = yield from circuit.ensure([numerators, inverse], 1, f"{place}/weights")
    # i // tokens = c: each ciphertext's normaliser weights its numerators
    weights = [circuit.multiply(ct, inverse[i // tokens]) for i, ct in enumerate(numerators)]
    # made while v still has the level the logits' refresh gave it
    wrapped: Tensor = []
    if last is not None:
        rest = layout.occupied(samples) - last
        wrapped = [
            [
                circuit.masked_sum(
                    [
                        (
                            circuit.rotate(ct, tokens - 1),
                            ("occupied but last", samples, c),
                            rest[c],
                        ),
                        (circuit.rotate(ct, -1), ("last", samples, c), last[c]),
                    ]
                )
                for c, ct in enumerate(feature)
            ]
            for feature in v
        ]
    weights, flat, wrapped_flat = yield from circuit.ensure(
        [weights, _flat(v), _flat(wrapped)], 1, f"{place}/values"
    )
    return [weights, _shape(flat, len(v)), _shape(wrapped_flat, len(v)) if wrapped_flat else []]


def _head_values(
    circuit: Circuit, weights: list[Ciphertext], v: Tensor, wrapped: Tensor, *, layout: SlotLayout
) -> Tensor:
    """``sum_d w_d rot_d(v_j)`` for each feature ``j`` of one head.

    ``= sum_g rot_g(sum_a rot_-g(w_(a+g)) rot_a(v_j))``: baby shifts of each feature, giant
    shifts of the weights, one rotation per feature and giant step. A wrapping layout's shift
    ``T - 1`` uses ``wrapped`` (already shifted), with the weights unrotated (``a`` is None).
    """
    count, tokens = len(v[0]), layout.tokens
    value_shifts: list[tuple[int | None, int]] = list(_token_shifts(layout))
    if wrapped:
        value_shifts[-1] = (None, 0)
    weights = [circuit.rotate(ct, -value_shifts[i % tokens][1]) for i, ct in enumerate(weights)]
    giants = sorted({giant for _, giant in value_shifts})
    out: Tensor = []
    for j, feature in enumerate(v):
        row = []
        for c in range(count):
            values = _baby_shifts(circuit, feature[c], layout)
            parts = {giant: ProductSum(circuit) for giant in giants}
            for d, (a, giant) in enumerate(value_shifts):
                source = wrapped[j][c] if a is None else values[a]
                parts[giant].add(weights[c * tokens + d], source)
            total = None
            for giant, part in parts.items():
                rotated = circuit.rotate(part.result(), giant)
                total = rotated if total is None else circuit.add(total, rotated)
            row.append(total)
        out.append(row)
    return out


def mlp(
    circuit: Circuit,
    block: VitBlockLayers,
    layout: SlotLayout,
    x: Tensor,
    samples: int,
    place: str,
) -> Work[Tensor]:
    """``mlp(norm2(x))`` (the block's second half)."""
    # inv_std with a single level: fc1's input is then refreshed (one round trip, as many
    # ciphertexts as features) and the GELU needs no refresh; keeping the output's level costs
    # one more inverse-sqrt round trip and one for the GELU (level-only dry runs,
    # fedfm.crypto.schedule)
    normed, centring = yield from layer_norm(
        circuit,
        block.mlp_norm,
        x,
        layout.valid(samples),
        ("valid", samples),
        f"{place}/norm2",
        inv_std_headroom=1,
    )
    (flat,) = yield from circuit.ensure([_flat(normed)], 1, f"{place}/fc1")
    fc1 = Linear.of(block.fc1).after_norm(block.mlp_norm, centring)
    normed = _shape(flat, len(x))
    # A batch in the lower half of the groups carries the hidden layer two features per
    # ciphertext: half the GELU work and half its refreshes, for a rotation per feature.
    folded = layout.folds(samples)
    hidden = folded_linear(circuit, layout, fc1, normed) if folded else linear(circuit, fc1, normed)
    h = symbol()
    activated = yield from evaluate_traced(
        circuit,
        polyval(block.gelu, h),
        {h: _flat(hidden)},
        f"{place}/gelu",
        output_headroom=1,  # for fc2
    )
    (activated,) = yield from circuit.ensure([activated], 1, f"{place}/fc2")
    activated_tensor = _shape(activated, len(hidden))
    fc2 = Linear.of(block.fc2)
    if folded:
        return unfolded_linear(circuit, layout, fc2, activated_tensor)
    return linear(circuit, fc2, activated_tensor)


def block(
    circuit: Circuit,
    model: FheViT,
    index: int,
    layout: SlotLayout,
    x: Tensor,
    samples: int,
) -> Work[Tensor]:
    """Block ``index`` of ``model``; ``x`` must have valid token copies."""
    vit_block = block_layers(model, index)
    place = f"block{index + 1}"
    attended = yield from attention(
        circuit, vit_block.attention, vit_block.attention_norm, layout, x, samples, place
    )
    x = add(circuit, x, attended)
    return add(circuit, x, (yield from mlp(circuit, vit_block, layout, x, samples, place)))


def restore_copies(circuit: Circuit, layout: SlotLayout, x: Tensor, samples: int) -> Work[Tensor]:
    """Rebuild the token copies (and zero everything else) after a block (one level)."""
    (flat,) = yield from circuit.ensure([_flat(x)], 1, "copies")
    x = _shape(flat, len(x))
    valid, copied = layout.valid(samples), layout.copied(samples)
    return [
        [
            circuit.masked_sum(
                [
                    (ct, ("valid", samples, c), valid[c]),
                    (
                        circuit.rotate(ct, -layout.tokens),
                        ("copy", samples, c),
                        np.roll(copied[c], layout.tokens),
                    ),
                ]
            )
            for c, ct in enumerate(feature)
        ]
        for feature in x
    ]


# -- permutations of samples ----------------------------------------------------------------------
def permute(
    circuit: Circuit,
    layout: SlotLayout,
    x: Tensor,
    samples: int,
    permutation: np.ndarray,
) -> Work[Tensor]:
    """Output sample ``i`` = input sample ``permutation[i]`` (a Benes network of masked swaps).

    ``permutation`` has ``len <= samples`` distinct entries below ``samples``: a selection in a
    chosen order. Groups of the output beyond ``len(permutation)`` are zeroed.
    """
    chosen = np.asarray(permutation, dtype=np.int64)
    if chosen.ndim != 1 or chosen.size < 1 or chosen.size > samples:
        raise ProtocolError(f"cannot select {chosen.size} of {samples} samples")
    if (chosen < 0).any() or (chosen >= samples).any() or len(set(chosen.tolist())) != chosen.size:
        raise ProtocolError("a permutation of encrypted samples needs distinct in-range indices")
    capacity = layout.capacity
    size = max(2, 1 << (samples - 1).bit_length())
    unused = np.setdiff1d(np.arange(size), chosen)
    full = pad_permutation(np.concatenate([chosen, unused]), size)
    layers = drop_identity_layers(benes_layers(full))
    count = max(len(x[0]), size // capacity)
    state: list[list[Ciphertext | None]] = [
        list(feature) + [None] * (count - len(feature)) for feature in x
    ]
    maps = [_layer_map(layout, count, layer) for layer in layers]
    token = object()  # this call's encoded masks, shared by all features, dropped at the end
    try:
        for first in range(0, len(maps), PERMUTE_LAYERS_PER_LEVEL):
            merged = maps[first]
            for later in maps[first + 1 : first + PERMUTE_LAYERS_PER_LEVEL]:
                merged = _compose(merged, later)
            live = [ct for feature in state for ct in feature if ct is not None]
            (fresh,) = yield from circuit.ensure([live], 1, "permute")
            iterator = iter(fresh)
            state = [[next(iterator) if ct is not None else None for ct in f] for f in state]
            key = (token, first)
            state = [_apply_map(circuit, feature, merged, key) for feature in state]
    finally:
        circuit.forget_vectors(lambda k: isinstance(k, tuple) and len(k) > 0 and k[0] is token)
    kept = layout.ciphertexts_for(chosen.size)
    out = [feature[:kept] for feature in state]
    stray = full[chosen.size : kept * capacity]
    if (stray < samples).any():  # unselected samples landed in the kept ciphertexts
        (flat,) = yield from circuit.ensure([_flat(out)], 1, "permute")
        out = _shape(flat, len(x))
        occupied = layout.occupied(chosen.size)
        out = [
            [
                circuit.masked_sum([(ct, ("occupied", chosen.size, c), occupied[c])])
                for c, ct in enumerate(feature)
            ]
            for feature in out
        ]
    if any(ct is None for feature in out for ct in feature):
        raise ProtocolError("internal: a permutation left an output ciphertext empty")
    return out


# Benes layers per multiplicative level. A layer is a masked sum (one level); composing the
# masks of consecutive layers in plaintext evaluates two layers as one masked sum of up to nine
# rotated terms instead of two of three: half the refreshes (one per level under ckks-8192) and
# their round trips, for twice the rotations.
PERMUTE_LAYERS_PER_LEVEL = 2

SlotMap = list[dict[tuple[int, int], tuple[np.ndarray, tuple[int, ...]]]]
"""A linear map of a feature's ciphertexts made of rotations and slot masks: per output
ciphertext, ``(input ciphertext, rotation steps) -> (mask, path)`` with ``out[c] = sum
rotate(x[source], steps) * mask``; ``path`` is a sequence of keyed rotations that makes
``steps`` (rotations commute, so any path to the same steps gives the same ciphertext)."""


def _layer_map(layout: SlotLayout, count: int, layer: SwapLayer) -> SlotMap:
    """One Benes stage on ``count`` ciphertexts: pairs ``(p, p + distance)`` swap where
    ``layer.swap[p]``; within a ciphertext by rotations, across ciphertexts by masks alone."""
    distance, swap = layer.distance, layer.swap
    capacity = layout.capacity
    low = np.zeros(count * capacity, dtype=bool)
    low[: swap.size] = swap
    high = np.zeros_like(low)
    high[distance:] = low[:-distance]
    keep_m, low_m, high_m = (layout.group_mask(m, layout.group) for m in (~(low | high), low, high))
    out: SlotMap = []
    if distance < capacity:
        step = distance * layout.group
        for c in range(count):
            terms = {(c, 0): (keep_m[c], ()), (c, step): (low_m[c], (step,))}
            terms[(c, -step)] = (high_m[c], (-step,))
            out.append({k: v for k, v in terms.items() if v[0].any()})
        return out
    offset = distance // capacity
    for c in range(count):
        partner = c + offset if (c // offset) % 2 == 0 else c - offset
        selected = low_m[c] if partner > c else high_m[c]
        terms = {(c, 0): (keep_m[c], ())}
        if partner < count:
            terms[(partner, 0)] = (selected, ())
        out.append({k: v for k, v in terms.items() if v[0].any()})
    return out


def _compose(first: SlotMap, second: SlotMap) -> SlotMap:
    """The map ``second(first(x))``: ``rotate(m * y, q) = rotate(m, q) * rotate(y, q)``, so a
    term ``(y, r, m)`` of ``first`` under a term ``(q, n)`` of ``second`` becomes ``(y, r + q,
    rotate(m, q) * n)``; masks of equal ``(y, r + q)`` add up."""
    out: SlotMap = []
    for terms in second:
        merged: dict[tuple[int, int], tuple[np.ndarray, tuple[int, ...]]] = {}
        for (middle, q), (outer, outer_path) in terms.items():
            for (source, r), (inner, inner_path) in first[middle].items():
                # rotate(ct, q)[i] = ct[i + q]: the mask moves the same way as the values
                mask = np.roll(inner, -q) * outer
                if not mask.any():
                    continue
                key = (source, r + q)
                if key in merged:
                    merged[key] = (merged[key][0] + mask, merged[key][1])
                else:
                    merged[key] = (mask, inner_path + outer_path)
        out.append(merged)
    return out


def _apply_map(
    circuit: Circuit, feature: list[Ciphertext | None], slot_map: SlotMap, key: tuple[object, int]
) -> list[Ciphertext | None]:
    """``slot_map`` on one feature's ciphertexts (one level); each rotation is made once, from
    the longest prefix of its path already made. Masks are encoded once per ``key`` (the same
    for every feature)."""
    rotated: dict[tuple[int, int], Ciphertext] = {}

    def moved(source: int, path: tuple[int, ...]) -> Ciphertext:
        steps = sum(path)
        if (source, steps) not in rotated:
            base = feature[source] if len(path) <= 1 else moved(source, path[:-1])
            if base is None:
                raise InvariantError("a permutation rotated an empty ciphertext")
            rotated[(source, steps)] = circuit.rotate(base, path[-1]) if path else base
        return rotated[(source, steps)]

    out: list[Ciphertext | None] = []
    for c, terms in enumerate(slot_map):
        parts = [
            (moved(source, path), (*key, c, source, steps), mask)
            for (source, steps), (mask, path) in terms.items()
            if feature[source] is not None
        ]
        out.append(circuit.masked_sum(parts) if parts else None)
    return out


# -- loss -----------------------------------------------------------------------------------------
def cross_entropy(
    circuit: Circuit,
    layout: SlotLayout,
    probabilities: Tensor,
    log_probabilities: Tensor,
    labels: Tensor,
    samples: int,
) -> Work[tuple[Tensor, Tensor]]:
    """Mean cross-entropy (slot 0 of a one-sample row) and the logit gradient ``(p - y)/n``."""
    tensors = yield from circuit.ensure(
        [_flat(probabilities), _flat(log_probabilities), _flat(labels)], 1, "loss"
    )
    classes = len(probabilities)
    p, log_p, y = (_shape(t, classes) for t in tensors)
    count = len(p[0])
    per_sample = [
        circuit.product_sum([(y[k][c], log_p[k][c]) for k in range(classes)]) for c in range(count)
    ]
    total = per_sample[0]
    for ct in per_sample[1:]:
        total = circuit.add(total, ct)
    distance = 1
    while distance < layout.capacity:
        total = circuit.add(total, circuit.rotate(total, distance * layout.group))
        distance *= 2
    (total,) = yield from circuit.ensure([[total]], 1, "loss")
    loss = circuit.scale_by(total[0], -1.0 / samples)
    gradient = [
        [
            circuit.weighted_sum([(p[k][c], 1.0 / samples), (y[k][c], -1.0 / samples)])
            for c in range(count)
        ]
        for k in range(classes)
    ]
    return [[loss]], gradient
