"""Hybrid inference on a transformers model, its linear layers evaluated with David (§4.1-4.4).

Charlie runs the model's own forward (no forked model code): every ``torch.nn.Linear`` is
replaced by a :class:`HybridLinear` that asks the current :class:`Session` for its output, and
attention is swapped in through transformers' ``AttentionInterface`` (name :data:`ATTENTION`)
so that Charlie computes every softmax. A session answers a linear layer with

``y = W_C a + unmask(David(mask(a))) + b``

where ``W_C a = (U_k S_k) (V_k^T a)`` is Charlie's factored part (zero for a layer David holds
whole) and David computes ``W_D (a + r)`` in the ring (:mod:`~fedfm.protocols.slip.ring`).
Layers that take the same input tensor (``q, k, v``; ``gate, up``) go to David in one request,
one round trip (:func:`trace_groups`). Attention (Fig. 11):

``single-step``
    ``q, k, v`` in one request; Charlie computes ``softmax(q k^T / sqrt(d)) v``.
``double-step`` (the seed's Fig. 11)
    ``q, k`` in one request (inner masking); Charlie computes ``A_h = softmax(q_h k_h^T /
    sqrt(d))`` and ``A_h X`` per head; then ``W_v`` is applied to ``A_h X`` in a second request
    (outer masking), one item per head. ``A (X W_v^T + b) = (A X) W_v^T + b`` because the rows
    of ``A`` sum to one.

What David receives depends on the composition (:data:`COMPOSITIONS`):

``safe`` (default)
    every request masked with a fresh pad: David sees only uniform ring elements.
``faithful`` (the seed's Fig. 10)
    split layers' inputs masked; every other layer's input in the clear, as Fig. 10 hands
    David the activations between layers. Leaks ``W_C``: see ``fedfm.experiments.slip_attacks``.
``unmasked`` (Fig. 6, the insecure protocol)
    nothing masked: the baseline of what David would see without masks.

Drivers: :meth:`Charlie.run` with a :class:`David` in the same process (benchmarks, tests), or
:meth:`Charlie.resume` for the runtime, where a step cannot block: it replays the forward with
the David answers received so far and stops (:class:`Pause`) at the first request not yet
answered.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.errors import ConfigError, InvariantError, ModelError, ProtocolError
from fedfm.protocols.slip.decomposition import SplitWeight, check_plan, split_weight
from fedfm.protocols.slip.pads import PadStore
from fedfm.protocols.slip.ring import (
    check_headroom,
    decode,
    encode_activations,
    encode_weights,
    ring_matmul,
    row_l1_bound,
)

ATTENTION = "slip"
COMPOSITIONS = ("safe", "faithful", "unmasked")
ATTENTIONS = ("single-step", "double-step")
Request = dict[str, np.ndarray]  # layer key -> (rows, n) uint64
_SESSION: ContextVar[Session | None] = ContextVar("slip_session", default=None)
_REGISTERED = threading.Lock()
_registered = False


# -- layer keys -----------------------------------------------------------------------------------


def head_key(name: str, start: int, stop: int) -> str:
    """The key of rows ``start:stop`` of layer ``name`` (one head of a value projection)."""
    return f"{name}[{start}:{stop}]"


def parse_key(key: str) -> tuple[str, slice | None]:
    """``(layer name, row slice or None)`` of a layer key."""
    if key.endswith("]") and "[" in key:
        name, _, rows = key[:-1].rpartition("[")
        start, _, stop = rows.partition(":")
        if start.isdigit() and stop.isdigit():
            return name, slice(int(start), int(stop))
    return key, None


# -- the parties' shares ---------------------------------------------------------------------------


def linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The model's linear layers by name, in module order."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


@dataclass(frozen=True)
class Decomposition:
    """The model owner's split of a model's linear layers (offline, §3).

    ``splits`` holds the split layers; every other linear layer is David's whole. ``david``
    holds David's encoded weights (``W_D`` or ``W``) for every linear layer.
    """

    splits: dict[str, SplitWeight]
    david: dict[str, np.ndarray]  # name -> (m, n) uint64 at scale 2**WEIGHT_BITS
    total_parameters: int
    linear_parameters: int

    @property
    def charlie_parameters(self) -> int:
        """``|Theta_C|``: the factors ``U_k S_k`` and ``V_k`` of every split layer."""
        return sum(split.charlie_parameters for split in self.splits.values())

    @property
    def density(self) -> float:
        """Definition 4's ``eta = |Theta_C| / |Theta|``."""
        return self.charlie_parameters / self.total_parameters

    def david_share(self) -> David:
        return David(self.david)

    def charlie_share(self) -> CharlieShare:
        return CharlieShare(
            {name: (s.left, s.right) for name, s in self.splits.items()},
            {name: row_l1_bound(weight) for name, weight in self.david.items()},
        )


@dataclass(frozen=True)
class CharlieShare:
    """What Charlie keeps of a decomposition: ``(U_k S_k, V_k)`` per split layer, and the row
    norms of David's weights for Lemma 2's headroom check (public properties of David's file)."""

    factors: dict[str, tuple[np.ndarray, np.ndarray]]
    bounds: dict[str, float]

    def save(self, path: Path) -> None:
        arrays = {}
        for index, (left, right) in enumerate(self.factors.values()):
            arrays[f"left{index}"], arrays[f"right{index}"] = left, right
        arrays["split_names"] = np.frombuffer("\n".join(self.factors).encode(), np.uint8)
        arrays["bound_names"] = np.frombuffer("\n".join(self.bounds).encode(), np.uint8)
        arrays["bounds"] = np.asarray(list(self.bounds.values()), dtype=np.float64)
        np.savez(path, **arrays)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: Path) -> CharlieShare:
        try:
            with np.load(path) as data:
                names = _names(data["split_names"])
                factors = {n: (data[f"left{i}"], data[f"right{i}"]) for i, n in enumerate(names)}
                values = data["bounds"].tolist()
                bounds = dict(zip(_names(data["bound_names"]), values, strict=True))
        except (OSError, KeyError, ValueError) as error:
            raise ConfigError(f"no readable Charlie share at {path}: {error}") from None
        return cls(factors, bounds)


def _names(data: np.ndarray) -> list[str]:
    text = np.asarray(data, dtype=np.uint8).tobytes().decode()
    return text.split("\n") if text else []


def save_david(weights: Mapping[str, np.ndarray], path: Path) -> None:
    """David's file: his encoded weights, provisioned by the owner (never a message)."""
    arrays = {f"w{i}": w for i, w in enumerate(weights.values())}
    arrays["names"] = np.frombuffer("\n".join(weights).encode(), np.uint8)
    np.savez(path, **arrays)  # type: ignore[arg-type]


def load_david(path: Path) -> David:
    """David's party from the file :func:`save_david` wrote."""
    try:
        with np.load(path) as data:
            return David({n: data[f"w{i}"] for i, n in enumerate(_names(data["names"]))})
    except (OSError, KeyError, ValueError) as error:
        raise ConfigError(f"no readable David share at {path}: {error}") from None


def decompose(model: torch.nn.Module, plan: Mapping[str, int]) -> Decomposition:
    """Split the layers of ``plan`` (name -> k) by SVD; every linear layer's weight encoded
    for David. :class:`ConfigError` for a layer the model lacks or ``k`` above its rank."""
    layers = linear_layers(model)
    check_plan(plan, layers)
    splits, david = {}, {}
    for name, module in layers.items():
        weight = module.weight.detach().double().numpy()
        if name in plan:
            splits[name] = split_weight(weight, plan[name], name=name)
            weight = splits[name].david
        david[name] = encode_weights(weight)
    total = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in layers.values())
    return Decomposition(splits, david, total, linear)


class David:
    """The untrusted party: David's encoded weights; answers requests in the ring."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        for name, weight in weights.items():
            if weight.dtype != np.uint64 or weight.ndim != 2:
                raise ConfigError(f"David's weight {name!r} must be a uint64 matrix")
        self.weights = dict(weights)

    def weight(self, key: str) -> np.ndarray:
        name, rows = parse_key(key)
        if name not in self.weights:
            raise ProtocolError(f"David holds no layer {name!r}")
        weight = self.weights[name]
        if rows is not None:
            if rows.stop > weight.shape[0] or rows.start >= rows.stop:
                raise ProtocolError(f"layer {name!r} has {weight.shape[0]} rows, not {key!r}")
            weight = weight[rows]
        return weight

    def answer(self, request: Mapping[str, np.ndarray]) -> Request:
        """``W_D x`` (mod 2**64) for every ``(key, x)`` of ``request``."""
        replies = {}
        for key, rows in request.items():
            weight = self.weight(key)
            if rows.dtype != np.uint64 or rows.ndim != 2 or rows.shape[1] != weight.shape[1]:
                raise ProtocolError(
                    f"layer {key!r} takes (rows, {weight.shape[1]}) uint64 inputs; Charlie sent "
                    f"{rows.dtype}{rows.shape}"
                )
            replies[key] = ring_matmul(rows, weight)
        return replies

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())


# -- the traced structure ----------------------------------------------------------------------


def trace_groups(model: torch.nn.Module, example: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The model's linear layers in call order, grouped by shared input tensor (one request
    each): a plain forward of ``model`` on ``example`` with a pre-hook on every linear layer."""
    calls: list[tuple[str, torch.Tensor]] = []
    handles = []
    for name, module in linear_layers(model).items():

        def record(_: Any, args: tuple[Any, ...], name: str = name) -> None:
            calls.append((name, args[0]))  # the tensors stay alive: identity is meaningful

        handles.append(module.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            model(**example)
    finally:
        for handle in handles:
            handle.remove()
    groups: list[list[str]] = []
    previous: torch.Tensor | None = None
    for name, tensor in calls:
        if groups and tensor is previous:
            groups[-1].append(name)
        else:
            groups.append([name])
        previous = tensor
    seen = [name for group in groups for name in group]
    if len(seen) != len(set(seen)):
        raise ModelError("a linear layer is called twice in one forward: SLIP needs one call each")
    return groups


# -- Charlie ------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """What one inference cost Charlie and David (bytes as the ring's 8-byte words)."""

    round_trips: int = 0
    bytes_to_david: int = 0
    bytes_to_charlie: int = 0
    david_seconds: float = 0.0
    pad_rows: int = 0
    masked_items: int = 0
    clear_items: int = 0
    max_activation: float = 0.0
    largest_product_bound: float = 0.0
    ring_ops: int = 0  # Charlie's encode/mask and unmask/decode work, two per element each


class Pause(Exception):
    """Charlie's forward stopped at request ``index`` (runtime driver)."""

    def __init__(self, index: int, request: Request, masks: dict[str, np.ndarray]) -> None:
        super().__init__(f"request {index}")
        self.index, self.request, self.masks = index, request, masks


class HybridLinear(torch.nn.Module):
    """A linear layer Charlie evaluates with David (module docstring)."""

    def __init__(
        self,
        name: str,
        linear: torch.nn.Linear,
        factors: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        super().__init__()
        self.name = name
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias: torch.Tensor | None = (
            linear.bias.detach().clone() if linear.bias is not None else None
        )
        self.split = factors is not None
        left, right = factors or (np.zeros((self.out_features, 0)), np.zeros((self.in_features, 0)))
        if left.shape != (self.out_features, left.shape[1]) or right.shape != (
            self.in_features,
            left.shape[1],
        ):
            raise ConfigError(
                f"Charlie's factors for {name} have shapes {left.shape} and {right.shape}; the "
                f"layer is {self.out_features}x{self.in_features}"
            )
        self.left: torch.Tensor = torch.from_numpy(np.ascontiguousarray(left)).float()
        self.right: torch.Tensor = torch.from_numpy(np.ascontiguousarray(right)).float()

    def charlie_part(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """``W_C x`` from the factors (zeros for a layer David holds whole)."""
        left = self.left if rows is None else self.left[rows]
        if not self.split:
            return x.new_zeros(*x.shape[:-1], left.shape[0])
        return (x @ self.right) @ left.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        session = _SESSION.get()
        if session is None:
            raise ModelError(f"SLIP layer {self.name} runs only inside a Charlie session")
        return session.linear(self, x)


def _eager(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if mask is not None:
        weights = weights + mask[:, :, :, : key.shape[-2]]
    return torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)


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
    """Charlie's attention: the softmax and the products with it are his (Fig. 11)."""
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    probs = _eager(query, key, attention_mask, scale)
    session = _SESSION.get()
    if session is None or session.deferred is None:
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), None
    layer, x = session.deferred
    session.deferred = None
    if groups > 1:
        raise ModelError("double-step attention with grouped-query attention is not supported")
    heads, head_dim = query.shape[1], query.shape[-1]
    mixed = torch.matmul(probs, x.unsqueeze(1))  # (batch, heads, tokens, d): A_h X
    items = {
        head_key(layer.name, h * head_dim, (h + 1) * head_dim): mixed[:, h] for h in range(heads)
    }
    outputs = session.point(layer, items)
    stacked = torch.stack([outputs[k] for k in items], dim=2)  # (batch, tokens, heads, hd)
    return stacked.contiguous(), None


def register() -> None:
    """Register :data:`ATTENTION` with transformers (once per process)."""
    global _registered
    with _REGISTERED:
        if not _registered:
            from fedfm.models.decoder import register_attention

            register_attention(ATTENTION, _attention)
            _registered = True


def _value_layers(model: torch.nn.Module) -> set[str]:
    """Names of the attention value projections (``v_proj``, ``value``)."""
    return {
        name for name in linear_layers(model) if name.rsplit(".", 1)[-1] in ("v_proj", "value", "v")
    }


@dataclass
class Session:
    """One forward pass of Charlie's (module docstring)."""

    charlie: Charlie
    david: David | None
    answered: list[dict[str, np.ndarray]]
    traffic: Traffic = field(default_factory=Traffic)
    index: int = 0
    ready: dict[str, torch.Tensor] = field(default_factory=dict)
    deferred: tuple[HybridLinear, torch.Tensor] | None = None

    def linear(self, layer: HybridLinear, x: torch.Tensor) -> torch.Tensor:
        if layer.name in self.ready:
            return self.ready.pop(layer.name)
        if self.ready:
            raise InvariantError(f"layers {sorted(self.ready)} were answered and never called")
        if self.charlie.attention == "double-step" and layer.name in self.charlie.values:
            self.deferred = (layer, x)
            return x.new_zeros(*x.shape[:-1], layer.out_features)
        group = self.charlie.group_of[layer.name]
        layers = [self.charlie.layers[name] for name in group]
        outputs = self.point(None, {member.name: x for member in layers})
        self.ready = {name: outputs[name] for name in group[1:]}
        return outputs[group[0]]

    def point(
        self, layer: HybridLinear | None, items: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """One request to David: ``items`` (key -> input) answered, Charlie's part added."""
        index = self.index
        self.index += 1
        flat = {key: x.reshape(-1, x.shape[-1]).double().numpy() for key, x in items.items()}
        answered = index < len(self.answered)
        parts = self.answered[index] if answered else self.exchange(index, flat)
        outputs = {}
        for key, x in items.items():
            name, rows = parse_key(key)
            module = layer if layer is not None else self.charlie.layers[name]
            part = parts.get(key)
            if part is None or part.shape[0] != flat[key].shape[0]:
                raise ProtocolError(f"no answer of the right shape for layer {key!r}")
            david = torch.from_numpy(part).to(x.dtype).reshape(*x.shape[:-1], part.shape[-1])
            out = david + module.charlie_part(x, rows)
            if module.bias is not None:
                out = out + (module.bias if rows is None else module.bias[rows])
            outputs[key] = out
        return outputs

    def exchange(self, index: int, flat: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        request, masks = self.charlie.mask(flat, self.traffic)
        if self.david is None:
            raise Pause(index, request, masks)
        self.traffic.round_trips += 1
        self.traffic.bytes_to_david += sum(v.nbytes for v in request.values())
        start = time.perf_counter()
        reply = self.david.answer(request)
        self.traffic.david_seconds += time.perf_counter() - start
        self.traffic.bytes_to_charlie += sum(v.nbytes for v in reply.values())
        self.traffic.ring_ops += 2 * sum(v.size for v in reply.values())
        return self.charlie.unmask(reply, masks)


class Charlie:
    """The trusted party: the model with ``W_C`` factors, pads, and the protocol's modes.

    Parameters
    ----------
    model:
        The transformers model (Charlie keeps its embeddings, norms and biases; each linear
        layer is replaced by a :class:`HybridLinear` holding only ``W_C``'s factors).
    share:
        Charlie's share of the owner's split (:meth:`Decomposition.charlie_share`).
    example:
        Inputs of one forward (any length), to trace which layers share an input.
    pads:
        The precomputed pad store (:meth:`precompute_pads` makes one).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        share: CharlieShare,
        example: Mapping[str, torch.Tensor],
        *,
        composition: str = "safe",
        attention: str = "single-step",
        pads: PadStore | None = None,
    ) -> None:
        if composition not in COMPOSITIONS:
            raise ConfigError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
        if attention not in ATTENTIONS:
            raise ConfigError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        register()
        self.composition, self.attention = composition, attention
        groups = trace_groups(model, example)
        self.values = _value_layers(model) if attention == "double-step" else set()
        if attention == "double-step" and not self.values:
            raise ModelError("double-step attention needs value projections (v_proj or value)")
        groups = [[n for n in group if n not in self.values] for group in groups]
        self.groups = [group for group in groups if group]
        self.group_of = {name: group for group in self.groups for name in group}
        self.layers: dict[str, HybridLinear] = {}
        layers = linear_layers(model)
        check_plan(share.factors, layers)
        missing = sorted(set(layers) - set(share.bounds))
        if missing:
            raise ConfigError(f"Charlie's share has no row norm for layer {missing[0]!r}")
        for name, linear in layers.items():
            hybrid = HybridLinear(name, linear, share.factors.get(name))
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attribute, hybrid)
            self.layers[name] = hybrid
        config: Any = model.config
        config._attn_implementation = ATTENTION
        self.model = model.eval()
        self.bounds = dict(share.bounds)
        self.pads = pads or PadStore()

    # -- masking ----------------------------------------------------------------------------
    def masked(self, key: str) -> bool:
        """Whether requests for ``key`` are masked in this composition."""
        if self.composition == "unmasked":
            return False
        return self.composition == "safe" or self.layers[parse_key(key)[0]].split

    def pad_keys(self, heads: Mapping[str, int] | None = None) -> list[str]:
        """The keys that need pads (value layers per head in double-step: ``heads`` gives each
        value layer's head size; default from the model config)."""
        keys = []
        for name, layer in self.layers.items():
            if name in self.values:
                size = (heads or {}).get(name) or self._head_size()
                keys += [
                    head_key(name, start, start + size)
                    for start in range(0, layer.out_features, size)
                ]
            else:
                keys.append(name)
        return [key for key in keys if self.masked(key)]

    def _head_size(self) -> int:
        config: Any = self.model.config
        heads = int(config.num_attention_heads)
        return int(getattr(config, "head_dim", None) or config.hidden_size // heads)

    def mask(
        self, flat: Mapping[str, np.ndarray], traffic: Traffic
    ) -> tuple[Request, dict[str, np.ndarray]]:
        """The request for ``flat`` (key -> float rows) and the masks to remove from its answer."""
        request, masks = {}, {}
        for key, rows in flat.items():
            name, _ = parse_key(key)
            check_headroom(rows, self.bounds[name], key)
            traffic.max_activation = max(traffic.max_activation, float(np.abs(rows).max()))
            traffic.largest_product_bound = max(
                traffic.largest_product_bound, float(np.abs(rows).max()) * self.bounds[name]
            )
            encoded = encode_activations(rows)
            traffic.ring_ops += 2 * rows.size
            if self.masked(key):
                _, pad, masks[key] = self.pads.take(key, rows.shape[0])
                with np.errstate(over="ignore"):
                    encoded = encoded + pad
                traffic.masked_items += 1
                traffic.pad_rows += rows.shape[0]
            else:
                traffic.clear_items += 1
            request[key] = encoded
        return request, masks

    def unmask(
        self, reply: Mapping[str, np.ndarray], masks: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """David's parts ``W_D a`` as floats: the cancellation masks removed (Lemma 2)."""
        parts = {}
        for key, value in reply.items():
            value = np.asarray(value)
            if value.dtype != np.uint64 or value.ndim != 2:
                raise ProtocolError(f"David's answer for {key!r} is not a uint64 matrix")
            if key in masks:
                if masks[key].shape != value.shape:
                    raise ProtocolError(
                        f"David's answer for {key!r} has shape {value.shape}, the mask "
                        f"{masks[key].shape}"
                    )
                with np.errstate(over="ignore"):
                    value = value - masks[key]
            parts[key] = decode(value)
        return parts

    def precompute_pads(
        self, david: David, rows: int, heads: Mapping[str, int] | None = None
    ) -> PadStore:
        """Offline: ``rows`` pad rows (e.g. tokens x inferences) for every masked key."""
        keys = self.pad_keys(heads)
        weights = {key: david.weight(key) for key in keys}
        self.pads = PadStore.precompute(weights, keys, rows)
        return self.pads

    # -- drivers ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _session(self, session: Session) -> Iterator[Session]:
        token = _SESSION.set(session)
        try:
            yield session
        finally:
            _SESSION.reset(token)

    def run(self, inputs: Mapping[str, torch.Tensor], david: David) -> tuple[Any, Traffic]:
        """One hybrid inference with ``david`` in this process: the model's output, traffic."""
        session = Session(self, david, [])
        with self._session(session), torch.no_grad():
            output = self.model(**inputs)
        if session.ready or session.deferred is not None:
            raise InvariantError("the forward ended with answered layers never used")
        return output, session.traffic

    def resume(
        self, inputs: Mapping[str, torch.Tensor], answered: list[dict[str, np.ndarray]]
    ) -> Any:
        """Replay the forward with the David parts of ``answered`` requests; the output, or
        :class:`Pause` at the next request (runtime driver)."""
        session = Session(self, None, answered)
        with self._session(session), torch.no_grad():
            output = self.model(**inputs)
        if session.index != len(answered):
            raise ProtocolError(
                f"{len(answered)} answers for a forward of {session.index} requests"
            )
        return output

    @property
    def requests(self) -> int:
        """Requests (round trips with David) of one forward."""
        return len(self.groups) + len(self.values)


def request_count(
    model: torch.nn.Module, example: Mapping[str, torch.Tensor], attention: str
) -> int:
    """Requests one forward of a model of this architecture makes (the protocol's steps)."""
    groups = trace_groups(model, example)
    values = _value_layers(model) if attention == "double-step" else set()
    return sum(1 for g in groups if [n for n in g if n not in values]) + len(values)
