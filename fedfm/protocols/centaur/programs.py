"""CENTAUR's forward pass as an engine program, and the full secret-sharing baseline's.

One forward pass over ``n`` tokens (seed §4.2, Fig. 4, App. A), for the two compute parties P0
(``developer``) and P1 (``cloud``). Values are additive shares over ``Z_{2^64}`` with ``f``
fractional bits; ``@ W'`` is a product of a share with a plaintext weight of Θ' (Π_ScalMul: local,
no communication); products of two shares use Beaver triples (Π_MatMul).

``faithful`` (the seed):

* **Embedding** (Alg. 4): ``[X_M π] = [onehot(X)] @ W_E π (+ (P + T) π)``; BERT: ``[X_E π] =
  Π_PPLN([X_M π])`` (the cloud reconstructs ``X_M π``). Llama has no embedding norm: layer 0's
  RMSNorm reconstructs ``X_M π``.
* **Attention** (Eq. 3-4): ``[Q], [K], [V] = [X π] @ (W π)`` (unpermuted: π cancels); RoPE on
  shares (public cosines); ``[O_1] = Π_MatMul([Q], [K]^T)`` (``+ [M]``, the causal mask, added by
  P0); **Π_PPP** (Alg. 6): ``[O_1 π_1] = Π_MatMul([O_1], [π_1])`` and ``[π_1^T V] =
  Π_MatMul([π_1^T], [V])`` with the client's shared permutation matrix ``π_1``; **Π_PPSM**
  (Alg. 1): the cloud computes ``softmax(O_1 π_1 / sqrt(d_h))`` (Eq. 4's scaling by the public
  ``1/sqrt(d_h)`` is applied by the cloud after reconstruction); ``[O_3] = Π_MatMul([O_2 π_1],
  [π_1^T V])``; ``[O_4 π] = [O_3] @ (π^T W_O)``.
* **Feed-forward** (Eq. 3, Alg. 2-3): BERT: Π_PPLN of ``O_4 π + X_E π``; ``[O_5 π_2] = [L_1 π] @
  (π^T W_1 π_2)``; Π_PPGeLU; ``[O_6 π] = [G π_2] @ (π_2^T W_2 π)``; Π_PPLN. Llama (App. E):
  Π_PPRMSNorm before attention and before the MLP; the cloud computes ``SiLU(gate) * up`` on
  ``π_2``-permuted gate and up (Eq. 7).
* **Adaptation** (Alg. 5): BERT: ``[X_P π] = [h_0 π] @ (π^T W_P π)``, the cloud's tanh,
  ``[Y] = [T π] @ (π^T W_C)``; Llama: the cloud's final RMSNorm of the last position, ``[Y] =
  [h π] @ (π^T W_head)``. Both parties send ``[Y]`` to the client.

The seed contradicts itself on π_1: §4.1 has P0 draw ``π_1`` (``n x n``) at initialisation,
before any input length exists, and Alg. 6 has the client P2 draw it per inference. Here the
client draws it per forward pass (it knows ``n``; P0 never sees a permuted plaintext, so P0
knowing π_1 would not hurt, but it cannot draw it before ``n`` is known). ``faithful`` uses one
π_1 for every head and layer, as the seed's single π_1; ``hardened`` draws a fresh one per head
and layer. π (hidden) must be the same for every layer: Θ' chains layers through it.

``hardened`` also computes the embedding's LayerNorm (BERT) or layer 0's first RMSNorm (Llama)
under secret sharing (:func:`~fedfm.protocols.centaur.approximations.layer_norm`), so the cloud
never reconstructs ``X_M π``; and the developer provisions Θ' with a fresh π_2 per layer.

``full-sharing`` (the baseline): the same layer loop with the weights secret-shared too (every
linear layer a Π_MatMul, as CrypTen does: a fresh triple per product, the weight's mask opened
each inference) and every non-linear function by the MPC approximations of
:mod:`~fedfm.protocols.centaur.approximations`; nothing is ever reconstructed before the output.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import fedfm.protocols.centaur.approximations as approx
from fedfm.errors import ConfigError
from fedfm.protocols.centaur.approximations import Builder
from fedfm.protocols.centaur.engine import Deal, Party, Program
from fedfm.protocols.centaur.model import (
    Architecture,
    causal_mask,
    gelu,
    layer_norm,
    rms_norm,
    rope_tables,
    silu,
    softmax,
)
from fedfm.protocols.sharing import encode, ring_matmul

MODES = ("faithful", "hardened", "full-sharing")
EXP_CEILING = 9.0  # the baseline's exp inputs stay below this (e^9 = 8103 < 2^15.5)
MAX_MARGIN = 8.0  # e^-8 = 3.4e-4: still 22 units of 2^-16
# The baseline's softmax runs at temperature 2^SHARPENINGS and squares back (see
# full_sharing_attention): one row's scores may spread by up to 2^SHARPENINGS (EXP_CEILING +
# MAX_MARGIN) = 68 (MiniLM's first layer: 41 on the calibration text).
SHARPENINGS = 2
INPUT = "input"


@dataclass(frozen=True)
class Calibration:
    """Public constants the MPC approximations need, measured by the developer on public text
    with the plaintext model (part of the provisioned file: both compute parties read them)."""

    score_spread: float = 8.0  # largest (max - mean) of a row of attention scores / sqrt(d_h)
    embed_variance: float = 1.0  # typical variance at the embedding / first norm
    layer_variance: float = 1.0  # typical variance at the layers' norms (baseline)
    activation_bound: float = 8.0  # GeLU / SiLU polynomial domain [-bound, bound]
    tanh_bound: float = 4.0
    # per norm (``l3.ln2``, ``l0.norm2``, ``norm``): the variance (BERT) or mean square (Llama)
    # at the middle of its rows' range on the calibration text; the residual stream's scale
    # differs between norms by far more than inverse_sqrt's domain (a Llama's layer 0 MLP norm
    # reads the embedding's scale, 1e-3 times the later layers'), so one constant does not do
    norm_variances: dict[str, float] = field(default_factory=dict)

    def norm_variance(self, norm: str) -> float:
        """The calibration constant of the norm named ``norm`` (``layer_variance`` if none)."""
        return self.norm_variances.get(norm, self.layer_variance)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"not a CENTAUR calibration: {text!r} ({error})") from None


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"centaur mode must be one of {MODES}, got {mode!r}")
    return mode


def permutation_deals(architecture: Architecture, n: int, mode: str) -> list[Deal]:
    """π_1 as the client deals it: one ``(n, n)`` matrix (faithful) or one per head and layer
    (hardened); none for the baseline."""
    if mode == "full-sharing":
        return []
    if mode == "faithful":
        return [Deal("perm", (n, n), "secret", source="perm")]
    heads = architecture.heads
    return [
        Deal(f"perm.l{layer}", (heads, n, n), "secret", source=f"perm.l{layer}")
        for layer in range(architecture.layers)
    ]


def input_deal(architecture: Architecture, n: int) -> Deal:
    return Deal(INPUT, (n, architecture.vocab), "secret", source=INPUT)


def lift(party: Party, x: np.ndarray) -> np.ndarray:
    """A share at ``f`` bits as a share at ``2 f`` bits (exact)."""
    return x * np.uint64(1 << party.fraction)


def negate(x: np.ndarray) -> np.ndarray:
    return np.uint64(0) - x


def rotate_half_shares(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([negate(x[..., half:]), x[..., :half]], axis=-1)


class ForwardBuilder:
    """Builds one forward pass (module docstring) for ``n`` tokens."""

    def __init__(
        self,
        architecture: Architecture,
        n: int,
        *,
        mode: str,
        fraction: int,
        calibration: Calibration,
    ) -> None:
        self.a = architecture
        self.n = n
        self.mode = check_mode(mode)
        self.f = fraction
        self.calibration = calibration
        self.b = Builder(fraction)
        self.perms = {deal.name: deal for deal in permutation_deals(architecture, n, mode)}
        self.input = input_deal(architecture, n)

    @property
    def shared_weights(self) -> bool:
        return self.mode == "full-sharing"

    # -- linear layers --------------------------------------------------------------------------

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Name the layer type of the instructions built inside (per-type costs)."""
        previous, self.b.scope = self.b.scope, name
        try:
            yield
        finally:
            self.b.scope = previous

    def linear(self, *args: Any, **kwargs: Any) -> None:
        keep = self.b.scope in ("embedding", "adaptation")
        with self.scope(self.b.scope if keep else "linear"):
            self._linear(*args, **kwargs)

    def norm(self, *args: Any, **kwargs: Any) -> None:
        with self.scope("layernorm"):
            self._norm(*args, **kwargs)

    def _linear(
        self,
        base: str,
        out: str,
        x: str,
        weight: str,
        rows: int,
        *,
        bias: str | None,
        truncate: bool,
    ) -> None:
        """``out = x @ W (+ b)``: Π_ScalMul (local) with Θ', or Π_MatMul with shared weights."""
        a = self.a
        if self.shared_weights:
            shape = _weight_shape(a, weight)
            self.b.add(
                self.b.product(
                    base, out, x, lambda party: party.weight(weight), (rows, shape[0]), shape
                )
            )
            if bias is not None:
                self.b.local(
                    f"{base}.bias",
                    lambda party: party.put(out, party.get(out) + party.weight(bias)),
                )
            return

        def action(party: Party) -> None:
            result = ring_matmul(party.get(x), party.encoded(weight))
            if bias is not None:
                result = result + party.constant(party.weight(bias), 2 * self.f)
            party.put(out, party.truncate(result) if truncate else result)

        self.b.local(base, action)

    # -- the forward pass ----------------------------------------------------------------------

    def build(self) -> Program:
        with self.scope("embedding"):
            self.embedding()
        for layer in range(self.a.layers):
            with self.scope("linear"):
                if self.a.kind == "bert":
                    self.bert_layer(layer)
                else:
                    self.llama_layer(layer)
        with self.scope("adaptation"):
            self.head()
        self.b.program.secrets = [self.input, *self.perms.values()]
        self.b.program.check_names()
        return self.b.program

    def embedding(self) -> None:
        a, n = self.a, self.n
        source = self.input

        def lookup(party: Party) -> np.ndarray:
            return party.dealt(source)

        if self.shared_weights:
            self.b.add(
                self.b.product(
                    "embed",
                    "h",
                    lookup,
                    lambda party: party.weight("embed.word"),
                    (n, a.vocab),
                    (a.vocab, a.hidden),
                    truncate=False,
                )
            )
            if a.kind == "bert":
                self.b.local(
                    "embed.add",
                    lambda party: party.put(
                        "h",
                        party.get("h")
                        + party.weight("embed.position")[:n]
                        + party.weight("embed.type"),
                    ),
                )
        else:

            def action(party: Party) -> None:
                h = ring_matmul(lookup(party), party.encoded("embed.word"))  # one-hot: scale 0
                party.context.state.pop(f"d.{source.name}", None)  # used once: drop it
                if a.kind == "bert":
                    extra = party.weight("embed.position")[:n] + party.weight("embed.type")
                    h = h + party.constant(extra, self.f)
                party.put("h", h)

            self.b.local("embed", action)
        if a.kind != "bert":
            return
        if self.mode == "faithful":
            self.b.cloud(
                "embed.ln",
                "h",
                "h",
                lambda party, x: layer_norm(
                    x, party.weight("embed.ln.g"), party.weight("embed.ln.b"), a.eps
                ),
                self.f,
            )
        else:
            approx.layer_norm(
                self.b,
                "h",
                "h",
                n,
                a.hidden,
                gain="embed.ln.g",
                bias="embed.ln.b",
                calibration=self.calibration.embed_variance,
                shared_weights=self.shared_weights,
            )

    def _norm(
        self,
        base: str,
        out: str,
        x: str,
        gain: str,
        bias: str | None,
        rows: int,
        *,
        under_sharing: bool,
        variance: float,
    ) -> None:
        """LayerNorm (bias given) or RMSNorm: on the cloud's permuted plaintext (Alg. 3 / Eq. 6)
        or under secret sharing."""
        a = self.a
        if under_sharing:
            approx.layer_norm(
                self.b,
                out,
                x,
                rows,
                a.hidden,
                gain=gain,
                bias=bias,
                calibration=variance,
                centred=bias is not None,
                shared_weights=self.shared_weights,
            )
            return
        if bias is None:
            self.b.cloud(
                base, out, x, lambda party, v: rms_norm(v, party.weight(gain), a.eps), self.f
            )
        else:
            self.b.cloud(
                base,
                out,
                x,
                lambda party, v: layer_norm(v, party.weight(gain), party.weight(bias), a.eps),
                2 * self.f,
            )

    def attention(self, layer: int, x: str) -> None:
        """Eq. 3-4 and Alg. 6 / Alg. 1: writes ``l.ctx`` (shares of ``O_3``, ``f`` bits)."""
        a, n, f, p = self.a, self.n, self.f, f"l{layer}"
        heads, kv, dh = a.heads, a.kv_heads, a.head_dim
        groups = heads // kv
        bias = a.kind == "bert"
        for name in ("q", "k", "v"):
            self.linear(
                f"{p}.{name}",
                f"{p}.{name}",
                x,
                f"{p}.{name}.w",
                n,
                bias=f"{p}.{name}.b" if bias else None,
                truncate=True,
            )
        cos, sin = rope_tables(a, n) if a.kind == "llama" else (None, None)

        def heads_of(party: Party) -> None:
            q = party.get(f"{p}.q").reshape(n, heads, dh).transpose(1, 0, 2)
            k = party.get(f"{p}.k").reshape(n, kv, dh).transpose(1, 0, 2)
            v = party.get(f"{p}.v").reshape(n, kv, dh).transpose(1, 0, 2)
            if cos is not None and sin is not None:
                c, s = encode(cos, f), encode(sin, f)
                q = party.truncate(q * c + rotate_half_shares(q) * s)
                k = party.truncate(k * c + rotate_half_shares(k) * s)
            party.put(f"{p}.q", np.ascontiguousarray(q))
            party.put(
                f"{p}.kt", np.ascontiguousarray(np.repeat(k, groups, axis=0).transpose(0, 2, 1))
            )
            party.put(f"{p}.v", np.ascontiguousarray(np.repeat(v, groups, axis=0)))

        with self.scope("attention"):
            self.b.local(f"{p}.heads", heads_of)
            if self.mode == "full-sharing":
                self.full_sharing_attention(layer)
            else:
                self.permuted_attention(layer)

    def permuted_attention(self, layer: int) -> None:
        """Π_MatMul for ``Q K^T``, Π_PPP (Alg. 6) for the scores and ``V``, Π_PPSM (Alg. 1),
        Π_MatMul for ``O_2 V``."""
        a, n, f, p = self.a, self.n, self.f, f"l{layer}"
        heads, dh = a.heads, a.head_dim
        perm = self.perms["perm"] if self.mode == "faithful" else self.perms[f"perm.l{layer}"]

        def permutation(party: Party) -> np.ndarray:
            return np.ascontiguousarray(np.broadcast_to(party.dealt(perm), (heads, n, n)))

        def permutation_t(party: Party) -> np.ndarray:
            return np.ascontiguousarray(permutation(party).transpose(0, 2, 1))

        self.b.parallel(
            f"{p}.open",
            [
                self.b.product(
                    f"{p}.qk",
                    f"{p}.scores",
                    f"{p}.q",
                    f"{p}.kt",
                    (heads, n, dh),
                    (heads, dh, n),
                    truncate=False,
                ),
                self.b.product(
                    f"{p}.ppp_v",
                    f"{p}.pv",
                    permutation_t,
                    f"{p}.v",
                    (heads, n, n),
                    (heads, n, dh),
                    truncate=False,
                ),
            ],
        )
        if a.kind == "llama":
            mask = causal_mask(n)
            self.b.local(
                f"{p}.mask",
                lambda party: party.put(
                    f"{p}.scores", party.get(f"{p}.scores") + party.constant(mask, 2 * f)
                ),
            )
        self.b.add(
            self.b.product(
                f"{p}.ppp",
                f"{p}.scores",
                f"{p}.scores",
                permutation,
                (heads, n, n),
                (heads, n, n),
                truncate=False,
            )
        )
        scale = 1.0 / math.sqrt(dh)
        with self.scope("softmax"):
            self.b.cloud(
                f"{p}.softmax",
                f"{p}.probs",
                f"{p}.scores",
                lambda party, s: softmax(s * scale),
                2 * f,
            )
        self.b.add(
            self.b.product(
                f"{p}.av", f"{p}.ctx", f"{p}.probs", f"{p}.pv", (heads, n, n), (heads, n, dh)
            )
        )
        self.b.local(
            f"{p}.merge",
            lambda party: party.put(
                f"{p}.ctx", party.get(f"{p}.ctx").transpose(1, 0, 2).reshape(n, a.hidden)
            ),
        )

    def full_sharing_attention(self, layer: int) -> None:
        a, n, p = self.a, self.n, f"l{layer}"
        heads, dh = a.heads, a.head_dim
        shape = (heads, n, n)
        self.b.add(
            self.b.product(
                f"{p}.qk", f"{p}.scores", f"{p}.q", f"{p}.kt", (heads, n, dh), (heads, dh, n)
            )
        )
        # Softmax without comparisons: subtract each row's mean plus a public margin m (local,
        # exact). exp(x - mean - m) stays below e^EXP_CEILING (a fixed-point product of two
        # values must stay below 2^63: values below about 2^15.5 at 16 bits) on the calibration
        # text, and by Jensen the mean of the exponentials is at least e^-m, so Newton's
        # reciprocal gets enough iterations to climb from CrypTen's initial guess to e^m.
        # That covers rows whose (max - mean) lies in a window EXP_CEILING + MAX_MARGIN = 17
        # wide: the 16-bit fixed point's dynamic range. Trained encoders have heads far wider
        # than that beside nearly flat ones (MiniLM's layer 0: 0.4 to 41 in one head), so the
        # softmax runs at temperature T = 2^SHARPENINGS (spreads / T fit the window) and
        # squares back: softmax(x) = normalise(softmax(x / T)^T), one squaring and one
        # renormalisation per halving of T (sharpen). The 1/count factors are public per row.
        keep = (causal_mask(n) == 0) if a.kind == "llama" else np.ones((n, n), dtype=bool)
        counts = keep.sum(axis=1, keepdims=True).astype(np.float64)
        f = self.f
        mean_of = encode(keep / counts, f)  # row-wise averaging weights (public)
        inverse_count = encode(1.0 / counts, f)
        temperature = float(1 << SHARPENINGS)
        with self.scope("softmax"):
            self.b.scale(f"{p}.scores", f"{p}.scores", 1.0 / (math.sqrt(dh) * temperature))
            # the margin is capped where the mean of the exponentials would fall below the
            # fixed point's resolution: rows spread wider than T (EXP_CEILING + MAX_MARGIN)
            # overflow (CrypTen subtracts a securely computed maximum instead)
            spread = self.calibration.score_spread / temperature
            margin = min(MAX_MARGIN, max(0.0, spread - EXP_CEILING))
            # fixed by the cap, not by the calibration: the number of rounds is public and
            # every party (the relay too) must count the same steps
            iterations = max(approx.RECIPROCAL_ITERATIONS, math.ceil(1.45 * MAX_MARGIN) + 4)

            def centre(party: Party) -> None:
                scores = party.get(f"{p}.scores")
                mean = party.truncate((scores * mean_of).sum(axis=-1, keepdims=True))
                party.put(f"{p}.scores", scores - mean - party.constant(margin, f))

            self.b.local(f"{p}.centre", centre)
            approx.exp(self.b, f"{p}.exp", f"{p}.scores", shape)
            mask = keep.astype(np.uint64)

            def average(party: Party) -> None:
                exp = party.get(f"{p}.exp") * mask
                party.put(f"{p}.exp", exp)
                party.put(
                    f"{p}.sum", party.truncate(exp.sum(axis=-1, keepdims=True) * inverse_count)
                )

            self.b.local(f"{p}.average", average)
            approx.reciprocal(self.b, f"{p}.inv", f"{p}.sum", (heads, n, 1), iterations)
            self.b.local(
                f"{p}.per_count",
                lambda party: party.put(
                    f"{p}.inv", party.truncate(party.get(f"{p}.inv") * inverse_count)
                ),
            )
            self.b.multiply(
                f"{p}.normalise", f"{p}.probs", f"{p}.exp", f"{p}.inv", shape, (heads, n, 1)
            )
            for _ in range(SHARPENINGS):
                self.sharpen(f"{p}.probs", shape, mask * counts.astype(np.uint64), inverse_count)
        self.b.add(
            self.b.product(f"{p}.av", f"{p}.ctx", f"{p}.probs", f"{p}.v", shape, (heads, n, dh))
        )
        self.b.local(
            f"{p}.merge",
            lambda party: party.put(
                f"{p}.ctx", party.get(f"{p}.ctx").transpose(1, 0, 2).reshape(n, a.hidden)
            ),
        )

    def sharpen(
        self,
        probs: str,
        shape: tuple[int, int, int],
        weight: np.ndarray,
        inverse_count: np.ndarray,
    ) -> None:
        """``probs <- probs^2 / sum(probs^2)`` per row: halves the softmax's temperature.

        ``r = count p`` (an exact integer scaling; ``weight`` is ``count`` on kept entries, 0 on
        masked ones) has row sum ``count``, so by Cauchy-Schwarz the row mean of ``r^2`` lies
        in ``[1, count]``: inside the reciprocal's domain from CrypTen's initial guess for any
        row, whatever the scores, and ``r^2 <= count^2`` fits the fixed point. Cost: two
        elementwise products and one reciprocal (``2 + 8 + 2 * 10`` rounds), in the range of
        the comparisons CrypTen's max needs instead (a tree of ``log2 n`` comparisons of about
        eight rounds each)."""
        square, mean, inverse = (self.b.fresh(f"sharpen.{n_}") for n_ in ("sq", "mean", "inv"))
        rows = (*shape[:2], 1)

        def scale(party: Party) -> None:
            party.put(square, party.get(probs) * weight)

        self.b.local("sharpen.scale", scale)
        self.b.multiply("sharpen.square", square, square, square, shape)

        def average(party: Party) -> None:
            total = party.get(square).sum(axis=-1, keepdims=True)
            party.put(mean, party.truncate(total * inverse_count))

        self.b.local("sharpen.average", average)
        approx.reciprocal(self.b, inverse, mean, rows)
        self.b.local(
            "sharpen.per_count",
            lambda party: party.put(inverse, party.truncate(party.get(inverse) * inverse_count)),
        )
        self.b.multiply("sharpen.normalise", probs, square, inverse, shape, rows)
        self.b.local("sharpen.done", lambda party: party.drop(square, mean, inverse))

    def bert_layer(self, layer: int) -> None:
        a, n, f, p = self.a, self.n, self.f, f"l{layer}"
        full = self.shared_weights
        self.attention(layer, "h")
        self.linear(f"{p}.o", f"{p}.res", f"{p}.ctx", f"{p}.o.w", n, bias=f"{p}.o.b", truncate=full)

        def residual(party: Party) -> None:
            h = party.get("h") if full else lift(party, party.get("h"))
            party.put(f"{p}.res", party.get(f"{p}.res") + h)

        self.b.local(f"{p}.residual1", residual)
        self.norm(
            f"{p}.ln1",
            "h",
            f"{p}.res",
            f"{p}.ln1.g",
            f"{p}.ln1.b",
            n,
            under_sharing=full,
            variance=self.calibration.norm_variance(f"{p}.ln1"),
        )
        self.linear(f"{p}.up", f"{p}.up", "h", f"{p}.up.w", n, bias=f"{p}.up.b", truncate=full)
        shape = (n, a.intermediate)
        with self.scope("activation"):
            if full:
                approx.rectified_polynomial(
                    self.b, f"{p}.act", f"{p}.up", shape, gelu, self.calibration.activation_bound
                )
            else:
                self.b.cloud(f"{p}.gelu", f"{p}.act", f"{p}.up", lambda party, x: gelu(x), 2 * f)
        self.linear(
            f"{p}.down", f"{p}.res", f"{p}.act", f"{p}.down.w", n, bias=f"{p}.down.b", truncate=full
        )
        self.b.local(f"{p}.residual2", residual)
        self.norm(
            f"{p}.ln2",
            "h",
            f"{p}.res",
            f"{p}.ln2.g",
            f"{p}.ln2.b",
            n,
            under_sharing=full,
            variance=self.calibration.norm_variance(f"{p}.ln2"),
        )

    def llama_layer(self, layer: int) -> None:
        a, n, p = self.a, self.n, f"l{layer}"
        full = self.shared_weights
        first_hardened = self.mode == "hardened" and layer == 0
        variance = (
            self.calibration.embed_variance
            if layer == 0
            else self.calibration.norm_variance(f"{p}.norm1")
        )
        self.norm(
            f"{p}.norm1",
            f"{p}.x",
            "h",
            f"{p}.norm1.g",
            None,
            n,
            under_sharing=full or first_hardened,
            variance=variance,
        )
        self.attention(layer, f"{p}.x")
        self.linear(f"{p}.o", f"{p}.o", f"{p}.ctx", f"{p}.o.w", n, bias=None, truncate=True)
        self.b.local(
            f"{p}.residual1", lambda party: party.put("h", party.get("h") + party.get(f"{p}.o"))
        )
        self.norm(
            f"{p}.norm2",
            f"{p}.x",
            "h",
            f"{p}.norm2.g",
            None,
            n,
            under_sharing=full,
            variance=self.calibration.norm_variance(f"{p}.norm2"),
        )
        k = a.intermediate
        if full:
            self.linear(
                f"{p}.gate", f"{p}.gate", f"{p}.x", f"{p}.gate.w", n, bias=None, truncate=True
            )
            self.linear(f"{p}.upp", f"{p}.up", f"{p}.x", f"{p}.up.w", n, bias=None, truncate=True)
            with self.scope("activation"):
                coefficients = approx.chebyshev_power_coefficients(
                    silu, self.calibration.activation_bound
                )
                approx.polynomial(
                    self.b,
                    f"{p}.silu",
                    f"{p}.gate",
                    (n, k),
                    coefficients,
                    self.calibration.activation_bound,
                )
                self.b.multiply(f"{p}.swiglu", f"{p}.act", f"{p}.silu", f"{p}.up", (n, k))
        else:

            def gate_up(party: Party) -> None:
                x = party.get(f"{p}.x")
                gate = ring_matmul(x, party.encoded(f"{p}.gate.w"))
                up = ring_matmul(x, party.encoded(f"{p}.up.w"))
                party.put(f"{p}.gu", np.stack([gate, up]))

            self.b.local(f"{p}.gate_up", gate_up)
            with self.scope("activation"):
                self.b.cloud(
                    f"{p}.swiglu",
                    f"{p}.act",
                    f"{p}.gu",
                    lambda party, gu: silu(gu[0]) * gu[1],
                    2 * self.f,
                )
        self.linear(
            f"{p}.down", f"{p}.down", f"{p}.act", f"{p}.down.w", n, bias=None, truncate=True
        )
        self.b.local(
            f"{p}.residual2", lambda party: party.put("h", party.get("h") + party.get(f"{p}.down"))
        )

    def head(self) -> None:
        a, n, f = self.a, self.n, self.f
        full = self.shared_weights
        if a.kind == "bert":
            self.b.local("pool.first", lambda party: party.put("first", party.get("h")[:1]))
            self.linear("pool", "pool", "first", "pool.w", 1, bias="pool.b", truncate=full)
            if full:
                coefficients = approx.chebyshev_power_coefficients(
                    np.tanh, self.calibration.tanh_bound
                )
                approx.polynomial(
                    self.b, "tanh", "pool", (1, a.hidden), coefficients, self.calibration.tanh_bound
                )
            else:
                self.b.cloud("tanh", "tanh", "pool", lambda party, x: np.tanh(x), 2 * f)
            self.linear("cls", "logits", "tanh", "cls.w", 1, bias="cls.b", truncate=full)
        else:
            self.b.local("last", lambda party: party.put("last", party.get("h")[n - 1 :]))
            if full:
                approx.layer_norm(
                    self.b,
                    "final",
                    "last",
                    1,
                    a.hidden,
                    gain="norm.g",
                    bias=None,
                    calibration=self.calibration.norm_variance("norm"),
                    centred=False,
                    shared_weights=True,
                )
            else:
                self.b.cloud(
                    "norm",
                    "final",
                    "last",
                    lambda party, x: rms_norm(x, party.weight("norm.g"), a.eps),
                    f,
                )
            self.linear("lm_head", "logits", "final", "head.w", 1, bias=None, truncate=full)
        self.b.open("logits")


def output_fraction(mode: str, fraction: int) -> int:
    """Fractional bits of the logits the client reconstructs."""
    return fraction if mode == "full-sharing" else 2 * fraction


def _weight_shape(architecture: Architecture, name: str) -> tuple[int, int]:
    a = architecture
    kind = name.split(".")[1] if name.startswith("l") else name.split(".")[0]
    d, k, kv = a.hidden, a.intermediate, a.kv_heads * a.head_dim
    shapes = {
        "q": (d, d),
        "k": (d, kv),
        "v": (d, kv),
        "o": (d, d),
        "up": (d, k),
        "gate": (d, k),
        "down": (k, d),
        "pool": (d, d),
        "cls": (d, a.classes),
        "head": (d, a.vocab),
    }
    return shapes[kind]


def build_forward(
    architecture: Architecture, n: int, *, mode: str, fraction: int, calibration: Calibration
) -> Program:
    """The program of one forward pass over ``n`` tokens (module docstring)."""
    if n < 1:
        raise ConfigError("a forward pass needs at least one token")
    return ForwardBuilder(
        architecture, n, mode=mode, fraction=fraction, calibration=calibration
    ).build()
