"""Crypto backends: the ``simulate`` stand-in now, TenSEAL CKKS next, behind one interface."""

from fedfm.crypto.backend import CryptoBackend, EncryptedBatch, Evaluator, KeyOwner
from fedfm.crypto.params import CKKS_8192, CKKS_16384, CkksParameters
from fedfm.crypto.simulate import SimulateBackend
from fedfm.errors import ConfigError

BACKENDS: dict[str, type[CryptoBackend]] = {"simulate": SimulateBackend}


def get_backend(name: str) -> CryptoBackend:
    """The backend called ``name``; a clear error lists the available ones."""
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown crypto backend {name!r}; available: {sorted(BACKENDS)}"
        ) from None


__all__ = [
    "BACKENDS",
    "CKKS_8192",
    "CKKS_16384",
    "CkksParameters",
    "CryptoBackend",
    "EncryptedBatch",
    "Evaluator",
    "KeyOwner",
    "SimulateBackend",
    "get_backend",
]
