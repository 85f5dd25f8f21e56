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


@dataclass(frozen=True)
class CkksParameters:
    """A CKKS parameter set: ring degree, coefficient-modulus chain and scale."""

    poly_modulus_degree: int
    coeff_mod_bit_sizes: tuple[int, ...]
    scale_bits: int

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
        """Rescales between two masked refreshes: the first two primes stay for the mask."""
        return len(self.coeff_mod_bit_sizes) - 3

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
# The CKKS backend's default: N = 16384, q0 of 58 bits and a 40-bit mask prime (the refresh
# level, 98 bits, holds a mask of 2^95), seven 40-bit levels, a 60-bit special prime: 438 bits,
# exactly the 128-bit budget. Seven rescales between refreshes.
CKKS_16384 = CkksParameters(16384, (58, 40, 40, 40, 40, 40, 40, 40, 40, 60), 40)
# The smallest set with the same refresh level (for tests): one rescale between refreshes.
CKKS_8192_REFRESH = CkksParameters(8192, (58, 40, 40, 60), 40)
