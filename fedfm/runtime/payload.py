"""Named numpy arrays as one byte string, and back: the plaintext a channel seals.

Layout: ``b"FAP1"``, a 4-byte big-endian header length, a JSON header listing
``[name, dtype, shape]`` per array (dtype with its byte order, e.g. ``"<f4"``), then each array's
C-order bytes in header order. Only numeric and boolean dtypes travel: no pickles, so unpacking
bytes from a peer never runs code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from fedfm.errors import ProtocolError

MAGIC = b"FAP1"
_LENGTH_BYTES = 4
_KINDS = "biufc"  # bool, signed, unsigned, float, complex


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``arrays`` as bytes; :class:`ProtocolError` for a dtype that is not numeric or bool."""
    entries, bodies = [], []
    for name, value in arrays.items():
        array = np.asarray(value, order="C")  # keeps 0-d arrays 0-d
        if array.dtype.kind not in _KINDS:
            raise ProtocolError(
                f"array {name!r} has dtype {array.dtype}; messages carry numeric and bool arrays"
            )
        entries.append([name, array.dtype.str, list(array.shape)])
        bodies.append(array.reshape(-1).view(np.uint8).data)  # a view: join makes the only copy
    header = json.dumps(entries, separators=(",", ":")).encode()
    return b"".join([MAGIC, len(header).to_bytes(_LENGTH_BYTES, "big"), header, *bodies])


def unpack_arrays(data: bytes) -> dict[str, np.ndarray]:
    """The arrays :func:`pack_arrays` packed; :class:`ProtocolError` if ``data`` is malformed."""
    start = len(MAGIC) + _LENGTH_BYTES
    if data[: len(MAGIC)] != MAGIC or len(data) < start:
        raise ProtocolError("malformed payload: it does not start with the array header")
    end = start + int.from_bytes(data[len(MAGIC) : start], "big")
    try:
        entries = json.loads(data[start:end])
        arrays, offset = {}, end
        for name, dtype_name, shape in entries:
            dtype = np.dtype(dtype_name)
            if dtype.kind not in _KINDS:
                raise ValueError(f"dtype {dtype} is not numeric")
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"array {name!r} has the invalid shape {shape}")
            count = int(np.prod(shape, dtype=np.int64))
            size = count * dtype.itemsize
            if offset + size > len(data):
                raise ValueError("the arrays are shorter than their header says")
            flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
            arrays[str(name)] = flat.reshape(shape).copy()  # writable, independent of ``data``
            offset += size
    except (ValueError, TypeError) as error:
        raise ProtocolError(f"malformed payload: {error}") from None
    if offset != len(data):
        raise ProtocolError("malformed payload: bytes left over after the last array")
    return arrays
