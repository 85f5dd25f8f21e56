"""The decoder LLM driven one layer at a time, its attention swapped in (spec 002 §5.3, §7.1).

A party's forward pass must stop at every layer's attention (its queries go to the compute
node; the answer comes back one relay round trip later) and its state between two steps must be
numpy arrays (the runtime keeps ``context.state`` records, nothing else). So a party runs
transformers' own modules of the model (embedding, each decoder layer, final norm, head; no
forked model code) and swaps the attention in through ``AttentionInterface``
(:func:`fedfm.models.decoder.register_attention`, name :data:`ATTENTION`). One layer takes two
calls:

* :meth:`DecoderRunner.qkv`: the layer up to its attention, which records the post-RoPE
  queries, keys and values and stops the layer (:class:`_Captured`);
* :meth:`DecoderRunner.finish`: the whole layer again (the projections are recomputed: a few
  small matmuls, instead of forking the layer's code), its attention answered by the caller's
  function (local attention merged with the unscrambled remote parts).

Without a hook the registered function is eager attention, so the model stays usable as an
ordinary transformers model; the plaintext reference switches the model to transformers' own
``eager`` (:func:`eager_model`).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedfm.errors import ConfigError, InvariantError, ModelError

ATTENTION = "fedrag"
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_HOOK: ContextVar[Callable[..., torch.Tensor] | None] = ContextVar("fedrag_hook", default=None)
_REGISTERED = threading.Lock()
_registered = False


class _Captured(Exception):
    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__("captured")
        self.q, self.k, self.v = q, k, v


def _eager(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Any,
    scaling: float,
) -> torch.Tensor:
    """transformers' eager attention (repeat_kv, additive mask, float32 softmax)."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if mask is not None:
        weights = weights + mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    hook = _HOOK.get()
    if hook is None:
        return _eager(module, query, key, value, attention_mask, scale), None
    return hook(query, key, value, scale), None


def register() -> None:
    """Register :data:`ATTENTION` with transformers (once per process)."""
    global _registered
    with _REGISTERED:
        if not _registered:
            from fedfm.models.decoder import register_attention

            register_attention(ATTENTION, _attention)
            _registered = True


@contextlib.contextmanager
def eager_model(model: Any) -> Iterator[Any]:
    """``model`` with transformers' own eager attention for the duration (the reference)."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        yield model
    finally:
        model.config._attn_implementation = previous


def model_fingerprint(model: Any) -> bytes:
    """SHA-256 of the model's architecture and weights (16 bytes): parties compare it."""
    digest = hashlib.sha256()
    config = model.config.to_dict()
    for key in sorted(config):
        if key.startswith("_") or key in ("transformers_version", "architectures"):
            continue
        digest.update(f"{key}={config[key]!r};".encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.digest()[:16]


@dataclass(frozen=True)
class Geometry:
    """What the protocol needs to know of a decoder's attention."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    context: int

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def capture_qkv(run: Callable[[], Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run ``run`` (one layer's forward) up to its attention; its ``q, k, v`` (batch 0)."""

    def capture(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _: float) -> torch.Tensor:
        raise _Captured(q[0], k[0], v[0])

    token = _HOOK.set(capture)
    try:
        with torch.no_grad():
            run()
    except _Captured as captured:
        return captured.q.numpy().copy(), captured.k.numpy().copy(), captured.v.numpy().copy()
    finally:
        _HOOK.reset(token)
    raise InvariantError("the layer never called its attention")


def with_attention(run: Callable[[], torch.Tensor], attend: Attend) -> torch.Tensor:
    """Run ``run`` (one layer's forward) with its attention answered by ``attend``."""

    def answer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _: float) -> torch.Tensor:
        out = attend(q[0], k[0], v[0]).to(q.dtype)
        return out.unsqueeze(0).transpose(1, 2).contiguous()

    token = _HOOK.set(answer)
    try:
        with torch.no_grad():
            return run()
    finally:
        _HOOK.reset(token)


class DecoderRunner:
    """A causal LM (Llama-style: ``model.model.layers``, ``rotary_emb``, ``norm``;
    ``model.lm_head``) run one layer at a time; see the module docstring."""

    def __init__(self, model: Any) -> None:
        register()
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
            raise ModelError(
                f"{type(model).__name__} is not a Llama-style causal LM (model.layers, "
                "model.rotary_emb): FedRAG drives its decoder layer by layer"
            )
        self.model, self.inner = model, inner
        model.config._attn_implementation = ATTENTION
        config = model.config
        head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.geometry = Geometry(
            layers=int(config.num_hidden_layers),
            heads=int(config.num_attention_heads),
            kv_heads=int(
                getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            ),
            head_dim=head_dim,
            hidden=int(config.hidden_size),
            vocab=int(config.vocab_size),
            context=int(config.max_position_embeddings),
        )
        self.scaling = float(inner.layers[0].self_attn.scaling)
        self.fingerprint = model_fingerprint(model)
        self.tokenizer: Any = None  # set by runner_for

    def _positions(self, hidden: torch.Tensor, positions: np.ndarray) -> Any:
        ids = torch.as_tensor(np.asarray(positions, dtype=np.int64)).unsqueeze(0)
        if ids.numel() and int(ids.max()) >= self.geometry.context:
            raise ConfigError(
                f"position {int(ids.max())} is past the model's context of {self.geometry.context} "
                "tokens: shorten the documents or the query, or generate fewer tokens"
            )
        return self.inner.rotary_emb(hidden, ids)

    @torch.no_grad()
    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids ``(n,)`` -> hidden states ``(n, hidden)``."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.geometry.vocab):
            raise ConfigError(f"token ids must lie in [0, {self.geometry.vocab})")
        tensor = self.inner.embed_tokens(torch.as_tensor(ids).unsqueeze(0))
        return tensor[0].numpy().copy()

    def _run_layer(self, layer: int, hidden: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        states = torch.as_tensor(hidden).unsqueeze(0)
        return self.inner.layers[layer](
            states,
            attention_mask=None,
            position_embeddings=self._positions(states, positions),
        )

    @torch.no_grad()
    def qkv(
        self, layer: int, hidden: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The layer's post-RoPE ``q (heads, n, d)``, ``k``, ``v (kv_heads, n, d)``."""
        return capture_qkv(lambda: self._run_layer(layer, hidden, positions))

    @torch.no_grad()
    def finish(
        self, layer: int, hidden: np.ndarray, positions: np.ndarray, attend: Attend
    ) -> np.ndarray:
        """The layer's output ``(n, hidden)`` with its attention given by ``attend(q, k, v)``
        (``(heads, n, d)`` in, ``(heads, n, d)`` out)."""
        output = with_attention(lambda: self._run_layer(layer, hidden, positions), attend)
        return output[0].numpy().copy()

    @torch.no_grad()
    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Final norm and head: ``(n, hidden)`` -> ``(n, vocab)``."""
        states = self.inner.norm(torch.as_tensor(hidden).unsqueeze(0))
        return self.model.lm_head(states)[0].numpy().copy()


_RUNNERS: dict[Any, tuple[DecoderRunner, Any]] = {}
_RUNNERS_LOCK = threading.Lock()


def runner_for(source: Any) -> tuple[DecoderRunner, Any]:
    """The (cached, per process) runner and tokenizer of a decoder source: an embedded variant
    name, a :class:`fedfm.models.decoder.DecoderSource`, a folder or hub name (all public: the
    weights are the model owner's published artefact, the same for every party)."""
    key = source if isinstance(source, str) else repr(source)
    with _RUNNERS_LOCK:
        if key not in _RUNNERS:
            from fedfm.models.decoder import load_decoder

            register()
            model, tokenizer = load_decoder(source, attn_implementation=ATTENTION, progress=False)
            runner = DecoderRunner(model)
            runner.tokenizer = tokenizer
            _RUNNERS[key] = (runner, tokenizer)
        return _RUNNERS[key]
