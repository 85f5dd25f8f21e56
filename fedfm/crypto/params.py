"""CKKS parameter sets: the one place their numbers live.

Bit budgets follow the HomomorphicEncryption.org security standard (Albrecht et al., 2018,
Table 1, classical 128-bit security, ternary secret): the total coefficient-modulus size of a
ring of degree N may not exceed ``MAX_MODULUS_BITS_128[N]``.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from fedfm.errors import CryptoParameterError

_LOG = logging.getLogger(__name__)

MAX_MODULUS_BITS_128: dict[int, int] = {
    1024: 27,
    2048: 54,
    4096: 109,
    8192: 218,
    16384: 438,
    32768: 881,
}


# A masked refresh is calibrated for decoded slot values up to 2^REFRESH_VALUE_BITS: every
# unmasked coefficient is then below 2^(scale_bits + REFRESH_VALUE_BITS), the bound the data
# owner checks and the run's statistical-distance budget is accounted with
# (fedfm.crypto.refresh.RefreshBound). On all 1,797 digits the distilled student's softmax
# numerators reach 2^15.5 and their sums 2^15.8 (blocks 3 and 4, logits up to 17: the Taylor exp
# far outside its [-4, 4]); 2^17 leaves a factor of 2.3. (2^14, calibrated on 64 test images,
# made honest clients refuse about one refresh in three rounds: docs/ckks.md, "Masked refreshes".)
REFRESH_VALUE_BITS = 17
# A run's masked refreshes stay within statistical distance 2^-RUN_BUDGET_BITS of masks alone.
RUN_BUDGET_BITS = 40
# A refresh level of the chain's first two primes (three in CKKS_16384: fedfm.crypto.refresh).
REFRESH_PRIMES = 2
# Released ciphertexts (what the server sends the key holder besides masked refreshes) are
# flooded with a rounded Gaussian of standard deviation 2^FLOOD_BITS per coefficient: at scale
# 2^40 and N = 8192 that is a slot error of standard deviation 2^FLOOD_BITS * 64 / 2^40
# (docs/ckks.md, "Circuit privacy").
FLOOD_BITS = 20


@dataclass(frozen=True)
class CkksParameters:
    """A CKKS parameter set: ring degree, coefficient-modulus chain and scale.

    ``refresh_value_bits`` and ``flood_bits`` are the masked refresh's calibrated value bound
    and the release's flooding noise (:data:`REFRESH_VALUE_BITS`, :data:`FLOOD_BITS`);
    ``refresh_primes`` the primes at the start of the chain kept for the refresh mask;
    ``run_budget_bits`` the run's refresh budget, ``2^-run_budget_bits`` (:data:`RUN_BUDGET_BITS`).
    """

    poly_modulus_degree: int
    coeff_mod_bit_sizes: tuple[int, ...]
    scale_bits: int
    refresh_value_bits: int = REFRESH_VALUE_BITS
    flood_bits: int = FLOOD_BITS
    refresh_primes: int = REFRESH_PRIMES
    run_budget_bits: int = RUN_BUDGET_BITS

    def __post_init__(self) -> None:
        if self.poly_modulus_degree not in MAX_MODULUS_BITS_128:
            raise CryptoParameterError(
                f"poly_modulus_degree must be one of {sorted(MAX_MODULUS_BITS_128)}, "
                f"got {self.poly_modulus_degree}"
            )
        if len(self.coeff_mod_bit_sizes) < 2:
            raise CryptoParameterError("the coefficient-modulus chain needs at least two primes")

    @property
    def slots(self) -> int:
        """Values one ciphertext packs."""
        return self.poly_modulus_degree // 2

    @property
    def depth(self) -> int:
        """Multiplications (rescales) a fresh ciphertext supports: primes between the first/last."""
        return len(self.coeff_mod_bit_sizes) - 2

    @property
    def levels_between_refreshes(self) -> int:
        """Rescales between two masked refreshes: the refresh level's primes stay for the mask."""
        return len(self.coeff_mod_bit_sizes) - 1 - self.refresh_primes

    @property
    def modulus_bits(self) -> int:
        return sum(self.coeff_mod_bit_sizes)

    @property
    def secure_128(self) -> bool:
        return self.modulus_bits <= MAX_MODULUS_BITS_128[self.poly_modulus_degree]

    @property
    def ciphertext_bytes(self) -> int:
        """Size of a fresh ciphertext: two polynomials of N 64-bit words per data prime."""
        return 2 * self.poly_modulus_degree * 8 * (len(self.coeff_mod_bit_sizes) - 1)

    def ciphertexts_for(self, values: int) -> int:
        """Ciphertexts needed to pack ``values`` numbers."""
        return -(-values // self.slots)

    def samples_per_set(self, tokens: int) -> int:
        """Samples of ``tokens`` tokens one ciphertext per feature holds
        (:func:`samples_per_ciphertext` with this set's slots)."""
        return samples_per_ciphertext(self.slots, tokens)

    def check_secure(self) -> None:
        """Raise :class:`CryptoParameterError` unless the set meets 128-bit security."""
        if not self.secure_128:
            raise CryptoParameterError(
                f"CKKS parameters with N={self.poly_modulus_degree} and a {self.modulus_bits}-bit "
                f"modulus are below 128-bit security (at most "
                f"{MAX_MODULUS_BITS_128[self.poly_modulus_degree]} bits allowed)"
            )

    def accept(self, *, allow_insecure: bool = False) -> None:
        """:meth:`check_secure`, or with ``allow_insecure`` (tests only) a loud warning instead."""
        if not allow_insecure:
            self.check_secure()
        elif not self.secure_128:
            message = (
                f"INSECURE CKKS parameters accepted (N={self.poly_modulus_degree}, "
                f"{self.modulus_bits}-bit modulus): for tests only"
            )
            _LOG.warning(message)
            warnings.warn(message, stacklevel=3)


# HELIX's practice (spec 000, Sec. 5.2): N = 8192, [60, 40, 40, 60], scale 2^40: depth 2.
CKKS_8192 = CkksParameters(8192, (60, 40, 40, 60), 40)
# The CKKS backend's default: N = 16384, a refresh level of three primes (60, 60, 58: 178 bits:
# a mask of 2^175 over coefficients up to 2^60, i.e. slot values up to 2^20, keeps a run of 2^62
# refreshed ciphertexts within 2^-40), five 40-bit levels, a 60-bit special prime: 438 bits,
# exactly the 128-bit budget. Five rescales between refreshes.
CKKS_16384 = CkksParameters(
    16384,
    (60, 60, 58, 40, 40, 40, 40, 40, 60),
    40,
    refresh_value_bits=20,
    refresh_primes=3,
)
# The smallest set with a refresh level (N = 8192, CI and benchmarks): q0 q1 of 60 + 58 bits,
# one 40-bit level, a 60-bit special prime: 218 bits, exactly the 128-bit budget. One rescale
# between refreshes. A 118-bit refresh level is all N = 8192 allows: one refreshed ciphertext is
# 2^-46 from masks alone at the calibrated bound, a block of the embedded model 2^-35, so this
# set cannot keep a run within 2^-40; it is rated for 2^-30 (2^16 refreshed ciphertexts per key).
CKKS_8192_REFRESH = CkksParameters(8192, (60, 58, 40, 60), 40, run_budget_bits=30)


def group_slots(tokens: int) -> int:
    """Slots one sample's group takes in the packing of ``tokens`` tokens
    (:mod:`fedfm.crypto.packing`): ``2T - 2`` (its tokens and copies of all but the last two),
    ``2T - 1`` for two tokens, one slot for a single token."""
    if tokens < 1:
        raise CryptoParameterError(f"a sample has at least one token, got {tokens}")
    if tokens == 1:
        return 1
    return 2 * tokens - (1 if tokens == 2 else 2)


def samples_per_ciphertext(slots: int, tokens: int, group: int | None = None) -> int:
    """The largest power of two of sample groups (of ``group`` slots, default
    :func:`group_slots`) that fits ``slots``: a batch up to it takes one ciphertext per feature,
    and an encrypted block costs about the same for any batch up to it."""
    size = group_slots(tokens) if group is None else group
    if not 1 <= size <= slots:
        raise CryptoParameterError(f"a group of {size} slots does not fit {slots} slots")
    return 1 << ((slots // size).bit_length() - 1)
