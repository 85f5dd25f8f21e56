"""A role's result, published sealed under a key its operator holds (the relay cannot read it).

Shared by the runtime protocols whose result belongs to one party (FedRAG's coordinator,
CENTAUR's client): ChaCha20-Poly1305 (:mod:`fedfm.secagg.channel`) over the packed arrays, with
a label naming the protocol and the role as associated data.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedfm.errors import ConfigError
from fedfm.runtime.payload import pack_arrays, unpack_arrays
from fedfm.secagg.channel import KEY_BYTES, open_sealed, seal


def seal_report(key: bytes, arrays: Mapping[str, np.ndarray], label: bytes) -> np.ndarray:
    """``arrays`` packed and sealed under ``key``, as a uint8 array to publish."""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"a report key must be {KEY_BYTES} bytes, got {len(key)}")
    return np.frombuffer(seal(key, pack_arrays(dict(arrays)), label), dtype=np.uint8)


def open_report(key: bytes, sealed: np.ndarray, label: bytes, what: str) -> dict[str, np.ndarray]:
    """The arrays :func:`seal_report` sealed (:class:`ConfigError`-family error if tampered)."""
    data = np.asarray(sealed, dtype=np.uint8).tobytes()
    return unpack_arrays(open_sealed(key, data, label, what))
