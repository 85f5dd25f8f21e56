"""Feature scrambling and token permutation (spec 002 §4.2, Eqs. 7-12, App. A).

Row-vector convention, as the seed's (§2.1 footnote). For an invertible ``S`` (d x d):

* queries are scrambled as ``q' = q S`` and keys as ``k' = k S^{-T}``, so ``q' k'^T = q k^T``
  (Lemma 1, Eq. 7: the attention logits are unchanged);
* values are scrambled by a second matrix ``M``: ``v' = v M``; attention is linear in the
  values (Lemma 2, Eq. 8), so the compute node's output is ``o' = o M`` and the inquirer
  recovers ``o = o' M^{-1}`` (Eq. 12).

The structured matrix of Eq. 9 (the extraction lost the formula; reconstructed from the prose
"a two-layer sandwich ... between two random permutations", with diagonal scalings of random sign
and magnitude on both sides of a normalised Hadamard matrix)::

    S = P1 D1 H D2 P2
    S^{-T} = P1 D1^{-1} H D2^{-1} P2
    S^{-1} = P2^T D2^{-1} H D1^{-1} P1^T

``H`` is the Sylvester Hadamard matrix divided by ``sqrt(d)`` (orthonormal and symmetric), so the
inverse-transpose has the same shape with inverted scalings: applying either is two gathers,
two scalings and one ``+-1`` matrix product. The scalings' magnitudes are log-uniform in
``[1/r, r]`` with ``r`` the *scaling range* (§4.2: "sampled from an empirical range (e.g., ...)";
the value was lost in extraction). :data:`DEFAULT_SCALING_RANGE` ``= 2`` is this reconstruction's
choice: its bf16 error stays near plain bf16 attention's, while larger ranges buy lower kNN
overlap at a growing bf16 cost (``fedfm fedrag-attacks`` and ``fedfm bench-fedrag`` measure
both; ``docs/fedrag.md`` quotes them). ``kind="dense"`` is App. A's comparison: a Gaussian
random matrix; ``kind="permutation"`` is the permutation-only variant the VMA attack of
§6 defeats (no Hadamard, no scaling).

Keys come from randomness an inquirer and a context owner share and nobody else can reproduce
(:class:`PairRandomness`: on the runtime, :meth:`fedfm.runtime.RoleContext.shared_generator`
for the permutations and :meth:`~fedfm.runtime.RoleContext.shared_mask`, a ChaCha20 keystream,
for the signs, magnitudes and dense entries), per purpose: fresh per request, per layer, per
pair and per direction. :class:`KeyLedger` refuses to derive a purpose twice.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.secagg.masking import expand_mask

KINDS = ("structured", "dense", "permutation")
DEFAULT_KIND = "structured"
DEFAULT_SCALING_RANGE = 2.0


class ScramblerKeyReuse(ProtocolError):
    """A scrambling key was about to be derived (and used) a second time."""


class PairRandomness(Protocol):
    """Randomness two parties both derive for a purpose (see the module docstring)."""

    def generator(self, purpose: str) -> np.random.Generator: ...

    def words(self, purpose: str, count: int) -> np.ndarray: ...


class LocalRandomness:
    """:class:`PairRandomness` from a 32-byte secret (default: fresh from the OS CSPRNG):
    for attacks, benchmarks and the maths' tests, where one process plays both parties."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else os.urandom(32)
        if len(self._secret) != 32:
            raise ConfigError(f"a pair secret is 32 bytes, got {len(self._secret)}")

    def _key(self, kind: bytes, purpose: str) -> bytes:
        return hashlib.sha256(self._secret + kind + purpose.encode()).digest()

    def generator(self, purpose: str) -> np.random.Generator:
        return np.random.default_rng(int.from_bytes(self._key(b"generator", purpose), "big"))

    def words(self, purpose: str, count: int) -> np.ndarray:
        return expand_mask(self._key(b"mask", purpose), count)


def uniform_from_words(words: np.ndarray) -> np.ndarray:
    """Floats uniform in ``[0, 1)`` from uint64 keystream words (53 bits each)."""
    return (np.asarray(words, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def hadamard(dimension: int) -> np.ndarray:
    """The Sylvester Hadamard matrix of order ``dimension`` over ``sqrt(dimension)``."""
    return _hadamard(dimension, np.dtype(np.float64).str).copy()


@functools.lru_cache(maxsize=32)
def _hadamard(dimension: int, dtype: str) -> np.ndarray:
    """:func:`hadamard` in ``dtype``, built once per process (it is public and the same for
    every key: every scrambling step used to rebuild it), read-only."""
    if dimension < 1 or dimension & (dimension - 1):
        raise ConfigError(
            f"the structured scrambler needs a power-of-two head dimension, got {dimension} "
            "(use kind='dense' for other sizes)"
        )
    matrix = np.ones((1, 1))
    while matrix.shape[0] < dimension:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    matrix = (matrix / math.sqrt(dimension)).astype(dtype)
    matrix.flags.writeable = False
    return matrix


def check_scaling_range(value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 1.0:
        raise ConfigError(f"the scaling range r must be a finite number >= 1, got {value}")
    return value


def _permutation_matrix(order: np.ndarray) -> np.ndarray:
    """``P`` with ``(x P)[j] = x[order[j]]`` for a row vector ``x``."""
    matrix = np.zeros((order.size, order.size))
    matrix[order, np.arange(order.size)] = 1.0
    return matrix


@dataclass(frozen=True)
class Scrambler:
    """One invertible ``S`` (d x d) of a :data:`KINDS` kind, applied to rows (last axis).

    ``first``/``second`` are the permutations' gather orders (``(x P)[..., j] =
    x[..., order[j]]``), ``scale1``/``scale2`` the diagonals; ``dense`` holds a dense matrix and
    its inverse instead (kind ``dense``).
    """

    kind: str
    dimension: int
    first: np.ndarray
    second: np.ndarray
    scale1: np.ndarray
    scale2: np.ndarray
    dense: tuple[np.ndarray, np.ndarray] | None = None

    # -- application (the three maps of Eqs. 10 and 12) ----------------------------------------

    def _structured(self, x: np.ndarray, d1: np.ndarray, d2: np.ndarray) -> np.ndarray:
        y = x[..., self.first] * d1.astype(x.dtype)
        if self.kind == "structured":
            y = y @ _hadamard(self.dimension, x.dtype.str)
        return (y * d2.astype(x.dtype))[..., self.second]

    def forward(self, x: np.ndarray) -> np.ndarray:
        """``x S`` (queries; values under the value scrambler)."""
        if self.dense is not None:
            return x @ self.dense[0].astype(x.dtype)
        return self._structured(x, self.scale1, self.scale2)

    def inverse_transpose(self, x: np.ndarray) -> np.ndarray:
        """``x S^{-T}`` (keys)."""
        if self.dense is not None:
            return x @ self.dense[1].T.astype(x.dtype)
        return self._structured(x, 1.0 / self.scale1, 1.0 / self.scale2)

    def inverse(self, x: np.ndarray) -> np.ndarray:
        """``x S^{-1}`` (unscrambling attention outputs)."""
        if self.dense is not None:
            return x @ self.dense[1].astype(x.dtype)
        y = np.empty_like(x)
        y[..., self.second] = x
        y = y / self.scale2.astype(x.dtype)
        if self.kind == "structured":
            y = y @ _hadamard(self.dimension, x.dtype.str)
        y = y / self.scale1.astype(x.dtype)
        out = np.empty_like(y)
        out[..., self.first] = y
        return out

    def matrix(self) -> np.ndarray:
        """``S`` as a float64 matrix (tests, attacks)."""
        if self.dense is not None:
            return self.dense[0].copy()
        middle = hadamard(self.dimension) if self.kind == "structured" else np.eye(self.dimension)
        return (
            _permutation_matrix(self.first)
            @ np.diag(self.scale1)
            @ middle
            @ np.diag(self.scale2)
            @ _permutation_matrix(self.second)
        )

    def condition_number(self) -> float:
        return float(np.linalg.cond(self.matrix()))


def _words_needed(kind: str, dimension: int) -> int:
    """Keystream words one scrambler of ``kind`` draws (dense entries or scalings and signs)."""
    return {"dense": 2 * dimension * dimension, "structured": 4 * dimension}.get(kind, 0)


def _checked(kind: str, dimension: int, scaling_range: float) -> float:
    if kind not in KINDS:
        raise ConfigError(f"scrambler kind must be one of {KINDS}, got {kind!r}")
    if kind == "structured":
        _hadamard(dimension, "<f8")  # refuses a dimension that is not a power of two
    return check_scaling_range(scaling_range)


def _scrambler_from(
    generator: np.random.Generator,
    words: np.ndarray,
    kind: str,
    dimension: int,
    scaling_range: float,
) -> Scrambler:
    """One scrambler from its share of the pair's randomness: two permutations from
    ``generator``, the scalings and signs (or the dense entries) from ``words``."""
    first, second = generator.permutation(dimension), generator.permutation(dimension)
    if kind == "dense":
        # Box-Muller from keystream uniforms: a Gaussian matrix (App. A's "random dense matrix")
        u = uniform_from_words(words)
        u1, u2 = np.maximum(u[0::2], 2.0**-53), u[1::2]
        gaussian = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        matrix = gaussian.reshape(dimension, dimension) / math.sqrt(dimension)
        ones = np.ones(dimension)
        return Scrambler(
            kind, dimension, first, second, ones, ones, (matrix, np.linalg.inv(matrix))
        )
    if kind == "permutation":
        ones = np.ones(dimension)
        return Scrambler(kind, dimension, first, np.arange(dimension), ones, ones)
    uniforms = uniform_from_words(words[: 2 * dimension])
    signs = np.where(words[2 * dimension :] & np.uint64(1), -1.0, 1.0)
    log_range = math.log(scaling_range)
    magnitudes = np.exp((2.0 * uniforms - 1.0) * log_range)
    scales = signs * magnitudes
    return Scrambler(kind, dimension, first, second, scales[:dimension], scales[dimension:])


def draw_scrambler(
    randomness: PairRandomness,
    purpose: str,
    dimension: int,
    *,
    kind: str = DEFAULT_KIND,
    scaling_range: float = DEFAULT_SCALING_RANGE,
) -> Scrambler:
    """The scrambler both parties derive for ``purpose`` (module docstring)."""
    scaling_range = _checked(kind, dimension, scaling_range)
    generator = randomness.generator(f"{purpose}/permutations")
    count = _words_needed(kind, dimension)
    words = randomness.words(f"{purpose}/{kind}", count) if count else np.zeros(0, np.uint64)
    return _scrambler_from(generator, words, kind, dimension, scaling_range)


@dataclass(frozen=True)
class AttentionKeys:
    """One layer's key set for one inquirer/owner pair: per head, ``S`` for queries and keys
    and ``M`` for values (Eq. 10's two scrambling matrices; the token permutations are each
    party's own, drawn from the OS CSPRNG by :func:`token_permutation`)."""

    qk: tuple[Scrambler, ...]
    v: tuple[Scrambler, ...]

    def scramble_queries(self, q: np.ndarray, groups: int = 1) -> np.ndarray:
        """``(heads, n, d)`` queries -> ``q S`` per head (head ``h`` uses its key-value head
        ``h // groups``'s ``S``: grouped-query attention)."""
        return np.stack([self.qk[h // groups].forward(q[h]) for h in range(q.shape[0])])

    def scramble_keys(self, k: np.ndarray) -> np.ndarray:
        """``(kv_heads, m, d)`` keys -> ``k S^{-T}`` per head."""
        return np.stack([key.inverse_transpose(k[h]) for h, key in enumerate(self.qk)])

    def scramble_values(self, v: np.ndarray) -> np.ndarray:
        """``(kv_heads, m, d)`` values -> ``v M`` per head."""
        return np.stack([key.forward(v[h]) for h, key in enumerate(self.v)])

    def unscramble_outputs(self, o: np.ndarray, groups: int = 1) -> np.ndarray:
        """``(heads, n, d)`` scrambled outputs -> ``o' M^{-1}`` per head."""
        return np.stack([self.v[h // groups].inverse(o[h]) for h in range(o.shape[0])])


def draw_attention_keys(
    randomness: PairRandomness,
    purpose: str,
    *,
    heads: int,
    head_dim: int,
    kind: str = DEFAULT_KIND,
    scaling_range: float = DEFAULT_SCALING_RANGE,
) -> AttentionKeys:
    """Fresh ``S`` and ``M`` per head for ``purpose`` (one layer of one pair in one request).

    One generator and one keystream per purpose, cut into the ``2 * heads`` scramblers' shares
    (each scrambler's randomness is its own stretch of them): two key derivations per layer
    instead of two per scrambler."""
    if heads < 1:
        raise ConfigError(f"heads must be >= 1, got {heads}")
    scaling_range = _checked(kind, head_dim, scaling_range)
    generator = randomness.generator(f"{purpose}/permutations")
    per_key = _words_needed(kind, head_dim)
    words = (
        randomness.words(f"{purpose}/{kind}", 2 * heads * per_key)
        if per_key
        else np.zeros(0, np.uint64)
    )
    keys = [
        _scrambler_from(
            generator, words[index * per_key : (index + 1) * per_key], kind, head_dim, scaling_range
        )
        for index in range(2 * heads)
    ]
    return AttentionKeys(tuple(keys[:heads]), tuple(keys[heads:]))


def key_purpose(request: str, stage: str, inquirer: str, owner: str, layer: int) -> str:
    """The purpose string both parties of a pair derive one layer's keys for."""
    return f"fedrag/{request}/{stage}/{inquirer}<-{owner}/layer{layer}"


def token_permutation(count: int) -> np.ndarray:
    """A uniformly random order of ``count`` tokens from the OS CSPRNG (a party's own secret)."""
    seed = int.from_bytes(os.urandom(32), "big")
    return np.random.default_rng(seed).permutation(count)


class KeyLedger:
    """The purposes a party has derived keys for; deriving one twice is refused.

    Kept in a role's state between steps as a sorted array of 16-byte purpose digests.
    """

    def __init__(self, used: Iterable[bytes] = ()) -> None:
        self._used = set(used)

    @staticmethod
    def _digest(purpose: str) -> bytes:
        return hashlib.sha256(purpose.encode()).digest()[:16]

    def claim(self, purpose: str) -> None:
        digest = self._digest(purpose)
        if digest in self._used:
            raise ScramblerKeyReuse(
                f"scrambling key {purpose!r} was already derived and used: keys are fresh per "
                "request, per layer and per pair, and never reused"
            )
        self._used.add(digest)

    def to_array(self) -> np.ndarray:
        if not self._used:
            return np.zeros((0, 16), dtype=np.uint8)
        return np.frombuffer(b"".join(sorted(self._used)), dtype=np.uint8).reshape(-1, 16).copy()

    @classmethod
    def from_array(cls, array: np.ndarray | None) -> KeyLedger:
        if array is None:
            return cls()
        return cls(bytes(row.tobytes()) for row in np.asarray(array, dtype=np.uint8))


def relative_error(estimate: np.ndarray, reference: np.ndarray) -> float:
    """``||estimate - reference||_F / ||reference||_F``."""
    reference = np.asarray(reference, dtype=np.float64)
    return float(
        np.linalg.norm(np.asarray(estimate, np.float64) - reference) / np.linalg.norm(reference)
    )


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ConfigError(f"scrambler kind must be one of {KINDS}, got {kind!r}")
    return kind


__all__: Sequence[str] = (
    "DEFAULT_KIND",
    "DEFAULT_SCALING_RANGE",
    "KINDS",
    "AttentionKeys",
    "KeyLedger",
    "LocalRandomness",
    "PairRandomness",
    "Scrambler",
    "ScramblerKeyReuse",
    "draw_attention_keys",
    "draw_scrambler",
    "hadamard",
    "key_purpose",
    "token_permutation",
)
