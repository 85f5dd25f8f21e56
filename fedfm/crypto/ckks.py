"""TenSEAL CKKS backend: packed batches, encrypted ViT blocks, masked refreshes, the loss.

Keys and contexts
-----------------
The data owner (:class:`CkksKeyOwner`) generates the keys. The server's :class:`CkksEvaluator` is
built from the *public* context: public key, relinearisation key and Galois keys for exactly the
rotation steps the slot layout uses (:meth:`SlotLayout.rotation_steps`); TenSEAL's default
Galois set would be hundreds of MB at N = 16384. Parameter sets (:mod:`fedfm.crypto.params`)
keep the chain's first two primes for the refresh mask; SEAL itself refuses sets above the
128-bit bound of the HomomorphicEncryption.org standard.

Packing
-------
One ciphertext per feature, samples x tokens in the slots (:mod:`fedfm.crypto.packing`):
images as patches (token 0 left empty for the class token), hidden states ``(n, T, D)``, and rows
``(n, C)`` (labels, probabilities) with one slot per sample group.

Refreshes
---------
Block evaluation runs out of levels several times per block; each time the server masks the
ciphertexts in the coefficient domain and the data owner re-encrypts them at the top level
(:mod:`fedfm.crypto.refresh`: the evaluator's accountant keeps all refreshes of a run within
the parameter set's statistical-distance budget of masks alone, ``2^-40`` for ``ckks``, and the
data owner refuses masked values outside the calibrated range).

Releases
--------
Every batch the evaluator computes is released when serialized (:meth:`CkksEvaluator.release`):
switched to the lowest level, re-randomised with a fresh encryption of zero and noise-flooded, so
that what the data owner receives tells it the values and nothing of how the server computed
them beyond the flood's statistical parameter (``docs/ckks.md``, "Circuit privacy").

Wire format
-----------
A batch payload holds ``blob`` (every ciphertext's SEAL serialization after an 8-byte
little-endian length, feature-major), ``shape`` and ``layout`` (int64), ``context`` (the
fingerprint of the key it is under) and ``digest`` (a CRC-32 checksum over the others, against
truncation and corruption: an unkeyed digest, however strong, is recomputed by whoever alters the
payload, so SHA-256 would add cost and no protection). Loaders compare the fingerprint with their
own, check the digest, validate every ciphertext against the context (levels, lengths, residues
below their primes), and check levels where the protocol fixes them (uploads and refreshes come at
the top level). None of this authenticates the sender or stops tampering on the way: that is the
transport's job (TLS on the Deployment Engine).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import tempfile
import weakref
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import tenseal as ts
import tenseal.sealapi as sealapi  # registers SEAL's types (moduli, keys) with Python

import fedfm.crypto.ckks_text as ckks_text
import fedfm.crypto.ckks_vit as ckks_vit
from fedfm.crypto.backend import (
    CryptoBackend,
    EncryptedBatch,
    Evaluator,
    KeyOwner,
    ModelGeometry,
    Work,
    check_key_mask,
    join_offset,
)
from fedfm.crypto.circuit import Circuit
from fedfm.crypto.packing import SlotLayout
from fedfm.crypto.params import (
    CKKS_16384,
    REFRESH_PRIMES,
    REFRESH_VALUE_BITS,
    CkksParameters,
)
from fedfm.crypto.refresh import RefreshClient, RefreshServer, refresh_blobs
from fedfm.crypto.seal_raw import SealIO, dumps, scratch_prefix, scratch_root, seal_bytes
from fedfm.crypto.workers import (
    configured_workers,
    discard_pool,
    keep_heap,
    shared_pool,
)
from fedfm.errors import CryptoParameterError, InvariantError, ProtocolError

if TYPE_CHECKING:
    from fedfm.models.fhe_text import FheTextClassifier
    from fedfm.models.fhe_vit import FheViT

NAME = "ckks"
_LENGTH_BYTES = 8
_FINGERPRINT_BYTES = 16
_LOG = logging.getLogger(__name__)
# Refreshes of fewer ciphertexts than this stay in-process.
MIN_PARALLEL_REFRESH = 8


def _proto_bytes_field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field: tag, varint length, bytes."""
    header = bytearray([number << 3 | 2])
    length = len(value)
    while True:
        low, length = length & 0x7F, length >> 7
        header.append(low | (0x80 if length else 0))
        if not length:
            return bytes(header) + value


def context_fingerprint(context: ts.Context) -> bytes:
    """Public identity of a key: hash of the parameters, scale and public key (no eval keys)."""
    identity = context.serialize(
        save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )
    return hashlib.sha256(b"fedfm-ckks-key" + identity).digest()[:_FINGERPRINT_BYTES]


def check_context_parameters(context: ts.Context, params: CkksParameters) -> None:
    """Refuse a context whose ring, modulus chain or scale differ from ``params``."""
    parms = context.seal_context().data.key_context_data().parms()
    found = (
        parms.poly_modulus_degree(),
        tuple(modulus.bit_count() for modulus in parms.coeff_modulus()),
        round(math.log2(context.global_scale)),
    )
    expected = (params.poly_modulus_degree, params.coeff_mod_bit_sizes, params.scale_bits)
    if found != expected:
        raise CryptoParameterError(
            f"CKKS context has (N, modulus bits, scale bits) = {found}, expected {expected}"
        )


def public_context_bytes(context: ts.Context, steps: list[int]) -> bytes:
    """``context`` serialized without its secret key, with relin keys and Galois keys for ``steps``.

    TenSEAL 0.3.18 can only generate its full default Galois set, so the keys come from SEAL's
    ``KeyGenerator`` (seeded serialization, half the size) and are merged into the serialized
    ``TenSEALContextProto``: protobuf merges a repeated message field, so appending field 2
    (``public_context``) with its fields 4 (``relin_keys``) and 5 (``galois_keys``) sets them.
    """
    seal_context = context.seal_context().data
    keygen = sealapi.KeyGenerator(seal_context, context.secret_key().data)
    keys = _proto_bytes_field(4, seal_bytes(keygen.create_relin_keys()))
    if steps:
        # Steps must become Galois elements: the list-of-int overload takes elements, not steps.
        tool = seal_context.key_context_data().galois_tool()
        elements = [tool.get_elt_from_step(step) for step in steps]
        keys += _proto_bytes_field(5, seal_bytes(keygen.create_galois_keys(elements)))
    base = context.serialize(
        save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )
    return base + _proto_bytes_field(2, keys)


def context_from_bytes(data: bytes, what: str) -> ts.Context:
    try:
        return ts.context_from(data)
    except Exception as error:  # TenSEAL raises several types for malformed bytes
        raise CryptoParameterError(f"{what} is not a valid TenSEAL CKKS context: {error}") from None


@dataclass(frozen=True, eq=False)
class CkksBatch(EncryptedBatch):
    """A packed batch: ``tensor[feature][ciphertext]`` in ``layout``, under key ``fingerprint``.

    ``shape`` is the logical shape (images ``(n, C, H, W)``, hidden ``(n, T, D)``, rows
    ``(n, C)``); ``copies`` says whether the token copies of the layout hold valid values.
    ``releaser`` is set on every batch an evaluator computes: serializing such a batch
    (:meth:`to_payload`, :attr:`nbytes`) serializes ``releaser(batch)`` instead, re-randomised
    and flooded (:meth:`CkksEvaluator.release`), so no computed ciphertext leaves the server
    without it, whatever protocol code sends it.
    """

    tensor: tuple[tuple[Any, ...], ...]
    shape: tuple[int, ...]
    layout: SlotLayout
    fingerprint: bytes
    copies: bool = True
    backend: str = NAME
    releaser: Callable[[CkksBatch], CkksBatch] | None = None

    def __post_init__(self) -> None:
        if not self.shape or self.shape[0] < 1:
            raise ProtocolError(f"a CKKS batch needs at least one sample, got shape {self.shape}")
        count = self.layout.ciphertexts_for(self.shape[0])
        if not self.tensor or any(len(feature) != count for feature in self.tensor):
            raise ProtocolError(
                f"a CKKS batch of {self.shape[0]} samples needs {count} ciphertexts per feature"
            )

    @property
    def samples(self) -> int:
        return self.shape[0]

    def nested(self) -> list[list[Any]]:
        return [list(feature) for feature in self.tensor]

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self._payload.values())

    def to_payload(self) -> dict[str, np.ndarray]:
        return {name: array.copy() for name, array in self._payload.items()}

    @cached_property
    def _payload(self) -> dict[str, np.ndarray]:
        tensor = self.tensor if self.releaser is None else self.releaser(self).tensor
        blob = _join([dumps(ct) for feature in tensor for ct in feature])
        shape = np.asarray(self.shape, dtype=np.int64)
        layout = np.asarray(
            [
                self.layout.slots,
                self.layout.tokens,
                self.layout.group,
                int(self.layout.duplicate),
                len(self.tensor),
                int(self.copies),
            ],
            dtype=np.int64,
        )
        return {
            "blob": np.frombuffer(blob, dtype=np.uint8),
            "shape": shape,
            "layout": layout,
            "context": np.frombuffer(self.fingerprint, dtype=np.uint8),
            "digest": np.frombuffer(_digest(self.fingerprint, shape, layout, blob), np.uint8),
        }


def _join(parts: list[bytes]) -> bytes:
    return b"".join(len(part).to_bytes(_LENGTH_BYTES, "little") + part for part in parts)


def _split(blob: bytes) -> list[bytes]:
    parts: list[bytes] = []
    offset = 0
    while offset < len(blob):
        start = offset + _LENGTH_BYTES
        end = start + int.from_bytes(blob[offset:start], "little")
        if start > len(blob) or end > len(blob):
            raise ProtocolError(f"CKKS blob is truncated at ciphertext {len(parts)}")
        parts.append(blob[start:end])
        offset = end
    return parts


def _digest(fingerprint: bytes, *arrays_and_blob: Any) -> bytes:
    *arrays, blob = arrays_and_blob
    header = fingerprint
    for array in arrays:
        data = np.ascontiguousarray(array, dtype="<i8").tobytes()
        header += len(data).to_bytes(8, "little") + data
    # chained, not over header + blob: that would copy the blob
    return zlib.crc32(blob, zlib.crc32(header)).to_bytes(4, "little")


class _Packing:
    """How a data owner's arrays map to packed ciphertexts for one model geometry."""

    def __init__(self, slots: int, geometry: ModelGeometry | None) -> None:
        self.geometry = geometry
        tokens = 1 if geometry is None else geometry.tokens
        self.hidden = SlotLayout.for_tokens(slots, tokens)

    def layout_for(self, shape: tuple[int, ...]) -> SlotLayout:
        if len(shape) == 2:
            return self.hidden.rows()
        if len(shape) in (3, 4):
            if self.geometry is None:
                raise ProtocolError("packing images or hidden states needs the model geometry")
            return self.hidden
        raise ProtocolError(f"the CKKS backend packs 2-, 3- or 4-D arrays, got shape {shape}")

    def to_tokens(self, values: np.ndarray) -> np.ndarray:
        """``(n, T, F)`` values: rows as one token, images as patches (token 0 empty)."""
        if values.ndim == 2:
            return values[:, None, :]
        if values.ndim == 3:
            if values.shape[1] != self.hidden.tokens:
                raise ProtocolError(
                    f"hidden states have {values.shape[1]} tokens, the model {self.hidden.tokens}"
                )
            return values
        if self.geometry is None:
            raise InvariantError("an evaluator without a model geometry (layout_for checks)")
        return patchify(values, self.geometry.patch_size, self.hidden.tokens)

    def from_tokens(self, values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if len(shape) == 2:
            return values[:, 0, :]
        if len(shape) == 3:
            return values
        raise ProtocolError("encrypted images are never decrypted")


def patchify(images: np.ndarray, patch: int, tokens: int) -> np.ndarray:
    """``(n, C, H, W)`` images as ``(n, tokens, C * patch * patch)`` patch features.

    Token 0 (the class token's place) is zero; patches follow row-major, each flattened in the
    order ``(channel, row, column)`` of a ``Conv2d`` patch embedding's weight.
    """
    n, channels, height, width = images.shape
    if height % patch or width % patch:
        raise ProtocolError(f"images of {height}x{width} do not split into {patch}-pixel patches")
    rows, cols = height // patch, width // patch
    if rows * cols + 1 != tokens:
        raise ProtocolError(
            f"{rows * cols} patches of {height}x{width} images do not match the model's "
            f"{tokens - 1} patch tokens"
        )
    grid = images.reshape(n, channels, rows, patch, cols, patch).transpose(0, 2, 4, 1, 3, 5)
    out = np.zeros((n, tokens, channels * patch * patch))
    out[:, 1:] = grid.reshape(n, rows * cols, -1)
    return out


def _geometry_array(geometry: ModelGeometry | None) -> np.ndarray:
    values = [0, 0] if geometry is None else [geometry.tokens, geometry.patch_size]
    return np.asarray(values, dtype=np.int64)


def _geometry_from(array: np.ndarray) -> ModelGeometry | None:
    tokens, patch = (int(v) for v in array)
    return None if tokens == 0 else ModelGeometry(tokens, patch)


class CkksKeyOwner(KeyOwner):
    """The client's TenSEAL context: the only holder of the secret key."""

    backend = NAME

    def __init__(
        self,
        context: ts.Context,
        public_context: bytes | None,
        geometry: ModelGeometry | None,
        workers: int = 0,
        value_bits: int = REFRESH_VALUE_BITS,
        refresh_primes: int = REFRESH_PRIMES,
    ) -> None:
        if not context.is_private():
            raise CryptoParameterError("a CKKS key owner needs a context with its secret key")
        self._context = context
        self._public_context = public_context
        self.fingerprint = context_fingerprint(context)
        self._seal = context.seal_context().data
        self._encoder = sealapi.CKKSEncoder(self._seal)
        self._encryptor = sealapi.Encryptor(self._seal, context.secret_key().data)
        self._decryptor = sealapi.Decryptor(self._seal, context.secret_key().data)
        self._packing = _Packing(self._encoder.slot_count(), geometry)
        self._refresher = RefreshClient(
            context, value_bits=value_bits, refresh_primes=refresh_primes
        )
        self._value_bits, self._refresh_primes = value_bits, refresh_primes
        self._io = SealIO(self._seal)
        self._workers = workers

    def public_context(self) -> bytes:
        """The evaluation context for the server (only on the owner that created the keys)."""
        if self._public_context is None:
            raise ProtocolError("a restored CKKS key owner does not keep the public context")
        return self._public_context

    def encrypt(self, values: np.ndarray) -> CkksBatch:
        array = np.asarray(values, dtype=np.float64)
        if array.ndim < 2 or array.shape[0] < 1 or array.size == 0:
            raise ProtocolError(f"cannot encrypt an empty batch of shape {array.shape}")
        layout = self._packing.layout_for(array.shape)
        slots = layout.pack(self._packing.to_tokens(array))
        top = self._seal.first_parms_id()
        scale = float(self._context.global_scale)
        tensor = []
        for feature in slots:
            cts = []
            for vector in feature:
                plain = sealapi.Plaintext()
                self._encoder.encode(vector.tolist(), top, scale, plain)
                ct = sealapi.Ciphertext(self._seal)
                self._encryptor.encrypt_symmetric(plain, ct)
                cts.append(ct)
            tensor.append(tuple(cts))
        return CkksBatch(tuple(tensor), tuple(array.shape), layout, self.fingerprint)

    def decrypt(self, batch: EncryptedBatch) -> np.ndarray:
        if not isinstance(batch, CkksBatch) or batch.fingerprint != self.fingerprint:
            raise CryptoParameterError("cannot decrypt: batch is not under this owner's key")
        slots = np.empty((len(batch.tensor), len(batch.tensor[0]), batch.layout.slots))
        for f, feature in enumerate(batch.tensor):
            for c, ct in enumerate(feature):
                plain = sealapi.Plaintext()
                self._decryptor.decrypt(ct, plain)
                slots[f, c] = self._encoder.decode_double(plain)
        values = batch.layout.unpack(slots, batch.samples)
        # float32 like the simulate backend: CKKS carries about 1e-6 relative precision anyway
        return self._packing.from_tokens(values, batch.shape).astype(np.float32)

    def decrypt_received(self, batch: EncryptedBatch) -> np.ndarray:
        if not isinstance(batch, CkksBatch) or batch.fingerprint != self.fingerprint:
            raise CryptoParameterError("cannot decrypt: batch is not under this owner's key")
        lowest = self._seal.last_parms_id()
        # A computed value's scale drifts from the global scale by the ratio of the primes it
        # was rescaled by (a few percent at most); a factor of two is a different encoding.
        wanted = math.log2(self._context.global_scale)
        for feature in batch.tensor:
            for ct in feature:
                if ct.parms_id() != lowest:
                    raise ProtocolError(
                        "refusing to decrypt a ciphertext above the lowest level: the server did "
                        "not release it (re-randomised and flooded), so its noise could show how "
                        "the server computed it"
                    )
                if abs(math.log2(ct.scale) - wanted) > 1:
                    raise ProtocolError(
                        f"refusing to decrypt a ciphertext at scale 2^{math.log2(ct.scale):.1f}; "
                        f"the parameter set computes at 2^{wanted:.0f}"
                    )
        return self.decrypt(batch)

    def load(self, payload: dict[str, np.ndarray]) -> CkksBatch:
        return _load(payload, self._io, self.fingerprint, top_only=False)

    def refresh(self, payload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        parts = _split_checked(payload, self.fingerprint)
        # a worker start costs more than a small refresh
        pool = shared_pool(self._workers) if len(parts) >= MIN_PARALLEL_REFRESH else None
        if pool is not None:
            try:
                fresh_parts = pool.map_chunks(
                    functools.partial(
                        refresh_blobs,
                        value_bits=self._value_bits,
                        refresh_primes=self._refresh_primes,
                    ),
                    self._worker_context,
                    parts,
                    local=self._refresh_parts,
                )
                return list_payload(fresh_parts, self.fingerprint)
            except BrokenProcessPool as error:
                _LOG.warning("refresh workers failed (%s); refreshing in-process", error)
                discard_pool()
        return list_payload(self._refresh_parts(parts), self.fingerprint)

    def _refresh_parts(self, parts: Sequence[bytes]) -> list[bytes]:
        """Masked ciphertexts -> fresh ones, in this process (wire forms both ways)."""
        fresh = self._refresher.refresh_many([self._io.load_ciphertext(part) for part in parts])
        return [dumps(ct) for ct in fresh]

    @cached_property
    def _worker_context(self) -> bytes:
        """The secret key context for refresh workers (no evaluation keys: small)."""
        return self._context.serialize(
            save_public_key=False,
            save_secret_key=True,
            save_galois_keys=False,
            save_relin_keys=False,
        )

    def secret_state(self) -> dict[str, np.ndarray]:
        private = self._context.serialize(
            save_public_key=True,
            save_secret_key=True,
            save_galois_keys=False,
            save_relin_keys=False,
        )
        # The public context (hundreds of MB of rotation keys at N = 16384) is sent once at setup
        # and not kept: the client state travels with every message.
        return {
            "context": np.frombuffer(private, dtype=np.uint8).copy(),
            "geometry": _geometry_array(self._packing.geometry),
        }


def list_payload(parts: list[bytes], fingerprint: bytes) -> dict[str, np.ndarray]:
    blob = _join(parts)
    count = np.asarray([len(parts)], dtype=np.int64)
    return {
        "blob": np.frombuffer(blob, dtype=np.uint8),
        "count": count,
        "context": np.frombuffer(fingerprint, dtype=np.uint8),
        "digest": np.frombuffer(_digest(fingerprint, count, blob), dtype=np.uint8),
    }


def _checked_blob(payload: dict[str, np.ndarray], fingerprint: bytes, *names: str) -> bytes:
    try:
        blob, sender, digest = payload["blob"], payload["context"], payload["digest"]
        arrays = [payload[name] for name in names]
    except KeyError as error:
        raise ProtocolError(f"CKKS payload lacks {error}") from None
    if any(a.dtype != np.uint8 for a in (blob, sender, digest)) or any(
        a.dtype != np.int64 for a in arrays
    ):
        raise ProtocolError("CKKS payload arrays have the wrong dtypes")
    if sender.tobytes() != fingerprint:
        raise CryptoParameterError("ciphertexts were encrypted under another data owner's key")
    data = blob.tobytes()
    if digest.tobytes() != _digest(fingerprint, *arrays, data):
        raise ProtocolError("CKKS payload is truncated or corrupt (digest mismatch)")
    return data


def _split_checked(payload: dict[str, np.ndarray], fingerprint: bytes) -> list[bytes]:
    """The SEAL bytes of a list payload, after its key, digest and count are checked."""
    data = _checked_blob(payload, fingerprint, "count")
    parts = _split(data)
    if len(parts) != int(payload["count"][0]):
        raise ProtocolError(f"CKKS payload holds {len(parts)} ciphertexts, says {payload['count']}")
    return parts


def load_list(payload: dict[str, np.ndarray], io: SealIO, fingerprint: bytes) -> list[Any]:
    return [io.load_ciphertext(part) for part in _split_checked(payload, fingerprint)]


def _load(
    payload: dict[str, np.ndarray], io: SealIO, fingerprint: bytes, *, top_only: bool
) -> CkksBatch:
    """Rebuild a batch for ``io``'s context; every failure is a :mod:`fedfm.errors` error."""
    data = _checked_blob(payload, fingerprint, "shape", "layout")
    shape, meta = payload["shape"], payload["layout"]
    if shape.ndim != 1 or not 2 <= shape.size <= 4 or (shape < 1).any() or meta.shape != (6,):
        raise ProtocolError(f"CKKS batch payload has an invalid shape {shape.tolist()}")
    slots, tokens, group, duplicate, features, copies = (int(v) for v in meta)
    try:
        layout = SlotLayout(slots, tokens, group, bool(duplicate))
    except Exception as error:
        raise ProtocolError(f"CKKS batch payload has an invalid layout: {error}") from None
    cts = [io.load_ciphertext(part) for part in _split(data)]
    count = layout.ciphertexts_for(int(shape[0]))
    if features < 1 or len(cts) != features * count:
        raise ProtocolError(f"CKKS batch holds {len(cts)} ciphertexts, expected {features}x{count}")
    top = io.seal_context.first_parms_id()
    for ct in cts:
        if ct.size() != 2:
            raise ProtocolError("CKKS ciphertexts must be relinearised (two polynomials)")
        if top_only and ct.parms_id() != top:
            raise ProtocolError("a CKKS upload must be at the top level of the modulus chain")
    tensor = tuple(tuple(cts[f * count : (f + 1) * count]) for f in range(features))
    dims = tuple(int(v) for v in shape)
    return CkksBatch(tensor, dims, layout, fingerprint, copies=bool(copies))


def _remove_quietly(path: str, owner_pid: int) -> None:
    # not from a forked worker that collects its inherited copy of the evaluator
    if os.getpid() == owner_pid:
        with contextlib.suppress(OSError):
            os.remove(path)


class CkksEvaluator(Evaluator):
    """The server's half: a :class:`Circuit` on the public context and the refresh masks."""

    backend = NAME

    def __init__(
        self,
        public_context: bytes,
        params: CkksParameters,
        geometry: ModelGeometry | None,
        workers: int = 0,
    ) -> None:
        context = context_from_bytes(public_context, "public context")
        if context.is_private():
            raise CryptoParameterError("refusing a public context that carries a secret key")
        check_context_parameters(context, params)
        if not context.has_relin_keys():
            raise CryptoParameterError("public context lacks relinearization keys")
        self.params = params
        self.fingerprint = context_fingerprint(context)
        refresher = RefreshServer(
            context,
            value_bits=params.refresh_value_bits,
            flood_bits=params.flood_bits,
            refresh_primes=params.refresh_primes,
            budget=2.0**-params.run_budget_bits,
            workers=workers,
        )
        self.circuit = Circuit(context, refresher)
        pool = shared_pool(workers)
        if pool is not None:
            # Workers evaluate independent segments (Circuit.spread) from this public context,
            # read once per worker from a file: too large to send with every job.
            handle, path = tempfile.mkstemp(prefix=scratch_prefix("public"), dir=scratch_root())
            with os.fdopen(handle, "wb") as file:
                file.write(public_context)
            weakref.finalize(self, _remove_quietly, path, os.getpid())
            self.circuit.pool, self.circuit.context_path = pool, path
        self._packing = _Packing(self.circuit.slots, geometry)
        self.layout = self._packing.hidden
        self.circuit.declare_steps(self.layout.rotation_steps())
        self._io = SealIO(context.seal_context().data)

    @property
    def samples_per_set(self) -> int:
        return self.layout.capacity

    def _check(self, batch: EncryptedBatch) -> CkksBatch:
        if not isinstance(batch, CkksBatch) or batch.fingerprint != self.fingerprint:
            raise CryptoParameterError("batch is not under this evaluator's key")
        return batch

    def _batch(self, tensor: list[list[Any]], shape: tuple[int, ...], copies: bool) -> CkksBatch:
        layout = self._packing.layout_for(shape)
        frozen = tuple(tuple(feature) for feature in tensor)
        return CkksBatch(
            frozen, shape, layout, self.fingerprint, copies=copies, releaser=self.release
        )

    def release(self, batch: EncryptedBatch) -> CkksBatch:
        """``batch`` at the lowest level, every ciphertext re-randomised and flooded
        (:meth:`~fedfm.crypto.refresh.RefreshServer.release_many`): what may go to the key
        holder. Batches this evaluator computes are released when serialized."""
        source = self._check(batch)
        flat = [ct for feature in source.tensor for ct in feature]
        with self.circuit.stats.timing("release"):
            released = iter(self.circuit.refresher.release_many(flat))
        tensor = tuple(tuple(next(released) for _ in feature) for feature in source.tensor)
        return CkksBatch(
            tensor, source.shape, source.layout, self.fingerprint, copies=source.copies
        )

    def load(self, payload: dict[str, np.ndarray]) -> CkksBatch:
        return _load(payload, self._io, self.fingerprint, top_only=True)

    def refresh_payload(self, items: list[Any]) -> dict[str, np.ndarray]:
        return list_payload([item.to_bytes() for item in items], self.fingerprint)

    def refreshed(self, payload: dict[str, np.ndarray]) -> list[Any]:
        fresh = load_list(payload, self._io, self.fingerprint)
        top = self._io.seal_context.first_parms_id()
        if any(ct.parms_id() != top for ct in fresh):
            raise ProtocolError("a refreshed ciphertext is not at the top level")
        return fresh

    def take(self, batch: EncryptedBatch, indices: np.ndarray) -> Work[CkksBatch]:
        source = self._check(batch)
        order = np.asarray(indices)
        if order.ndim != 1 or order.size < 1 or not np.issubdtype(order.dtype, np.integer):
            raise ProtocolError("take needs a non-empty 1-D array of integer indices")
        tensor = yield from ckks_vit.permute(
            self.circuit, source.layout, source.nested(), source.samples, order
        )
        return CkksBatch(
            tuple(tuple(f) for f in tensor),
            (order.size, *source.shape[1:]),
            source.layout,
            self.fingerprint,
            copies=source.copies,
            releaser=self.release,
        )

    def join(self, first: EncryptedBatch, second: EncryptedBatch) -> tuple[CkksBatch, int]:
        a, b = self._check(first), self._check(second)
        if a.shape[1:] != b.shape[1:] or a.layout != b.layout or a.copies != b.copies:
            raise ProtocolError(f"cannot join batches of shapes {a.shape} and {b.shape}")
        offset = join_offset(a.samples, b.samples, a.layout.capacity)
        if offset == a.samples and offset % a.layout.capacity:
            # ``b`` (one ciphertext per feature) moves into the free groups of ``a``'s last
            # ciphertext: a rotation by whole groups, then a sum. Both hold zeros where the
            # other has samples (a data owner's padding), so no level is spent on masks.
            shift = -(offset % a.layout.capacity) * a.layout.group
            tensor = [
                [*head[:-1], self.circuit.add(head[-1], self.circuit.rotate(tail[0], shift))]
                for head, tail in zip(a.tensor, b.tensor, strict=True)
            ]
        else:
            tensor = [[*head, *tail] for head, tail in zip(a.tensor, b.tensor, strict=True)]
        shape = (offset + b.samples, *a.shape[1:])
        frozen = tuple(tuple(feature) for feature in tensor)
        joined = CkksBatch(
            frozen, shape, a.layout, self.fingerprint, copies=a.copies, releaser=self.release
        )
        return joined, offset

    def embed(self, model: FheViT, images: EncryptedBatch) -> Work[CkksBatch]:
        source = self._check(images)
        if len(source.shape) != 4:
            raise ProtocolError(f"embed needs (n, C, H, W) images, got shape {source.shape}")
        ckks_vit.check_encryptable(model)
        patches = source.nested()
        # The projection takes one level: patches fresh from the data owner have it, patches
        # the server has just selected (``take``) may not.
        (flat,) = yield from self.circuit.ensure([[ct for f in patches for ct in f]], 1, "embed")
        width = len(patches[0])
        patches = [flat[i * width : (i + 1) * width] for i in range(len(patches))]
        tensor = ckks_vit.embed(self.circuit, model, self.layout, patches, source.samples)
        shape = (source.samples, self.layout.tokens, len(tensor))
        return self._batch(tensor, shape, copies=True)

    def evaluate_block(self, model: FheViT, index: int, hidden: EncryptedBatch) -> Work[CkksBatch]:
        source = self._check(hidden)
        if len(source.shape) != 3:
            raise ProtocolError(f"a block needs (n, T, D) hidden states, got {source.shape}")
        if not 0 <= index < model.num_blocks:
            raise ProtocolError(f"block index {index} out of range 0..{model.num_blocks - 1}")
        ckks_vit.check_encryptable(model)
        tensor = source.nested()
        if not source.copies:
            tensor = yield from ckks_vit.restore_copies(
                self.circuit, self.layout, tensor, source.samples
            )
        tensor = yield from ckks_vit.block(
            self.circuit, model, index, self.layout, tensor, source.samples
        )
        return self._batch(tensor, source.shape, copies=False)

    def evaluate_text_block(
        self,
        model: FheTextClassifier,
        index: int,
        hidden: EncryptedBatch,
        key_mask: np.ndarray,
    ) -> Work[CkksBatch]:
        """Block ``index`` of a BERT-family ``model`` (:mod:`fedfm.crypto.ckks_text`) on
        ``(n, T, D)`` hidden states; ``key_mask`` is ``(n, T)``, ``True`` at real tokens (the
        server holds it in plaintext: it learns the texts' lengths).

        One ciphertext column (up to :attr:`samples_per_set` texts) at a time: a column's
        intermediates are freed before the next starts. Two columns of MiniLM at 64 tokens at
        once (batch 64 at N = 8192) exceeded this machine's 24 GB; one at a time they cost two
        sets of refresh round trips instead of one (``docs/ckks.md``, "A text block").
        """
        source = self._check(hidden)
        keys = check_key_mask(source.shape, key_mask)
        if not 0 <= index < model.num_blocks:
            raise ProtocolError(f"block index {index} out of range 0..{model.num_blocks - 1}")
        ckks_text.check_encryptable(model)
        nested = source.nested()
        capacity = self.layout.capacity
        outputs = []
        for column, first in enumerate(range(0, source.samples, capacity)):
            rows = keys[first : first + capacity]
            tensor = [[feature[column]] for feature in nested]
            if not source.copies:
                tensor = yield from ckks_vit.restore_copies(
                    self.circuit, self.layout, tensor, len(rows)
                )
            outputs.append(
                (
                    yield from ckks_text.block(
                        self.circuit,
                        model,
                        index,
                        self.layout,
                        tensor,
                        len(rows),
                        ckks_vit.KeyMask.of(self.layout, rows),
                    )
                )
            )
        joined = [[ct for out in outputs for ct in out[f]] for f in range(len(nested))]
        return self._batch(joined, source.shape, copies=False)

    def cross_entropy(
        self,
        probabilities: EncryptedBatch,
        log_probabilities: EncryptedBatch,
        labels: EncryptedBatch,
    ) -> Work[tuple[CkksBatch, CkksBatch]]:
        p, log_p, y = (self._check(b) for b in (probabilities, log_probabilities, labels))
        if not p.shape == log_p.shape == y.shape or len(p.shape) != 2:
            raise ProtocolError(
                f"cross-entropy needs three (n, C) batches of one shape, got {p.shape}, "
                f"{log_p.shape}, {y.shape}"
            )
        loss, gradient = yield from ckks_vit.cross_entropy(
            self.circuit, p.layout, p.nested(), log_p.nested(), y.nested(), p.samples
        )
        return (
            self._batch(loss, (1, 1), copies=True),
            self._batch(gradient, p.shape, copies=True),
        )


class CkksBackend(CryptoBackend):
    """TenSEAL CKKS keys and evaluation.

    Parameters
    ----------
    params : CkksParameters
        Ring degree, modulus chain and scale; refused unless they meet 128-bit security and
        leave the chain's first two primes for the refresh mask.
    allow_insecure : bool
        For tests only: skip fedfm's 128-bit check (with a warning). SEAL, as built into
        TenSEAL 0.3.18, enforces the same bound itself, so key generation still fails.
    name : str
        The name this backend is registered under (``ckks``, ``ckks-8192``).
    workers : int, optional
        Processes for refreshes and mask material (:mod:`fedfm.crypto.workers`); default
        ``$FEDFM_CKKS_WORKERS`` or the number of cores; ``0`` or ``1`` keep it in-process.
    """

    def __init__(
        self,
        params: CkksParameters = CKKS_16384,
        *,
        allow_insecure: bool = False,
        name: str = NAME,
        workers: int | None = None,
    ) -> None:
        params.accept(allow_insecure=allow_insecure)
        if params.levels_between_refreshes < 1:
            raise CryptoParameterError(
                f"CKKS parameters {params.coeff_mod_bit_sizes} leave no level between refreshes: "
                f"the first {params.refresh_primes} primes are the refresh level"
            )
        self.params = params
        self.name = name  # the registered name, so logs and results say which parameter set ran
        self.workers = configured_workers(workers)
        keep_heap()

    def create_key_owner(
        self, *, seed: int | None = None, geometry: ModelGeometry | None = None
    ) -> CkksKeyOwner:
        if seed is not None:
            raise CryptoParameterError(
                "CKKS keys come from SEAL's randomness; seed is for simulate only"
            )
        try:
            context = ts.context(
                ts.SCHEME_TYPE.CKKS,
                self.params.poly_modulus_degree,
                coeff_mod_bit_sizes=list(self.params.coeff_mod_bit_sizes),
            )
        except ValueError as error:
            raise CryptoParameterError(
                f"SEAL refused the CKKS parameters {self.params} ({error}); SEAL enforces "
                "128-bit security itself, whatever allow_insecure says"
            ) from None
        context.global_scale = 2.0**self.params.scale_bits
        steps = SlotLayout.for_tokens(
            self.params.slots, 1 if geometry is None else geometry.tokens
        ).rotation_steps()
        return CkksKeyOwner(
            context,
            public_context_bytes(context, steps),
            geometry,
            self.workers,
            self.params.refresh_value_bits,
            self.params.refresh_primes,
        )

    def restore_key_owner(self, state: dict[str, np.ndarray]) -> CkksKeyOwner:
        try:
            private, geometry = state["context"], _geometry_from(state["geometry"])
        except KeyError as error:
            raise CryptoParameterError(f"CKKS key owner state lacks {error}") from None
        context = context_from_bytes(private.astype(np.uint8).tobytes(), "key owner state")
        check_context_parameters(context, self.params)
        return CkksKeyOwner(
            context,
            None,
            geometry,
            self.workers,
            self.params.refresh_value_bits,
            self.params.refresh_primes,
        )

    def create_evaluator(
        self, public_context: bytes, geometry: ModelGeometry | None = None
    ) -> CkksEvaluator:
        return CkksEvaluator(public_context, self.params, geometry, self.workers)
