"""Crypto backends behind one interface: ``simulate`` (plaintext stand-in), ``ckks`` (TenSEAL).

Layers, bottom up (a module imports only layers below its own; no cycle, late imports included;
``tests/test_packaging.py`` checks the package's place among the library's floors):

1. **The backend seam and the plaintext backend**: :mod:`~fedfm.crypto.backend` (a data owner's
   :class:`KeyOwner`, an :class:`Evaluator` that only holds public bytes, client-assisted work as
   generators), :mod:`~fedfm.crypto.simulate`, :mod:`~fedfm.crypto.params` (the CKKS parameter
   sets and their 128-bit security check), :mod:`~fedfm.crypto.randomness` (a party's secret
   randomness: a keyed stream cipher).
2. **SEAL objects as numbers**: :mod:`~fedfm.crypto.seal_memory` (coefficients in SEAL's memory),
   :mod:`~fedfm.crypto.seal_raw` (the wire format, files, residues; the memory path's self-test),
   :mod:`~fedfm.crypto.rns_linear` (exact linear layers on residues).
3. **CKKS machinery**: :mod:`~fedfm.crypto.workers` (the process pool: it runs module-level jobs
   and imports no crypto module), :mod:`~fedfm.crypto.refresh` (masked client-assisted refresh
   and its pool jobs), :mod:`~fedfm.crypto.circuit` (the instrumented evaluator; its worker pool
   is injected as a :class:`~fedfm.crypto.circuit.SegmentRunner`, its pool jobs live beside it).
4. **The models on ciphertexts**: :mod:`~fedfm.crypto.packing` (slot layout),
   :mod:`~fedfm.crypto.benes` (permutation networks), :mod:`~fedfm.crypto.ckks_vit` (ViT
   blocks), :mod:`~fedfm.crypto.ckks_text` (BERT-family blocks, on ckks_vit's parts).
5. **The CKKS backend** :mod:`~fedfm.crypto.ckks`, and this package: :func:`get_backend`.

The public API is what this package exports: the backend seam, the backends and parameter sets,
and the CKKS building blocks other protocols use (HELIX imports nothing else): contexts
(:func:`context_from_bytes`, :func:`public_context_bytes`, :func:`check_context_parameters`,
:func:`context_fingerprint`), ciphertext lists on the wire (:func:`list_payload`,
:func:`load_list`) and raw access to SEAL objects (:class:`SealIO`).
"""

from collections.abc import Callable

from fedfm.crypto.backend import (
    CryptoBackend,
    EncryptedBatch,
    Evaluator,
    KeyOwner,
    ModelGeometry,
    run_locally,
)
from fedfm.crypto.ckks import (
    CkksBackend,
    check_context_parameters,
    context_fingerprint,
    context_from_bytes,
    list_payload,
    load_list,
    public_context_bytes,
)
from fedfm.crypto.params import CKKS_8192, CKKS_8192_REFRESH, CKKS_16384, CkksParameters
from fedfm.crypto.seal_raw import SealIO
from fedfm.crypto.simulate import SimulateBackend
from fedfm.errors import ConfigError

BACKENDS: dict[str, Callable[[], CryptoBackend]] = {
    "simulate": SimulateBackend,
    # N = 16384: seven rescales between refreshes (the default for encrypted runs).
    "ckks": lambda: CkksBackend(CKKS_16384, name="ckks"),
    # N = 8192: one rescale between refreshes; smaller keys, many more round trips (CI runs).
    "ckks-8192": lambda: CkksBackend(CKKS_8192_REFRESH, name="ckks-8192"),
}


def get_backend(name: str) -> CryptoBackend:
    """The backend called ``name``; a clear error lists the available ones."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ConfigError(
            f"unknown crypto backend {name!r}; available: {sorted(BACKENDS)}"
        ) from None
    return factory()


__all__ = [
    "BACKENDS",
    "CKKS_8192",
    "CKKS_8192_REFRESH",
    "CKKS_16384",
    "CkksBackend",
    "CkksParameters",
    "CryptoBackend",
    "EncryptedBatch",
    "Evaluator",
    "KeyOwner",
    "ModelGeometry",
    "SealIO",
    "SimulateBackend",
    "check_context_parameters",
    "context_fingerprint",
    "context_from_bytes",
    "get_backend",
    "list_payload",
    "load_list",
    "public_context_bytes",
    "run_locally",
]
