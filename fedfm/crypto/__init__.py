"""Crypto backends behind one interface: ``simulate`` (plaintext stand-in), ``ckks`` (TenSEAL)."""

from collections.abc import Callable

from fedfm.crypto.backend import (
    CryptoBackend,
    EncryptedBatch,
    Evaluator,
    KeyOwner,
    ModelGeometry,
    run_locally,
)
from fedfm.crypto.ckks import CkksBackend
from fedfm.crypto.params import CKKS_8192, CKKS_8192_REFRESH, CKKS_16384, CkksParameters
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
    "SimulateBackend",
    "get_backend",
    "run_locally",
]
