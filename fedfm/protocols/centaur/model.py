"""CENTAUR's models: weights read from transformers modules, a layer loop in numpy, and Θ'.

Two architectures, read from any Hugging Face module of the family (no model code is forked:
only weights are read):

``bert``
    A BERT encoder with BERT's sequence-classification adaptation layer (pooler ``tanh(W_P h_0 +
    B_P)`` on the first token, then ``W_C``; seed App. A, Algorithm 5): the packaged MiniLM with a
    classification head, or any ``BertForSequenceClassification``.
``llama``
    A Llama decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention; seed App. E, Eq. 6-7): the
    shared decoder fedfm trains (:mod:`fedfm.models.decoder`) or any ``LlamaForCausalLM``.

Weights are stored ``(in, out)`` so a linear layer is ``y = x @ w + b``. A permutation is an
index array ``p``: ``X π`` is ``X[..., p]``.

**Θ'** (seed §4.1, "Initialization", and App. B.1): the developer draws ``π`` (hidden, ``d x d``)
and ``π_2`` (feed-forward, ``k x k``) from the OS CSPRNG and permutes every weight so that the
cloud can run each layer on permuted inputs: a weight reading the hidden state gets its rows
permuted by ``π``; one writing it (attention output, FFN down, embeddings) its columns; the FFN
in/out weights are permuted by ``π_2`` on the intermediate side; LayerNorm/RMSNorm gains and
biases by ``π``. Q, K and V keep their output order (the attention runs unpermuted, under
secret sharing; Eq. 3-4). :func:`permute_weights` makes Θ'; :func:`forward` on Θ' with permuted
inputs gives the permuted hidden states (a test checks the equivariance).
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.special import erf

from fedfm.errors import ConfigError, ModelError

KINDS = ("bert", "llama")
Weights = dict[str, np.ndarray]
MASKED = -1e4  # the additive attention mask: exp(-1e4) is 0 in float64 and in fixed point


@dataclass(frozen=True)
class Architecture:
    """The public shape of a model: what every party may know."""

    kind: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    eps: float
    classes: int = 0  # bert: classifier outputs
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"CENTAUR runs {KINDS} models, not {self.kind!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(f"inconsistent heads in {self}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def outputs(self) -> int:
        """Logits per inference: classes (bert) or the vocabulary (llama, last position)."""
        return self.classes if self.kind == "bert" else self.vocab

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Architecture:
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"not a CENTAUR architecture: {text!r} ({error})") from None


# -- reading a transformers module ----------------------------------------------------------------


def _array(tensor: Any) -> np.ndarray:
    return tensor.detach().to("cpu").double().numpy().copy()


def _linear(weights: Weights, name: str, module: Any) -> None:
    weights[f"{name}.w"] = _array(module.weight).T.copy()
    if getattr(module, "bias", None) is not None:
        weights[f"{name}.b"] = _array(module.bias)


def extract(model: Any) -> tuple[Architecture, Weights]:
    """The architecture and float64 weights of a BERT classifier or a Llama causal LM."""
    config = model.config
    model_type = getattr(config, "model_type", "")
    if model_type == "bert":
        return _extract_bert(model)
    if model_type == "llama":
        return _extract_llama(model)
    raise ModelError(f"CENTAUR reads BERT classifiers and Llama decoders, not {model_type!r}")


def _extract_bert(model: Any) -> tuple[Architecture, Weights]:
    config = model.config
    bert = getattr(model, "bert", None)
    classifier = getattr(model, "classifier", None)
    if bert is None or classifier is None or bert.pooler is None:
        raise ModelError("a BERT model needs its pooler and a classifier (a sequence classifier)")
    if getattr(config, "hidden_act", "gelu") != "gelu":
        raise ModelError(f"BERT activation {config.hidden_act!r}: CENTAUR runs exact GeLU")
    weights: Weights = {
        "embed.word": _array(bert.embeddings.word_embeddings.weight),
        "embed.position": _array(bert.embeddings.position_embeddings.weight),
        "embed.type": _array(bert.embeddings.token_type_embeddings.weight)[0],
        "embed.ln.g": _array(bert.embeddings.LayerNorm.weight),
        "embed.ln.b": _array(bert.embeddings.LayerNorm.bias),
    }
    for index, layer in enumerate(bert.encoder.layer):
        prefix = f"l{index}"
        attention = layer.attention
        _linear(weights, f"{prefix}.q", attention.self.query)
        _linear(weights, f"{prefix}.k", attention.self.key)
        _linear(weights, f"{prefix}.v", attention.self.value)
        _linear(weights, f"{prefix}.o", attention.output.dense)
        weights[f"{prefix}.ln1.g"] = _array(attention.output.LayerNorm.weight)
        weights[f"{prefix}.ln1.b"] = _array(attention.output.LayerNorm.bias)
        _linear(weights, f"{prefix}.up", layer.intermediate.dense)
        _linear(weights, f"{prefix}.down", layer.output.dense)
        weights[f"{prefix}.ln2.g"] = _array(layer.output.LayerNorm.weight)
        weights[f"{prefix}.ln2.b"] = _array(layer.output.LayerNorm.bias)
    _linear(weights, "pool", bert.pooler.dense)
    _linear(weights, "cls", classifier)
    architecture = Architecture(
        kind="bert",
        vocab=config.vocab_size,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=config.num_attention_heads,
        kv_heads=config.num_attention_heads,
        intermediate=config.intermediate_size,
        max_positions=config.max_position_embeddings,
        eps=float(config.layer_norm_eps),
        classes=int(weights["cls.w"].shape[1]),
    )
    return architecture, weights


def _extract_llama(model: Any) -> tuple[Architecture, Weights]:
    config = model.config
    rope = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    if rope.get("rope_type", "default") != "default":
        raise ModelError(f"CENTAUR's RoPE is the plain Llama one, not {rope.get('rope_type')!r}")
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelError(f"Llama activation {config.hidden_act!r}: CENTAUR runs SwiGLU")
    inner = model.model
    weights: Weights = {"embed.word": _array(inner.embed_tokens.weight)}
    for index, layer in enumerate(inner.layers):
        prefix = f"l{index}"
        weights[f"{prefix}.norm1.g"] = _array(layer.input_layernorm.weight)
        for name in ("q", "k", "v", "o"):
            _linear(weights, f"{prefix}.{name}", getattr(layer.self_attn, f"{name}_proj"))
        weights[f"{prefix}.norm2.g"] = _array(layer.post_attention_layernorm.weight)
        for name in ("gate", "up", "down"):
            _linear(weights, f"{prefix}.{name}", getattr(layer.mlp, f"{name}_proj"))
    weights["norm.g"] = _array(inner.norm.weight)
    weights["head.w"] = _array(model.lm_head.weight).T.copy()
    heads = config.num_attention_heads
    architecture = Architecture(
        kind="llama",
        vocab=config.vocab_size,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate=config.intermediate_size,
        max_positions=config.max_position_embeddings,
        eps=float(config.rms_norm_eps),
        rope_theta=theta,
    )
    if getattr(config, "head_dim", None) not in (None, architecture.head_dim):
        raise ModelError("CENTAUR expects head_dim = hidden / heads")
    return architecture, weights


# -- the non-linear functions (what the cloud computes on permuted plaintext) -------------------


def softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def gelu(x: np.ndarray) -> np.ndarray:
    """BERT's exact GeLU, ``x Φ(x)``."""
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + eps) * gain + bias


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * gain


def rope_tables(architecture: Architecture, length: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin`` of shape ``(length, head_dim)`` as Llama's rotary embedding builds them."""
    dim = architecture.head_dim
    inverse = 1.0 / architecture.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.outer(np.arange(length, dtype=np.float64), inverse)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def causal_mask(length: int) -> np.ndarray:
    """``0`` where a query may attend, :data:`MASKED` above the diagonal."""
    return np.triu(np.full((length, length), MASKED), k=1)


@dataclass(frozen=True)
class Nonlinear:
    """The non-linear functions a forward pass uses (exact by default; Table 2 swaps in
    MPCFormer's quadratics)."""

    softmax: Callable[[np.ndarray], np.ndarray] = softmax
    gelu: Callable[[np.ndarray], np.ndarray] = gelu


EXACT = Nonlinear()


# -- the plaintext layer loop ---------------------------------------------------------------------


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """``(n, heads * d_h) -> (heads, n, d_h)``."""
    n = x.shape[0]
    return x.reshape(n, heads, -1).transpose(1, 0, 2)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """``(heads, n, d_h) -> (n, heads * d_h)``."""
    return x.transpose(1, 0, 2).reshape(x.shape[1], -1)


@dataclass
class Trace:
    """Intermediate values of a forward pass, by name (the attacks' and tests' view)."""

    values: dict[str, np.ndarray] = field(default_factory=dict)

    def __call__(self, name: str, value: np.ndarray) -> None:
        self.values[name] = value


def _attention(
    architecture: Architecture,
    weights: Mapping[str, np.ndarray],
    prefix: str,
    x: np.ndarray,
    functions: Nonlinear,
    trace: Callable[[str, np.ndarray], None],
) -> np.ndarray:
    a = architecture
    n = x.shape[0]

    def project(name: str) -> np.ndarray:
        out = x @ weights[f"{prefix}.{name}.w"]
        return out + weights[f"{prefix}.{name}.b"] if f"{prefix}.{name}.b" in weights else out

    q = split_heads(project("q"), a.heads)
    k = split_heads(project("k"), a.kv_heads)
    v = split_heads(project("v"), a.kv_heads)
    if a.kind == "llama":
        cos, sin = rope_tables(a, n)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    groups = a.heads // a.kv_heads
    k, v = np.repeat(k, groups, axis=0), np.repeat(v, groups, axis=0)
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(a.head_dim)
    if a.kind == "llama":
        scores = scores + causal_mask(n)
    trace(f"{prefix}.scores", scores)  # O_1
    probabilities = functions.softmax(scores)  # O_2
    context = merge_heads(probabilities @ v)  # O_3
    out = context @ weights[f"{prefix}.o.w"]
    if f"{prefix}.o.b" in weights:
        out = out + weights[f"{prefix}.o.b"]
    trace(f"{prefix}.attention", out)  # O_4
    return out


def forward(
    architecture: Architecture,
    weights: Mapping[str, np.ndarray],
    ids: np.ndarray,
    *,
    functions: Nonlinear = EXACT,
    trace: Callable[[str, np.ndarray], None] | None = None,
) -> np.ndarray:
    """Logits of one sequence ``ids``: classes (bert) or every position's next token (llama)."""
    a = architecture
    record = trace or (lambda _name, _value: None)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = ids.shape[0]
    if n > a.max_positions:
        raise ConfigError(f"{n} tokens exceed the model's {a.max_positions} positions")
    h = weights["embed.word"][ids]
    if a.kind == "bert":
        h = h + weights["embed.position"][:n] + weights["embed.type"]
        record("embed.input", h)  # X_M: the embedding LayerNorm's input
        h = layer_norm(h, weights["embed.ln.g"], weights["embed.ln.b"], a.eps)
    else:
        record("embed.input", h)
    for layer in range(a.layers):
        p = f"l{layer}"
        if a.kind == "bert":
            attention = _attention(a, weights, p, h, functions, record)
            record(f"{p}.ln1.input", attention + h)
            h = layer_norm(attention + h, weights[f"{p}.ln1.g"], weights[f"{p}.ln1.b"], a.eps)
            up = h @ weights[f"{p}.up.w"] + weights[f"{p}.up.b"]
            record(f"{p}.up", up)  # O_5
            down = functions.gelu(up) @ weights[f"{p}.down.w"] + weights[f"{p}.down.b"]
            record(f"{p}.down", down)  # O_6
            record(f"{p}.ln2.input", down + h)
            h = layer_norm(down + h, weights[f"{p}.ln2.g"], weights[f"{p}.ln2.b"], a.eps)
        else:
            record(f"{p}.norm1.input", h)
            x = rms_norm(h, weights[f"{p}.norm1.g"], a.eps)
            h = h + _attention(a, weights, p, x, functions, record)
            record(f"{p}.norm2.input", h)
            x = rms_norm(h, weights[f"{p}.norm2.g"], a.eps)
            gate, up = x @ weights[f"{p}.gate.w"], x @ weights[f"{p}.up.w"]
            record(f"{p}.up", gate)
            down = (silu(gate) * up) @ weights[f"{p}.down.w"]
            record(f"{p}.down", down)
            h = h + down
    if a.kind == "bert":
        pooled = np.tanh(h[:1] @ weights["pool.w"] + weights["pool.b"])
        return (pooled @ weights["cls.w"] + weights["cls.b"])[0]
    record("norm.input", h)
    return rms_norm(h, weights["norm.g"], a.eps) @ weights["head.w"]


# -- permutations and Θ' ------------------------------------------------------------------------


def random_permutation(size: int) -> np.ndarray:
    """A uniformly random permutation from a generator keyed by the OS CSPRNG (a secret)."""
    return np.random.default_rng(secrets.randbits(256)).permutation(size)


@dataclass(frozen=True)
class Permutations:
    """The developer's secret permutations: ``hidden`` (π) and one ``ffn`` (π_2) per layer
    (the seed's single π_2 repeated, or fresh ones)."""

    hidden: np.ndarray
    ffn: tuple[np.ndarray, ...]

    @classmethod
    def draw(cls, architecture: Architecture, *, fresh_ffn: bool) -> Permutations:
        if fresh_ffn:
            ffn = tuple(
                random_permutation(architecture.intermediate) for _ in range(architecture.layers)
            )
        else:
            one = random_permutation(architecture.intermediate)
            ffn = tuple(one for _ in range(architecture.layers))
        return cls(random_permutation(architecture.hidden), ffn)


def permute_weights(
    architecture: Architecture, weights: Mapping[str, np.ndarray], perms: Permutations
) -> Weights:
    """Θ': the weights as the cloud holds them (module docstring)."""
    p = perms.hidden
    out: Weights = {}
    for name, value in weights.items():
        parts = name.split(".")
        if name.startswith("embed."):
            out[name] = value[..., p]  # embeddings and the embedding LayerNorm write h
        elif parts[0] in ("norm",) or parts[-2] in ("ln1", "ln2", "norm1", "norm2"):
            out[name] = value[p]
        elif parts[0].startswith("l") and parts[0][1:].isdigit():
            layer, kind = int(parts[0][1:]), parts[1]
            q = perms.ffn[layer]
            rows, cols = {
                "q": (p, None),
                "k": (p, None),
                "v": (p, None),
                "o": (None, p),
                "up": (p, q),
                "gate": (p, q),
                "down": (q, p),
            }[kind]
            out[name] = _permute_linear(value, parts[-1], rows, cols)
        elif parts[0] == "pool":
            out[name] = _permute_linear(value, parts[-1], p, p)
        elif parts[0] in ("cls", "head"):
            out[name] = _permute_linear(value, parts[-1], p, None)
        else:
            raise ModelError(f"no permutation rule for weight {name!r}")
    return out


def _permute_linear(
    value: np.ndarray, part: str, rows: np.ndarray | None, cols: np.ndarray | None
) -> np.ndarray:
    if part == "b":
        return value if cols is None else value[cols]
    if rows is not None:
        value = value[rows]
    return value if cols is None else value[:, cols]


def fingerprint(weights: Mapping[str, np.ndarray]) -> str:
    """SHA-256 (16 hex digits) of the weights' names, shapes and bytes."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        value = np.ascontiguousarray(weights[name], dtype=np.float64)
        digest.update(name.encode() + str(value.shape).encode() + value.tobytes())
    return digest.hexdigest()[:16]
