"""Zero-copy access to the coefficient arrays of SEAL ciphertexts and plaintexts.

TenSEAL's SEAL bindings (``tenseal.sealapi``) give no bulk access to coefficients: an object can
only be ``save``-d to a file (zstd-compressed, about 11 ms for a 2.4 MB ciphertext) and ``load``-ed
back. This module reads and writes the coefficients where SEAL keeps them, through the memory
layout of the C++ objects:

* a pybind11 instance holds the pointer to its C++ value right after the Python object header
  (``simple_value_holder[0]``);
* ``seal::Ciphertext`` starts with ``parms_id`` (4 words), ``is_ntt_form`` (a ``bool`` padded to
  a word), ``size``, ``poly_modulus_degree``, ``coeff_modulus_size``, ``scale`` (``double``),
  ``correction_factor``, then its ``DynArray`` (memory-pool handle: 2 words, ``capacity``,
  ``size``, data pointer);
* ``seal::Plaintext`` starts with ``parms_id``, ``coeff_count``, ``scale``, then its ``DynArray``.

That layout belongs to one build of SEAL and pybind11, so nothing is trusted blindly:
:func:`available` probes it once per process against objects made through SEAL's own ``load``
(every header field and every coefficient must match), and every access checks the header against
the bindings' getters and the array's length before touching memory. If the probe fails, or
``FEDFM_SEAL_MEMORY=0``, callers (:class:`fedfm.crypto.seal_raw.SealIO`) use the file path.

Reads return copies, so no array outlives the object it came from; writes go into objects made
here, after checking that every word is reduced modulo its prime (what SEAL's ``load`` checks).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import tenseal.sealapi as sealapi

from fedfm.errors import ProtocolError

_LOG = logging.getLogger(__name__)
SWITCH_VARIABLE = "FEDFM_SEAL_MEMORY"

# Word offsets of the fields, from the start of the C++ object.
_CT_NTT, _CT_SIZE, _CT_PRIMES, _CT_CORRECTION = 4, 5, 7, 9  # parms_id 0-3, N 6, scale 8
_CT_ARRAY = 10  # DynArray: pool (2 words), capacity, size, data pointer
_PT_PARMS, _PT_COUNT = 0, 4  # scale 5
_PT_ARRAY = 6
_ARRAY_CAPACITY, _ARRAY_SIZE, _ARRAY_DATA = 2, 3, 4
# Words of the C++ objects read here (their full size in this layout).
_CT_WORDS, _PT_WORDS = 15, 11


def _value_address(item: Any) -> int:
    """Address of the C++ object behind a pybind11 instance (after ``ob_refcnt``, ``ob_type``)."""
    return ctypes.c_uint64.from_address(id(item) + 16).value


def _words(address: int, count: int) -> np.ndarray:
    """A ``uint64`` view of ``count`` words at ``address`` (the caller keeps the owner alive)."""
    buffer = (ctypes.c_uint64 * count).from_address(address)
    return np.frombuffer(memoryview(buffer), dtype=np.uint64)


def _array_of(header: np.ndarray, start: int, expected: int) -> int:
    """The data pointer of the ``DynArray`` at word ``start``; checks it holds ``expected``."""
    size = int(header[start + _ARRAY_SIZE])
    if size != expected or int(header[start + _ARRAY_CAPACITY]) < size:
        raise ProtocolError(f"internal: SEAL array holds {size} words, expected {expected}")
    pointer = int(header[start + _ARRAY_DATA])
    if expected and not pointer:
        raise ProtocolError("internal: SEAL array has no data")
    return pointer


def _ciphertext_header(ciphertext: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
    header = _words(_value_address(ciphertext), _CT_WORDS)
    size, degree, primes = (int(word) for word in header[_CT_SIZE : _CT_PRIMES + 1])
    if (size, degree, primes) != (
        ciphertext.size(),
        ciphertext.poly_modulus_degree(),
        ciphertext.coeff_modulus_size(),
    ):
        raise ProtocolError("internal: SEAL ciphertext header does not match its getters")
    return header, (size, primes, degree)


def read_ciphertext_words(ciphertext: Any) -> np.ndarray:
    """A copy of the ciphertext's coefficients, ``uint64`` of shape ``(size, k, N)``."""
    header, shape = _ciphertext_header(ciphertext)
    count = shape[0] * shape[1] * shape[2]
    pointer = _array_of(header, _CT_ARRAY, count)
    return _words(pointer, count).reshape(shape).copy()


def correction_factor(ciphertext: Any) -> int:
    """The ciphertext's ``correction_factor`` (the bindings have no getter for it)."""
    header, _ = _ciphertext_header(ciphertext)
    return int(header[_CT_CORRECTION])


def read_plaintext_words(plaintext: Any) -> np.ndarray:
    """A copy of the plaintext's coefficients, flat ``uint64``."""
    header = _words(_value_address(plaintext), _PT_WORDS)
    count = plaintext.coeff_count()
    if int(header[_PT_COUNT]) != count:
        raise ProtocolError("internal: SEAL plaintext header does not match its getters")
    return _words(_array_of(header, _PT_ARRAY, count), count).copy()


def _check_reduced(data: np.ndarray, primes: list[int]) -> None:
    for index, prime in enumerate(primes):
        if np.any(data[..., index, :] >= np.uint64(prime)):
            raise ProtocolError(f"coefficients are not reduced modulo prime {index} ({prime})")


def new_ciphertext(
    seal_context: Any,
    parms_id: tuple[int, ...],
    primes: list[int],
    is_ntt_form: bool,
    scale: float,
    data: np.ndarray,
    correction_factor: int = 1,
) -> Any:
    """A SEAL ciphertext holding ``data`` (``uint64``, ``(size, k, N)``, reduced per prime)."""
    data = np.ascontiguousarray(data, dtype=np.uint64)
    size, k, degree = data.shape
    if k != len(primes):
        raise ProtocolError(f"ciphertext data has {k} residue rows for {len(primes)} primes")
    _check_reduced(data, primes)
    ciphertext = sealapi.Ciphertext(seal_context, list(parms_id), size)
    ciphertext.resize(seal_context, list(parms_id), size)
    header, shape = _ciphertext_header(ciphertext)
    if shape != (size, k, degree):
        raise ProtocolError(f"ciphertext of shape {data.shape} does not fit this level {shape}")
    pointer = _array_of(header, _CT_ARRAY, data.size)
    ctypes.memmove(pointer, data.ctypes.data, data.nbytes)
    # a bool: only the word's first byte is the field (the rest is padding)
    ctypes.c_uint8.from_address(_value_address(ciphertext) + 8 * _CT_NTT).value = int(is_ntt_form)
    header[_CT_CORRECTION] = np.uint64(correction_factor)
    ciphertext.scale = scale
    return ciphertext


def new_plaintext(
    parms_id: tuple[int, ...], primes: list[int], scale: float, data: np.ndarray
) -> Any:
    """A CKKS plaintext in NTT form holding ``data`` (``uint64``, ``(k, N)``, reduced)."""
    data = np.ascontiguousarray(data, dtype=np.uint64)
    if data.ndim != 2 or data.shape[0] != len(primes):
        raise ProtocolError(
            f"plaintext data of shape {data.shape} does not fit {len(primes)} primes"
        )
    _check_reduced(data, primes)
    plaintext = sealapi.Plaintext(data.size)
    header = _words(_value_address(plaintext), _PT_WORDS)
    pointer = _array_of(header, _PT_ARRAY, data.size)
    ctypes.memmove(pointer, data.ctypes.data, data.nbytes)
    header[_PT_PARMS : _PT_PARMS + 4] = np.asarray(parms_id, dtype=np.uint64)
    plaintext.scale = scale
    return plaintext
