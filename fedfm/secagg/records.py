"""Reading and writing the ``(arrays, config)`` records that messages and client state travel in.

Flower carries arrays in an ``ArrayRecord`` and plain values in a ``ConfigRecord``; node ids are
unsigned 64-bit, so they travel as ``uint64`` arrays (a ``ConfigRecord`` int is signed 64-bit) and
byte strings of fixed width as ``uint8`` matrices, one row per item. Every reader checks dtype,
shape and range and raises :class:`ProtocolError` naming the record and the key.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from fedfm.errors import ProtocolError

ConfigValue = int | float | str | bool | bytes
Arrays = dict[str, np.ndarray]
Config = dict[str, ConfigValue]
MAX_NODE_ID = (1 << 64) - 1
MAX_CONFIG_INT = (1 << 63) - 1  # a ConfigRecord int is a signed 64-bit integer


def check_node_id(node_id: int, what: str) -> int:
    """``node_id`` if it is a Flower node id (a positive 64-bit unsigned integer)."""
    if isinstance(node_id, bool) or not isinstance(node_id, int | np.integer):
        raise ProtocolError(f"{what}: node id {node_id!r} is not an integer")
    if not 1 <= int(node_id) <= MAX_NODE_ID:
        raise ProtocolError(f"{what}: node id {node_id} is outside 1..2**64-1")
    return int(node_id)


def check_keys(
    arrays: Mapping[str, np.ndarray],
    config: Mapping[str, ConfigValue],
    *,
    array_keys: Collection[str],
    config_keys: Collection[str],
    prefix: str,
    what: str,
) -> None:
    """Every expected key is present and no unexpected key starting with ``prefix`` is."""
    for kind, record, expected in (
        ("array", arrays, set(array_keys)),
        ("config", config, set(config_keys)),
    ):
        present = {key for key in record if key.startswith(prefix)}
        if missing := sorted(expected - present):
            raise ProtocolError(f"{what}: missing {kind} entries {missing}")
        if unexpected := sorted(present - expected):
            raise ProtocolError(f"{what}: unexpected {kind} entries {unexpected}")


def read_int(config: Mapping[str, ConfigValue], key: str, what: str, *, minimum: int = 0) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what}: {key} must be an int, got {type(value).__name__}")
    if not minimum <= value <= MAX_CONFIG_INT:
        raise ProtocolError(f"{what}: {key}={value} is outside {minimum}..2**63-1")
    return value


def read_float(config: Mapping[str, ConfigValue], key: str, what: str) -> float:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{what}: {key} must be a float, got {type(value).__name__}")
    return float(value)


def read_str(config: Mapping[str, ConfigValue], key: str, what: str) -> str:
    value = config[key]
    if not isinstance(value, str):
        raise ProtocolError(f"{what}: {key} must be a str, got {type(value).__name__}")
    return value


def _array(
    arrays: Mapping[str, np.ndarray], key: str, dtype: type, ndim: int, what: str
) -> np.ndarray:
    array = arrays[key]
    if not isinstance(array, np.ndarray):
        raise ProtocolError(f"{what}: {key} must be a numpy array, got {type(array).__name__}")
    if array.dtype != dtype or array.ndim != ndim:
        raise ProtocolError(
            f"{what}: {key} must be a {ndim}-d {np.dtype(dtype).name} array, got "
            f"{array.ndim}-d {array.dtype.name}"
        )
    return array


def ids_array(node_ids: Iterable[int]) -> np.ndarray:
    return np.array(list(node_ids), dtype=np.uint64).reshape(-1)


def read_ids(arrays: Mapping[str, np.ndarray], key: str, what: str) -> tuple[int, ...]:
    """Node ids stored as a strictly increasing ``uint64`` vector of positive values."""
    ids = tuple(int(i) for i in _array(arrays, key, np.uint64, 1, what))
    if any(i == 0 for i in ids):
        raise ProtocolError(f"{what}: {key} holds node id 0")
    if any(a >= b for a, b in itertools.pairwise(ids)):
        raise ProtocolError(f"{what}: {key} must be strictly increasing (sorted, no repeats)")
    return ids


def read_node_id(arrays: Mapping[str, np.ndarray], key: str, what: str) -> int:
    ids = read_ids(arrays, key, what)
    if len(ids) != 1:
        raise ProtocolError(f"{what}: {key} must hold exactly one node id, got {len(ids)}")
    return ids[0]


def rows_array(rows: Sequence[bytes], width: int) -> np.ndarray:
    """Fixed-width byte strings as a ``(len(rows), width)`` ``uint8`` matrix."""
    if any(len(row) != width for row in rows):
        raise ProtocolError(f"every row must be {width} bytes")
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), width).copy()


def read_rows(
    arrays: Mapping[str, np.ndarray], key: str, count: int, width: int, what: str
) -> tuple[bytes, ...]:
    matrix = _array(arrays, key, np.uint8, 2, what)
    if matrix.shape != (count, width):
        raise ProtocolError(f"{what}: {key} must have shape ({count}, {width}), got {matrix.shape}")
    return tuple(row.tobytes() for row in matrix)


def read_bytes(
    arrays: Mapping[str, np.ndarray], key: str, widths: Collection[int], what: str
) -> bytes:
    """A byte string stored as a ``uint8`` vector whose length is one of ``widths``."""
    vector = _array(arrays, key, np.uint8, 1, what)
    if len(vector) not in widths:
        raise ProtocolError(f"{what}: {key} must be {' or '.join(map(str, widths))} bytes")
    return vector.tobytes()


def bytes_array(value: bytes) -> np.ndarray:
    return np.frombuffer(value, dtype=np.uint8).copy()


def read_uint64_vector(arrays: Mapping[str, np.ndarray], key: str, what: str) -> np.ndarray:
    vector = _array(arrays, key, np.uint64, 1, what)
    if len(vector) == 0:
        raise ProtocolError(f"{what}: {key} is empty")
    return vector


def nbytes(arrays: Mapping[str, np.ndarray], config: Mapping[str, ConfigValue]) -> int:
    """Payload size of a record pair: array bytes plus config values (8 per number)."""
    size = sum(array.nbytes for array in arrays.values())
    for value in config.values():
        size += len(value) if isinstance(value, bytes | str) else 8
    return size
