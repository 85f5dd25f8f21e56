"""Client-assisted masked refresh of CKKS ciphertexts (a stand-in for bootstrapping).

When a ciphertext of the client's runs out of levels, the server (:class:`RefreshServer`, public
key only) masks it, the client (:class:`RefreshClient`, secret key) decrypts the masked value and
encrypts it afresh at the top level, and the server removes the mask.

Protocol
--------
The *refresh level* is the level with the chain's first ``k`` primes left (``k = 2``: ``[q0,
q1]``, SEAL chain index 1; ``k = 3`` adds ``q2``); ``q_ref`` is their product. The server

1. mod-switches a copy of the ciphertext down to the refresh level;
2. adds a fresh public-key encryption of zero, so that ``c1`` no longer depends on the server's
   computation (it becomes ``c1 + a u + e1``, pseudorandom under RLWE);
3. adds ``r``, an integer polynomial with coefficients uniform in ``[-B, B]``, ``B = 2^mask_bits``
   (by default the largest with ``2B + T < q_ref / 2``, ``T`` the calibrated coefficient bound
   below), in the **coefficient domain**.

The client decrypts ``x + r`` (``x = m + e``: message, computation error and the zero
encryption's noise), lifts it exactly to an integer polynomial (centered CRT of its residues
modulo the refresh primes; no wrap-around as long as ``|x| < q_ref / 2 - B``, which the range check
below guarantees for every refresh it accepts), reduces that polynomial modulo
every data prime of the top level and encrypts it there (symmetric encryption) with the scale it
came with. The server subtracts ``r`` (encoded at the top level with that scale) and holds a fresh
top-level encryption of ``m + e``: the refresh adds only the client's fresh encryption noise.

Statistical hiding, per run
---------------------------
Each coefficient the client sees is ``x_i + r_i`` with ``r_i`` uniform on ``2B + 1`` integers, so
its distribution is within statistical distance ``|x_i| / (2B + 1)`` of ``r_i`` alone. For uniform
masks that distance adds up over coefficients (it is tight), so a run's bound is

    N x (refreshed ciphertexts of the run) x T / (2B + 1)

where ``T`` bounds ``|x_i|``. :class:`RefreshBound` computes it: ``T = 2^value_bits * scale``
(the *calibrated coefficient bound*: a ciphertext whose decoded slots all stay below
``2^value_bits`` has every coefficient below ``T``, since a coefficient is bounded by the largest
slot times the scale) and ``B`` the largest power of two with ``2B + T < q_ref / 2``.
:class:`RefreshBudget` is the accountant: the server charges it per masked ciphertext and it
refuses (:class:`~fedfm.errors.CryptoParameterError`) the refresh that would take the run past
its budget (:data:`RUN_DISTANCE_BUDGET`, ``2^-40``, unless the parameter set states another:
``ckks-8192`` has no room for it); :meth:`RefreshBound.rated_ciphertexts` is the run length a
parameter set is rated for.

Detection. Only the client sees (masked) values; the server cannot. The client refuses
(:class:`~fedfm.errors.ProtocolError`) a refresh in which any lifted coefficient lies outside
``[-B - T, B + T]``. Couple each ``x_i + r_i`` with a mask-only ``r'_i``: they differ with
probability ``|x_i| / (2B + 1)``, and when they differ ``x_i + r_i`` lies outside ``[-B, B]`` (and,
as ``2B + T < q_ref / 2``, on one side only, without wrapping into the accepted range from the
other), so a difference the client accepts lies in a band of width ``T``: probability at most
``T / (2B + 1)``. Hence the client's whole view (refused refreshes included) is within the
accounted bound plus the probability that it refuses: values beyond the calibration add at most
as much as they make an (open, reported) refusal likely, never silently. What it does not cover:
a client that skips the check (a malicious key holder, which can also feed out-of-range inputs
to inflate values) is bounded by nothing here; the server cannot range-check encrypted values
without zero-knowledge proofs.

Releases (circuit privacy)
--------------------------
Every ciphertext the server sends the key holder other than a masked refresh goes through
:meth:`RefreshServer.release_many`: switched to the lowest level, re-randomised with a fresh
public-key encryption of zero (so ``c1`` is pseudorandom, not a deterministic function of the
client's own polynomials and the server's weights or permutation masks) and *flooded*: a rounded
Gaussian of standard deviation ``sigma = 2^flood_bits`` is added to every coefficient. Two server
computations whose outputs differ by ``d`` (coefficients, before flooding) give views within
statistical distance ``||d||_2 / (sigma sqrt(2 pi))``; what that buys at an affordable ``sigma``
is stated in ``docs/ckks.md``.

Randomness
----------
``r`` and the encryption of zero's ``u`` and ``e1`` come from :func:`secure_random_bytes`: an
AES-256-CTR keystream under a fresh key from ``os.urandom`` per call (a cryptographically secure
generator, about ten times faster than ``os.urandom`` itself for the 0.5 MB a mask takes at
N = 16384). A seeded non-cryptographic generator such as PCG64 would be unsafe here: the client
sees ``x + r`` with ``x`` tiny next to ``r``, i.e. nearly the raw generator output, from which
PCG64's state (and with it every later mask) can be recovered.
The ``rng`` argument (a NumPy ``Generator``) exists for reproducible tests only.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np
import tenseal as ts
import tenseal.sealapi as sealapi
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedfm.crypto.params import FLOOD_BITS as DEFAULT_FLOOD_BITS
from fedfm.crypto.params import REFRESH_PRIMES as DEFAULT_REFRESH_PRIMES
from fedfm.crypto.params import REFRESH_VALUE_BITS as DEFAULT_REFRESH_VALUE_BITS
from fedfm.crypto.params import RUN_BUDGET_BITS
from fedfm.crypto.seal_raw import (
    CIPHERTEXT_SIZE_MAX,
    MixedRadix,
    ParmsId,
    RawCiphertext,
    RawPlaintext,
    SealIO,
    addmod,
    context_data,
    crt_lift_many,
    dumps,
    mulmod,
    parse_ciphertext,
    plaintext_words,
    seal_bytes,
    submod,
)
from fedfm.crypto.workers import CONTEXTS_PER_WORKER, WorkerPool, discard_pool, shared_pool
from fedfm.errors import CryptoParameterError, InvariantError, ProtocolError

_LOG = logging.getLogger(__name__)

# The statistical distance of a key holder's view of all masked refreshes of one run (one
# evaluator, i.e. one data owner's key) from masks alone, at most: what RefreshBudget enforces
# by default (a parameter set may state its own: CkksParameters.run_budget_bits).
RUN_DISTANCE_BUDGET = 2.0**-RUN_BUDGET_BITS
# Errors of the encryption of zero: centered binomial with this parameter (variance 10.5, the
# standard deviation 3.2 of SEAL's errors; |e| <= 21).
ZERO_NOISE_ETA = 21
# |noise| of that encryption, per unit of N: (|e_pk u| + |e1 s|) / q2 + rounding, with
# |e_pk u| + |e1 s| <= 19.2 N + 21 N (SEAL's public-key error is clipped at 6 sigma = 19.2; u
# and s are ternary) and rounding <= 1/2 + N/2: below N in all; 64 N leaves room.
FRESH_NOISE_PER_DEGREE = 64
_WORD = 1 << 64
# Bytes of mask material a server keeps made ahead per data owner.
MASK_MATERIAL_BUDGET = 256 << 20
_SCALE_TOLERANCE = 1e-12

Ciphertext = Any  # sealapi.Ciphertext, or the same SEAL type as held by TenSEAL


@dataclass(frozen=True)
class RefreshBound:
    """What one masked refresh may show the key holder, and the run length that keeps it small.

    Attributes
    ----------
    degree : int
        ``N``: coefficients per ciphertext.
    value_bound : int
        ``T``: the largest unmasked coefficient ``|x_i|`` the client accepts (the calibrated
        coefficient bound, ``2^value_bits * scale``).
    mask_bits : int
        ``log2 B``: masks are uniform on ``[-B, B]``.
    refresh_modulus : int
        ``q_ref``, the product of the refresh level's primes.
    """

    degree: int
    value_bound: int
    mask_bits: int
    refresh_modulus: int

    @classmethod
    def for_modulus(
        cls, degree: int, refresh_modulus: int, value_bound: int, mask_bits: int | None = None
    ) -> RefreshBound:
        """The bound for a refresh level ``q_ref``; ``mask_bits`` defaults to the largest with
        ``2B + T < q_ref / 2`` (then an accepted coefficient never wraps, see the module notes)."""
        half = refresh_modulus // 2
        largest = (half - value_bound - 1) // 2
        if largest < 1:
            raise CryptoParameterError(
                f"no room for the mask: the refresh level's modulus q_ref has "
                f"{refresh_modulus.bit_length()} bits, the value bound alone "
                f"{value_bound.bit_length()}"
            )
        bits = largest.bit_length() - 1 if mask_bits is None else mask_bits
        if bits < 1 or 2 * (1 << bits) + value_bound >= half:
            raise CryptoParameterError(
                f"mask_bits={bits} does not fit the refresh modulus q_ref of "
                f"{refresh_modulus.bit_length()} bits with a value bound of "
                f"2^{math.log2(value_bound):.1f} (need 2B + T < q_ref / 2, so mask_bits <= "
                f"{largest.bit_length() - 1})"
            )
        return cls(degree, value_bound, bits, refresh_modulus)

    @property
    def accepted(self) -> int:
        """``B + T``: the largest lifted coefficient the client accepts."""
        return (1 << self.mask_bits) + self.value_bound

    @property
    def per_coefficient(self) -> float:
        """``T / (2B + 1)``: statistical distance of one accepted coefficient from the mask."""
        return self.value_bound / (2.0 ** (self.mask_bits + 1) + 1)

    @property
    def per_ciphertext(self) -> float:
        """``N T / (2B + 1)``: one refreshed ciphertext (coefficients add up: uniform masks)."""
        return self.degree * self.per_coefficient

    def rated_ciphertexts(self, budget: float = RUN_DISTANCE_BUDGET) -> int:
        """Refreshed ciphertexts a run may have before its bound passes ``budget``."""
        return math.floor(budget / self.per_ciphertext)

    def run_bound(self, ciphertexts: int) -> float:
        """Statistical distance bound of a run of ``ciphertexts`` refreshed ciphertexts."""
        return ciphertexts * self.per_ciphertext

    def describe(self, budget: float = RUN_DISTANCE_BUDGET) -> dict[str, float | int]:
        """The numbers a benchmark records (log2 of the distances)."""
        return {
            "mask_bits": self.mask_bits,
            "refresh_modulus_bits": self.refresh_modulus.bit_length(),
            "value_bound_bits": math.log2(self.value_bound),
            "log2_distance_per_coefficient": math.log2(self.per_coefficient),
            "log2_distance_per_ciphertext": math.log2(self.per_ciphertext),
            "log2_run_budget": math.log2(budget),
            "rated_refreshed_ciphertexts": self.rated_ciphertexts(budget),
        }

    def outside(self, lifted: MixedRadix) -> np.ndarray:
        """Mask of the lifted coefficients outside ``[-(B + T), B + T]`` (what the client
        refuses), exactly, on the mixed-radix digits of the lift."""
        return ~lifted.within(self.accepted)


class RefreshBudget:
    """The run's accountant: refreshed ciphertexts are charged before they are masked, and the
    one that would take the run's statistical distance past ``budget`` is refused.

    Parameters
    ----------
    bound : RefreshBound
        What one refreshed ciphertext may show (:attr:`RefreshBound.per_ciphertext`).
    budget : float
        The run's allowance (default :data:`RUN_DISTANCE_BUDGET`, ``2^-40``).
    """

    def __init__(self, bound: RefreshBound, budget: float = RUN_DISTANCE_BUDGET) -> None:
        if not 0.0 < budget < 1.0:
            raise CryptoParameterError(f"a run's distance budget must be in (0, 1), got {budget}")
        self.bound = bound
        self.budget = budget
        self.rated = bound.rated_ciphertexts(budget)
        if self.rated < 1:
            raise CryptoParameterError(
                f"no room for the mask: one refreshed ciphertext is within statistical distance "
                f"2^{math.log2(bound.per_ciphertext):.1f} of the mask, above the run's budget "
                f"2^{math.log2(budget):.0f}; use a larger refresh level or a smaller value "
                "bound"
            )
        self.charged = 0

    @property
    def spent(self) -> float:
        """The run's statistical distance bound so far."""
        return self.bound.run_bound(self.charged)

    @property
    def remaining(self) -> int:
        """Ciphertexts that may still be refreshed in this run."""
        return self.rated - self.charged

    def charge(self, count: int) -> None:
        """Account for ``count`` more refreshed ciphertexts, or refuse them all."""
        if count < 0:
            raise InvariantError("a negative number of refreshed ciphertexts")
        if self.charged + count > self.rated:
            raise CryptoParameterError(
                f"refresh budget exhausted: this key has had {self.charged} refreshed ciphertexts "
                f"(each within statistical distance 2^{math.log2(self.bound.per_ciphertext):.1f} "
                f"of masks alone); {count} more would take the run past "
                f"2^{math.log2(self.budget):.0f}. The parameter set is rated for {self.rated} per "
                "key and run: run fewer rounds or samples, or use a parameter set with a larger "
                "refresh level"
            )
        self.charged += count


@dataclass(frozen=True, eq=False)
class MaskedCiphertext:
    """What the client receives: a masked, re-randomised ciphertext at the refresh level."""

    ciphertext: sealapi.Ciphertext

    def to_bytes(self) -> bytes:
        """Wire form (:func:`fedfm.crypto.seal_raw.dumps`)."""
        return seal_serialize(self.ciphertext)

    @classmethod
    def from_bytes(cls, context: ts.Context, data: bytes) -> MaskedCiphertext:
        return cls(seal_deserialize(context, data))


@dataclass(frozen=True, eq=False)
class MaskMaterial:
    """One refresh's worth of mask, made before any data is seen (so it can be made ahead).

    ``offset`` is ``Enc_pk(0) + (r, 0)`` at the refresh level, ``negated`` is ``-r`` in NTT form
    at the top level (a plaintext). Each piece is used for one ciphertext, then dropped.
    """

    offset: sealapi.Ciphertext
    negated: sealapi.Plaintext

    def to_bytes(self) -> tuple[bytes, bytes]:
        """Both parts as bytes (to hand material from a worker process to the server): the
        offset in the compact wire form, ``-r`` as its raw residue words."""
        return dumps(self.offset), plaintext_words(self.negated).tobytes()

    @classmethod
    def from_bytes(cls, io: SealIO, parts: tuple[bytes, bytes], top: ParmsId) -> MaskMaterial:
        words = np.frombuffer(parts[1], dtype=np.uint64)
        negated = io.write_plaintext(RawPlaintext(top, 1.0, words))
        return cls(io.load_ciphertext(parts[0]), negated)


@dataclass(frozen=True, eq=False)
class RefreshMask:
    """Kept by the server between masking and unmasking: ``-r`` (NTT form, top level) and the
    scale the refreshed ciphertext must carry."""

    negated: sealapi.Plaintext
    scale: float
    parms_id: ParmsId  # the top level, where the mask is removed


def seal_serialize(ciphertext: Ciphertext) -> bytes:
    """The wire form of ``ciphertext`` (:func:`fedfm.crypto.seal_raw.dumps`)."""
    return dumps(ciphertext)


def seal_deserialize(context: ts.Context, data: bytes) -> sealapi.Ciphertext:
    """The ciphertext ``data`` holds, validated by SEAL against ``context``."""
    io = SealIO(context)
    try:
        return io.load_ciphertext(bytes(data))
    finally:
        io.close()


class _Chain:
    """The modulus chain of a CKKS context: top level, refresh level and their primes.

    The refresh level keeps the chain's first ``refresh_primes`` primes (2 or 3): SEAL chain
    index ``refresh_primes - 1``.
    """

    def __init__(self, context: ts.Context, refresh_primes: int = DEFAULT_REFRESH_PRIMES) -> None:
        self.seal_context = context.seal_context().data
        top = self.seal_context.first_context_data()
        if top.parms().scheme().name != "CKKS":  # TenSEAL and sealapi bind separate enums
            raise CryptoParameterError("masked refresh needs a CKKS context")
        if refresh_primes not in (2, 3):
            raise CryptoParameterError(f"a refresh level has 2 or 3 primes, not {refresh_primes}")
        self.top_parms_id: ParmsId = tuple(top.parms_id())
        self.top_primes = [m.value() for m in top.parms().coeff_modulus()]
        self.degree = top.parms().poly_modulus_degree()
        if len(self.top_primes) <= refresh_primes:
            raise CryptoParameterError(
                f"the modulus chain has {len(self.top_primes)} data prime(s) "
                f"(bits {[p.bit_length() for p in self.top_primes]}): a refresh needs the refresh "
                f"level ({refresh_primes} primes) strictly below the top level, i.e. at least "
                f"{refresh_primes + 1} data primes"
            )
        self.refresh_index = refresh_primes - 1
        levels = {}
        level = top
        while level is not None:
            levels[level.chain_index()] = level
            level = level.next_context_data()
        # One level above the refresh level: encryptions of zero are made there and divided down.
        self.above_refresh_parms_id: ParmsId = tuple(levels[refresh_primes].parms_id())
        self.refresh_parms_id: ParmsId = tuple(levels[self.refresh_index].parms_id())
        # Level 1 (q0, q1) and the lowest (q0 alone), where released ciphertexts are made.
        self.second_parms_id: ParmsId = tuple(levels[1].parms_id())
        self.lowest_parms_id: ParmsId = tuple(levels[0].parms_id())
        self.refresh_primes = [
            m.value() for m in levels[self.refresh_index].parms().coeff_modulus()
        ]
        self.q0 = self.refresh_primes[0]
        # SEAL drops primes from the end, so the refresh primes lead the top level's; the mask's
        # first rows rely on it.
        if self.top_primes[:refresh_primes] != self.refresh_primes:
            raise CryptoParameterError("the refresh level's primes do not lead the top level's")
        self.refresh_modulus = math.prod(self.refresh_primes)

    def level_of(self, ciphertext: Ciphertext) -> int:
        """SEAL chain index of ``ciphertext`` (top = primes - 1, ``[q0]`` = 0)."""
        return context_data(self.seal_context, ciphertext.parms_id()).chain_index()

    def describe(self, level: int) -> str:
        primes = level + 1
        return f"level {level} ({primes} prime{'s' if primes > 1 else ''} left)"

    def check_shape(self, ciphertext: Ciphertext, what: str) -> None:
        if ciphertext.size() != 2 or not ciphertext.is_ntt_form():
            raise ProtocolError(
                f"{what} must be a relinearised (size 2) NTT-form CKKS ciphertext, got size "
                f"{ciphertext.size()}{'' if ciphertext.is_ntt_form() else ' not in NTT form'}"
            )


def sample_uniform_mask(
    degree: int, mask_bits: int, primes: Sequence[int], random_bytes: Callable[[int], bytes]
) -> np.ndarray:
    """Residues modulo each of ``primes`` (shape (len(primes), degree)) of a polynomial ``r``
    with coefficients uniform in ``[-B, B]``, ``B = 2^mask_bits``, from ``random_bytes``.

    ``u = r + B`` is uniform on the ``2B + 1 = 2^(b+1) + 1`` integers ``[0, 2^(b+1)]``:
    rejection sampling of ``b + 2``-bit words (``uint64`` limbs, most significant first),
    keeping those whose top bit is clear or that equal ``2^(b+1)`` (acceptance just over 1/2).
    Exact: no modular bias, every candidate is used or discarded whole.
    """
    if not 1 <= mask_bits <= 250:
        raise CryptoParameterError(f"mask_bits must be in [1, 250], got {mask_bits}")
    width = mask_bits + 2
    limbs = -(-width // 64)
    top_width = width - 64 * (limbs - 1)  # bits in the most significant limb
    kept: list[np.ndarray] = []
    have = 0
    while have < degree:
        count = 2 * (degree - have) + 64
        words = np.frombuffer(random_bytes(8 * limbs * count), dtype="<u8").astype(np.uint64)
        words = words.reshape(limbs, count)
        words[0] >>= np.uint64(64 - top_width)
        top = words[0] >> np.uint64(top_width - 1)
        rest_zero = (words[0] & np.uint64((1 << (top_width - 1)) - 1)) == 0
        for limb in words[1:]:
            rest_zero &= limb == 0
        keep = (top == 0) | rest_zero
        kept.append(words[:, keep])
        have += int(keep.sum())
    chosen = np.concatenate(kept, axis=1)[:, :degree]
    out = []
    for p in primes:
        u = chosen[0] % np.uint64(p)
        for limb in chosen[1:]:
            u = addmod(mulmod(u, _WORD % p, p), limb % np.uint64(p), p)
        out.append(submod(u, np.full_like(u, (1 << mask_bits) % p), p))
    return np.stack(out)


def secure_random_bytes(count: int) -> bytes:
    """``count`` cryptographically secure random bytes: the AES-256-CTR keystream of a fresh
    key and counter block from ``os.urandom``."""
    cipher = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16)))
    return cipher.encryptor().update(bytes(count))


def sample_uniform_residues(
    count: int, degree: int, primes: Sequence[int], random_bytes: Callable[[int], bytes]
) -> np.ndarray:
    """``(count, len(primes), degree)`` residues, each uniform modulo its prime (rejection
    sampling of ``bits(p)``-bit words)."""
    out = np.empty((count, len(primes), degree), dtype=np.uint64)
    needed = count * degree
    for j, prime in enumerate(primes):
        kept: list[np.ndarray] = []
        have = 0
        while have < needed:
            draw = needed - have + needed // 8 + 64
            words = np.frombuffer(random_bytes(8 * draw), dtype="<u8").astype(np.uint64)
            words &= np.uint64((1 << prime.bit_length()) - 1)
            kept.append(words[words < np.uint64(prime)][: needed - have])
            have += kept[-1].size
        out[:, j, :] = np.concatenate(kept).reshape(count, degree)
    return out


def sample_ternary(degree: int, random_bytes: Callable[[int], bytes]) -> np.ndarray:
    """``degree`` integers uniform on ``{-1, 0, 1}`` (bytes below 243 = 3^5, taken mod 3)."""
    out: list[np.ndarray] = []
    have = 0
    while have < degree:
        octets = np.frombuffer(random_bytes(degree - have + 64), dtype=np.uint8)
        kept = octets[octets < 243]
        out.append(kept[: degree - have])
        have += out[-1].size
    return np.concatenate(out).astype(np.int64) % 3 - 1


def sample_centered_binomial(
    degree: int, eta: int, random_bytes: Callable[[int], bytes]
) -> np.ndarray:
    """``degree`` samples of ``popcount(a) - popcount(b)`` for uniform ``eta``-bit ``a, b``."""
    if not 1 <= eta <= 32:
        raise CryptoParameterError(f"eta must be in [1, 32], got {eta}")
    words = np.frombuffer(random_bytes(8 * degree), dtype="<u8").astype(np.uint64)
    low = np.uint64((1 << eta) - 1)
    first = np.bitwise_count(words & low).astype(np.int64)
    second = np.bitwise_count((words >> np.uint64(eta)) & low).astype(np.int64)
    return first - second


def sample_rounded_gaussian(
    degree: int, sigma: float, random_bytes: Callable[[int], bytes]
) -> np.ndarray:
    """``degree`` integers ``round(sigma * Z)``, ``Z`` standard normal (Box-Muller on 53-bit
    uniforms: the tails are cut at ``8.6 sigma``, a mass below ``2^-55``)."""
    if not 0.0 < sigma < 2.0**52:
        raise CryptoParameterError(f"sigma must be in (0, 2^52), got {sigma}")
    words = np.frombuffer(random_bytes(16 * degree), dtype="<u8").astype(np.uint64)
    first = ((words[:degree] >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0**-53
    second = (words[degree:] >> np.uint64(11)).astype(np.float64) * 2.0**-53
    normal = np.sqrt(-2.0 * np.log(first)) * np.cos(2.0 * np.pi * second)
    return np.rint(sigma * normal).astype(np.int64)


def _residues(values: np.ndarray, primes: Sequence[int]) -> np.ndarray:
    """Small signed integers as residues modulo each prime: shape ``(len(primes), len(values))``."""
    return np.stack([np.where(values < 0, values + p, values).astype(np.uint64) for p in primes])


def refresh_bound(
    context: ts.Context, chain: _Chain, value_bits: int, mask_bits: int | None = None
) -> RefreshBound:
    """The :class:`RefreshBound` of ``context``'s refresh level for a calibrated bound of
    ``2^value_bits`` at the context's scale (the same on both sides of a refresh)."""
    try:
        scale = float(context.global_scale)
    except ValueError:  # TenSEAL: "no global scale"
        raise CryptoParameterError(
            "the refresh bound needs the context's scale (set global_scale)"
        ) from None
    if not 0 <= value_bits <= 64:
        raise CryptoParameterError(f"value_bits must be in [0, 64], got {value_bits}")
    value_bound = int(scale) << value_bits
    return RefreshBound.for_modulus(chain.degree, chain.refresh_modulus, value_bound, mask_bits)


class _OnChain:
    """Shared by both sides: the levels a refresh goes between."""

    _chain: _Chain

    @property
    def refresh_parms_id(self) -> ParmsId:
        return self._chain.refresh_parms_id

    @property
    def top_parms_id(self) -> ParmsId:
        return self._chain.top_parms_id


class RefreshServer(_OnChain):
    """The evaluating party's side: masks ciphertexts and unmasks refreshed ones.

    Parameters
    ----------
    context : ts.Context
        The client's *public* context (public key, no secret key).
    value_bits : int
        The calibrated bound: every unmasked coefficient of a refreshed ciphertext is at most
        ``T = 2^value_bits * scale`` (:class:`RefreshBound`; the client refuses larger ones).
    flood_bits : int
        ``log2`` of the standard deviation of the noise :meth:`release_many` floods with; ``0``
        releases without flooding (re-randomised only: what the attack tests compare against).
    mask_bits : int, optional
        ``log2 B``; default the largest with ``2B + T < q_ref / 2``.
    refresh_primes : int
        Primes of the refresh level (2 or 3), as in the parameter set.
    budget : float
        The run's statistical-distance allowance for all its refreshes (:class:`RefreshBudget`).
    rng : numpy.random.Generator, optional
        Deterministic mask source for tests only (not secure); default ``os.urandom``.
    workers : int
        With ``2`` or more, the process's worker pool (:mod:`fedfm.crypto.workers`) makes mask
        material ahead of time (:meth:`mask_many` takes it) while the server evaluates.

    Not thread-safe (one scratch file per instance).
    """

    def __init__(
        self,
        context: ts.Context,
        *,
        value_bits: int = DEFAULT_REFRESH_VALUE_BITS,
        flood_bits: int = DEFAULT_FLOOD_BITS,
        refresh_primes: int = DEFAULT_REFRESH_PRIMES,
        mask_bits: int | None = None,
        budget: float = RUN_DISTANCE_BUDGET,
        rng: np.random.Generator | None = None,
        workers: int = 0,
    ) -> None:
        if context.is_private():
            raise CryptoParameterError(
                "refusing a context that carries the secret key: the server needs the public one"
            )
        if not context.has_public_key():
            raise CryptoParameterError("the server's context lacks the public key")
        self._chain = _Chain(context, refresh_primes)
        self.bound = refresh_bound(context, self._chain, value_bits, mask_bits)
        self.budget = RefreshBudget(self.bound, budget)
        if not 0 <= flood_bits <= 50:
            raise CryptoParameterError(f"flood_bits must be in [0, 50], got {flood_bits}")
        self.flood_bits = flood_bits
        self._random_bytes: Callable[[int], bytes] = (
            secure_random_bytes if rng is None else rng.bytes
        )
        seal_context = self._chain.seal_context
        self._evaluator = sealapi.Evaluator(seal_context)
        self._io = SealIO(seal_context)
        # The public key's residues modulo the first k + 1 primes (its first rows: SEAL's key
        # level holds the data primes in chain order, then the special prime) are the public key
        # of the level above the refresh level (k primes), where encryptions of zero are made
        # directly; its rows modulo q0, q1 that of level 1, where a release's are made.
        key = parse_ciphertext(seal_bytes(context.public_key().data.data()))
        above = refresh_primes + 1
        self._public_key = self._io.write_ciphertext(
            RawCiphertext(self._chain.above_refresh_parms_id, True, 1.0, key.data[:, :above])
        )
        self._public_key_low = self._io.write_ciphertext(
            RawCiphertext(self._chain.second_parms_id, True, 1.0, key.data[:, :2])
        )
        self._refresh_primes = refresh_primes
        self.public_context_bytes = context.serialize(
            save_public_key=True,
            save_secret_key=False,
            save_galois_keys=False,
            save_relin_keys=False,
        )
        self._value_bits = value_bits
        pool = None if rng is not None else shared_pool(workers)
        self._supply = None if pool is None else _MaskSupply(self, pool)

    @property
    def mask_bits(self) -> int:
        """``log2 B``: mask coefficients are uniform in ``[-B, B]``."""
        return self.bound.mask_bits

    @property
    def refresh_primes(self) -> int:
        """Primes of the refresh level."""
        return self._refresh_primes

    @property
    def refresh_index(self) -> int:
        """SEAL chain index of the refresh level (``refresh_primes - 1``)."""
        return self._chain.refresh_index

    @property
    def value_bits(self) -> int:
        """``log2`` of the calibrated slot bound (``T = 2^value_bits * scale``)."""
        return self._value_bits

    @property
    def worker_material(self) -> int:
        """Pieces of mask material the worker process made so far (0 without a worker)."""
        return 0 if self._supply is None else self._supply.supplied

    def prepare(self) -> MaskMaterial:
        """Fresh mask material: a new ``r`` and a new encryption of zero (no data involved).

        The offset is ``Enc(0) + (r, 0)`` at the refresh level. ``Enc(0)`` is made as SEAL makes
        one, at less than half the cost: ``(pk0 u, pk1 u + e1)`` one level up, with ternary ``u``
        and centered binomial ``e1`` (:data:`ZERO_NOISE_ETA`), divided by that level's last
        prime (which divides its noise ``u e_pk + e1 s`` too). ``c0`` needs no error term of its
        own: the client's view is ``c1`` and the decryption, where ``r`` covers everything.
        """
        chain, degree = self._chain, self._chain.degree
        limbs = sample_uniform_mask(degree, self.mask_bits, chain.top_primes, self._random_bytes)
        small = [
            sample_ternary(degree, self._random_bytes),
            sample_centered_binomial(degree, ZERO_NOISE_ETA, self._random_bytes),
        ]
        polys = np.stack([limbs, *(_residues(values, chain.top_primes) for values in small)])
        # One batch of NTTs at the top level serves every level: lower levels' primes lead the
        # top level's, and SEAL's transform of a residue row depends only on its prime.
        r, u, e1 = self._io.to_ntt(chain.top_parms_id, polys)
        above, k = chain.above_refresh_parms_id, self._refresh_primes
        u_plain = self._io.write_plaintext(RawPlaintext(above, 1.0, u[: k + 1]))
        offset = sealapi.Ciphertext(chain.seal_context)
        self._evaluator.multiply_plain(self._public_key, u_plain, offset)
        rows = e1[: k + 1]
        error = RawCiphertext(above, True, 1.0, np.stack([np.zeros_like(rows), rows]))
        self._evaluator.add_inplace(offset, self._io.write_ciphertext(error))
        offset.scale = float(chain.top_primes[k])  # the division leaves scale 1
        self._evaluator.rescale_to_next_inplace(offset)
        offset.scale = 1.0
        self._io.add_ntt_inplace(offset, r[:k])
        negated = np.stack(
            [submod(np.zeros_like(row), row, p) for row, p in zip(r, chain.top_primes, strict=True)]
        )
        negated_plain = self._io.write_plaintext(RawPlaintext(chain.top_parms_id, 1.0, negated))
        return MaskMaterial(offset, negated_plain)

    def mask_many(
        self, ciphertexts: Sequence[Ciphertext]
    ) -> list[tuple[MaskedCiphertext, RefreshMask]]:
        """:meth:`mask` for several ciphertexts, with material made ahead by the worker if any.

        The run's accountant is charged first: a refresh that would take the run past its
        statistical-distance budget is refused before anything is masked.
        """
        self.budget.charge(len(ciphertexts))
        supply = self._supply
        materials = [None] * len(ciphertexts) if supply is None else supply.take(len(ciphertexts))
        if supply is not None:
            supply.pause()  # the workers are about to be needed for the refresh itself
        return [
            self._mask(ct, material) for ct, material in zip(ciphertexts, materials, strict=True)
        ]

    def mask(
        self, ciphertext: Ciphertext, material: MaskMaterial | None = None
    ) -> tuple[MaskedCiphertext, RefreshMask]:
        """Mask ``ciphertext`` for the client; keep the returned mask to :meth:`unmask` later.

        ``material`` (from :meth:`prepare`, possibly in another process) is used once. The
        run's accountant is charged for it (:meth:`mask_many`).
        """
        self.budget.charge(1)
        return self._mask(ciphertext, material)

    def _mask(
        self, ciphertext: Ciphertext, material: MaskMaterial | None = None
    ) -> tuple[MaskedCiphertext, RefreshMask]:
        chain = self._chain
        chain.check_shape(ciphertext, "a ciphertext to refresh")
        level = chain.level_of(ciphertext)
        if level < chain.refresh_index:
            raise ProtocolError(
                f"ciphertext at {chain.describe(level)} is below the refresh level "
                f"({chain.describe(chain.refresh_index)}): it has no room for the mask; refresh "
                "before it gets there"
            )
        material = material or self.prepare()
        masked = sealapi.Ciphertext(chain.seal_context)
        self._evaluator.mod_switch_to(ciphertext, list(chain.refresh_parms_id), masked)
        # an encryption of zero has scale 1; SEAL checks that the scales of a sum match
        material.offset.scale = masked.scale
        self._evaluator.add_inplace(masked, material.offset)
        mask = RefreshMask(material.negated, masked.scale, chain.top_parms_id)
        return MaskedCiphertext(masked), mask

    def release_many(self, ciphertexts: Sequence[Ciphertext]) -> list[sealapi.Ciphertext]:
        """``ciphertexts`` as they may leave for the key holder (besides masked refreshes):
        at the lowest level, re-randomised and flooded (new ciphertexts; circuit privacy).

        Each is switched to the lowest level (one prime: the key holder only decrypts, and the
        message is a fraction of ``q0``), then gets a fresh public-key encryption of zero made
        one level up and divided down (as :meth:`prepare` makes the mask's), so that ``c1`` is
        pseudorandom under RLWE instead of a function of the client's own polynomials, and a
        rounded Gaussian of standard deviation ``2^flood_bits`` on every coefficient of ``c0``,
        which hides how the server computed the value below that noise.
        """
        chain, degree = self._chain, self._chain.degree
        lowest, low = chain.lowest_parms_id, chain.second_parms_id
        q0 = chain.top_primes[0]
        out = []
        for ciphertext in ciphertexts:
            chain.check_shape(ciphertext, "a ciphertext to release")
            if chain.level_of(ciphertext) < 1:
                raise ProtocolError("a released ciphertext must be at level 1 (q0, q1) or above")
            small = [
                sample_ternary(degree, self._random_bytes),
                sample_centered_binomial(degree, ZERO_NOISE_ETA, self._random_bytes),
            ]
            polys = np.stack([_residues(values, chain.top_primes[:2]) for values in small])
            u, e1 = self._io.to_ntt(low, polys)
            zero = sealapi.Ciphertext(chain.seal_context)
            self._evaluator.multiply_plain(
                self._public_key_low, self._io.write_plaintext(RawPlaintext(low, 1.0, u)), zero
            )
            error = RawCiphertext(low, True, 1.0, np.stack([np.zeros_like(e1), e1]))
            self._evaluator.add_inplace(zero, self._io.write_ciphertext(error))
            zero.scale = float(chain.top_primes[1])  # the division leaves scale 1
            self._evaluator.rescale_to_next_inplace(zero)
            if self.flood_bits:
                flood = sample_rounded_gaussian(degree, 2.0**self.flood_bits, self._random_bytes)
                self._io.add_ntt_inplace(
                    zero, self._io.to_ntt(lowest, _residues(flood, [q0])[None])[0]
                )
            released = sealapi.Ciphertext(chain.seal_context)
            self._evaluator.mod_switch_to(ciphertext, list(lowest), released)
            zero.scale = released.scale
            self._evaluator.add_inplace(released, zero)
            out.append(released)
        return out

    def hold_material(self) -> None:
        """Withdraw unstarted mask material jobs: the workers are wanted for something else."""
        if self._supply is not None:
            self._supply.pause()

    def resume_material(self) -> None:
        """Have the workers make mask material again (after :meth:`hold_material`)."""
        if self._supply is not None:
            self._supply.top_up()

    def unmask_many(
        self, fresh: Sequence[Ciphertext], masks: Sequence[RefreshMask]
    ) -> list[sealapi.Ciphertext]:
        """:meth:`unmask` for several ciphertexts; then the worker makes the next material
        (while the server computes, not while the client refreshes on the same machine)."""
        if len(fresh) != len(masks):
            raise ProtocolError(f"refresh returned {len(fresh)} ciphertexts for {len(masks)}")
        out = [self.unmask(ct, mask) for ct, mask in zip(fresh, masks, strict=True)]
        if self._supply is not None:
            self._supply.top_up()
        return out

    def unmask(self, fresh: Ciphertext, mask: RefreshMask) -> sealapi.Ciphertext:
        """Subtract ``mask`` from the client's fresh top-level ciphertext (a new ciphertext)."""
        chain = self._chain
        chain.check_shape(fresh, "a refreshed ciphertext")
        if tuple(fresh.parms_id()) != mask.parms_id or mask.parms_id != chain.top_parms_id:
            raise ProtocolError(
                f"refreshed ciphertext is at {chain.describe(chain.level_of(fresh))}, expected "
                f"the top level ({chain.describe(len(chain.top_primes) - 1)})"
            )
        if not math.isclose(fresh.scale, mask.scale, rel_tol=_SCALE_TOLERANCE):
            raise ProtocolError(
                f"refreshed ciphertext has scale 2^{math.log2(fresh.scale):.6f}, but the mask was "
                f"applied at scale 2^{math.log2(mask.scale):.6f}"
            )
        mask.negated.scale = fresh.scale
        result = sealapi.Ciphertext(chain.seal_context)
        self._evaluator.add_plain(fresh, mask.negated, result)
        return result


class _MaskSupply:
    """Mask material made ahead by the worker pool: as many pieces in flight or ready as
    :data:`MASK_MATERIAL_BUDGET` holds (about 550 at N = 8192, 150 at N = 16384)."""

    def __init__(self, server: RefreshServer, pool: WorkerPool) -> None:
        self._public = server.public_context_bytes
        self._server = server
        self._workers: WorkerPool | None = pool
        self._chunk = 16
        chain = server._chain
        # one piece: (r, 0) + Enc(0) at the refresh level and -r at the top level, in words
        words = (2 * 2 + len(chain.top_primes)) * chain.degree
        self._ahead = max(self._chunk, MASK_MATERIAL_BUDGET // (8 * words))
        self.supplied = 0  # pieces the worker made (the rest were made in-process)
        self._ready: deque[MaskMaterial] = deque()
        self._pending: deque[Future[list[tuple[bytes, bytes]]]] = deque()
        self.top_up()

    def top_up(self) -> None:
        """Ask the worker for material until ``ahead`` pieces are ready or in flight."""
        while self._workers is not None and (
            len(self._ready) + self._chunk * len(self._pending) < self._ahead
        ):
            try:
                self._pending.append(
                    self._workers.submit(
                        mask_material_blobs,
                        self._public,
                        self._server.mask_bits,
                        self._server.value_bits,
                        self._server.refresh_primes,
                        self._chunk,
                    )
                )
            except BrokenProcessPool as error:
                self._fail(error)

    def pause(self) -> None:
        """Withdraw the requests no worker has started, so that a refresh sent to the same pool
        (a data owner on this machine) does not queue behind them; :meth:`top_up` resumes."""
        self._pending = deque(future for future in self._pending if not future.cancel())

    def take(self, count: int) -> list[MaskMaterial | None]:
        """``count`` pieces of material; ``None`` (made on the spot) once the worker fails."""
        out: list[MaskMaterial | None] = []
        while len(out) < count:
            if self._ready:
                out.append(self._ready.popleft())
            elif self._pending:
                try:
                    parts = self._pending.popleft().result()
                except BrokenProcessPool as error:
                    self._fail(error)
                    continue
                top = self._server.top_parms_id
                self._ready.extend(MaskMaterial.from_bytes(self._server._io, p, top) for p in parts)
                self.supplied += len(parts)
            else:
                out.append(None)
        return out

    def _fail(self, error: BrokenProcessPool) -> None:
        _LOG.warning("mask worker failed (%s); masks are made in-process", error)
        discard_pool()
        self._workers = None
        self._pending.clear()


class RefreshClient(_OnChain):
    """The key owner's side: decrypts masked ciphertexts and re-encrypts them at the top level.

    Not thread-safe (one scratch file per instance).
    """

    def __init__(
        self,
        context: ts.Context,
        *,
        value_bits: int = DEFAULT_REFRESH_VALUE_BITS,
        refresh_primes: int = DEFAULT_REFRESH_PRIMES,
    ) -> None:
        if not context.is_private():
            raise CryptoParameterError("the refresh client needs the context with the secret key")
        self._chain = _Chain(context, refresh_primes)
        # The same bound as the server's (both derive it from the parameter set): what the
        # client accepts, see the module notes on detection.
        self.bound = refresh_bound(context, self._chain, value_bits)
        seal_context = self._chain.seal_context
        secret_key = context.secret_key().data
        self._decryptor = sealapi.Decryptor(seal_context, secret_key)
        self._evaluator = sealapi.Evaluator(seal_context)
        self._io = SealIO(seal_context)
        # s in NTT form at the top level: the key level's rows for the data primes.
        top_rows = len(self._chain.top_primes)
        words = plaintext_words(secret_key.data()).reshape(-1, self._chain.degree)
        self._secret = self._io.write_plaintext(
            RawPlaintext(self._chain.top_parms_id, 1.0, words[:top_rows])
        )

    def _unwrap(self, masked: MaskedCiphertext | Ciphertext) -> Ciphertext:
        ciphertext = masked.ciphertext if isinstance(masked, MaskedCiphertext) else masked
        chain = self._chain
        chain.check_shape(ciphertext, "a masked ciphertext")
        level = chain.level_of(ciphertext)
        if level != chain.refresh_index:
            raise ProtocolError(
                f"refusing to refresh a ciphertext at {chain.describe(level)}: only ciphertexts "
                f"at the refresh level ({chain.describe(chain.refresh_index)}) are masked"
            )
        return ciphertext

    def _lift(self, ciphertexts: Sequence[Ciphertext]) -> MixedRadix:
        """Exact centered integer coefficients of the decryptions, batched: (m, N) each."""
        raws = []
        for ciphertext in ciphertexts:
            plain = sealapi.Plaintext()
            self._decryptor.decrypt(ciphertext, plain)
            raws.append(self._io.read_plaintext(plain).data)
        coeffs = self._io.from_ntt(self._chain.refresh_parms_id, np.stack(raws))
        primes = self._chain.refresh_primes
        return crt_lift_many([coeffs[:, j] for j in range(len(primes))], primes)

    def unmasked(self, ciphertext: Ciphertext) -> np.ndarray:
        """Test and calibration hook: the centered coefficients (``float64``) of ``ciphertext``
        switched to the refresh level, i.e. the ``x`` a mask would hide (for any ciphertext at
        or above the refresh level)."""
        chain = self._chain
        lowered = sealapi.Ciphertext(chain.seal_context)
        self._evaluator.mod_switch_to(ciphertext, list(chain.refresh_parms_id), lowered)
        return self._lift([lowered]).to_float()[0]

    def observe(self, masked: MaskedCiphertext | Ciphertext) -> np.ndarray:
        """The centered integer coefficients the client decrypts (object array of ``int``)."""
        return self._lift([self._unwrap(masked)]).to_int()[0]

    def refresh(self, masked: MaskedCiphertext | Ciphertext) -> sealapi.Ciphertext:
        """A fresh top-level encryption, at the same scale, of the masked ciphertext's value."""
        return self.refresh_many([masked])[0]

    def refresh_many(
        self, masked: Sequence[MaskedCiphertext | Ciphertext]
    ) -> list[sealapi.Ciphertext]:
        """:meth:`refresh` for several ciphertexts, with batched NTTs through SEAL."""
        ciphertexts = [self._unwrap(item) for item in masked]
        if not ciphertexts:
            return []
        chain = self._chain
        primes, top = chain.top_primes, chain.top_parms_id
        mixed = self._lift(ciphertexts)
        self._check_range(mixed)
        lifted = mixed.residues(primes)  # (k_top, m, N)
        # Symmetric encryption, batched: (NTT(y + e) - a s, a) with a uniform (sampled in the
        # NTT domain, where it is just as uniform) and e centered binomial, as SEAL's
        # encrypt_symmetric but with the polynomial y entering in coefficient form.
        count, degree = len(ciphertexts), chain.degree
        errors = sample_centered_binomial(count * degree, ZERO_NOISE_ETA, secure_random_bytes)
        errors = _residues(errors, primes).reshape(len(primes), count, degree)
        moduli = np.asarray(primes, dtype=np.uint64)[:, None, None]  # below 2^60: sums fit
        messages = ((lifted + errors) % moduli).transpose(1, 0, 2)
        polys = self._io.to_ntt(top, messages)
        uniform = sample_uniform_residues(count, degree, primes, secure_random_bytes)
        moduli = moduli.transpose(1, 0, 2)
        firsts = (polys + (moduli - self._times_secret(uniform))) % moduli
        return [
            self._io.write_ciphertext(RawCiphertext(top, True, source.scale, np.stack([c0, a])))
            for c0, a, source in zip(firsts, uniform, ciphertexts, strict=True)
        ]

    def _check_range(self, lifted: MixedRadix) -> None:
        """Refuse the refresh if any lifted coefficient lies outside ``[-(B + T), B + T]``: the
        server's values exceed the calibrated bound its refresh budget is accounted with."""
        outside = self.bound.outside(lifted)
        if outside.any():
            # How many coefficients and how far out stay with the client: the server knows the
            # mask, so either figure would tell it about the value under the mask.
            raise ProtocolError(
                f"refusing a refresh: masked coefficients lie outside [-(B + T), B + T] (B = "
                f"2^{self.bound.mask_bits}, T = 2^{math.log2(self.bound.value_bound):.0f}): the "
                "server's values exceed the calibrated bound its refresh budget assumes, so "
                "answering would show them beyond that budget"
            )

    def _times_secret(self, polys: np.ndarray) -> np.ndarray:
        """``poly * s`` for NTT-form top-level polynomials ``polys`` (m, k, N), batched in
        SEAL's ``multiply_plain`` (a scratch ciphertext carries up to 16 polynomials)."""
        top = self._chain.top_parms_id
        out = np.empty_like(polys)
        for start in range(0, len(polys), CIPHERTEXT_SIZE_MAX):
            block = polys[start : start + CIPHERTEXT_SIZE_MAX]
            real = len(block)
            if real == 1:  # a ciphertext has at least two polynomials
                block = np.concatenate([block, block])
            scratch = self._io.write_ciphertext(RawCiphertext(top, True, 1.0, block))
            self._evaluator.multiply_plain_inplace(scratch, self._secret)
            out[start : start + real] = self._io.read_ciphertext(scratch).data[:real]
        return out


def observe_masked(client: RefreshClient, masked: MaskedCiphertext | Ciphertext) -> np.ndarray:
    """Test hook: the centered integer coefficients ``client`` sees when refreshing ``masked``."""
    return client.observe(masked)


# Jobs the worker pool runs (module-level, so that a worker can unpickle them by reference).
# In a worker: the objects built from recently used contexts, most recent last.
# key: (role, SHA-256 of the context, value bits, refresh primes, mask bits)
_LOADED: OrderedDict[tuple[str, bytes, int, int, int], Any] = OrderedDict()


def _loaded(
    role: str, context_bytes: bytes, value_bits: int, refresh_primes: int, mask_bits: int = 0
) -> Any:
    """``(io, refresher)`` for a context, built once per worker and kept while recently used."""
    key = (role, hashlib.sha256(context_bytes).digest(), value_bits, refresh_primes, mask_bits)
    if key in _LOADED:
        _LOADED.move_to_end(key)
        return _LOADED[key]
    context = ts.context_from(context_bytes)
    io = SealIO(context.seal_context().data)
    if role == "client":
        refresher: Any = RefreshClient(
            context, value_bits=value_bits, refresh_primes=refresh_primes
        )
    else:
        refresher = RefreshServer(
            context, value_bits=value_bits, refresh_primes=refresh_primes, mask_bits=mask_bits
        )
    _LOADED[key] = (io, refresher)
    while len(_LOADED) > CONTEXTS_PER_WORKER:
        _LOADED.popitem(last=False)
    return io, refresher


def refresh_blobs(
    context_bytes: bytes,
    blobs: Sequence[bytes],
    value_bits: int = DEFAULT_REFRESH_VALUE_BITS,
    refresh_primes: int = DEFAULT_REFRESH_PRIMES,
) -> list[bytes]:
    """In a worker: masked ciphertexts -> fresh ones (wire forms, :func:`seal_raw.dumps`),
    refused as :meth:`RefreshClient.refresh_many` refuses."""
    io, client = _loaded("client", context_bytes, value_bits, refresh_primes)
    fresh = client.refresh_many([io.load_ciphertext(blob) for blob in blobs])
    return [dumps(ct) for ct in fresh]


def mask_material_blobs(
    context_bytes: bytes, mask_bits: int, value_bits: int, refresh_primes: int, count: int
) -> list[tuple[bytes, bytes]]:
    """In a worker: ``count`` pieces of mask material as bytes (:meth:`MaskMaterial.to_bytes`)."""
    _, server = _loaded("server", context_bytes, value_bits, refresh_primes, mask_bits)
    return [server.prepare().to_bytes() for _ in range(count)]
