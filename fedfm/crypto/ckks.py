"""TenSEAL CKKS backend: keys, transport and the encrypted loss (groundwork of issue 4).

Not registered in :data:`fedfm.crypto.BACKENDS` yet: :meth:`CkksEvaluator.embed` and
:meth:`CkksEvaluator.evaluate_block` are issue 4's next step, so the protocol cannot pick it.

Packing
-------
One ``tenseal.CKKSVector`` per sample: the flattened sample fills the slots from slot 0, and
TenSEAL splits it into ``ceil(size / (N/2))`` ciphertexts when it exceeds the ``N/2`` slots.
Reordering samples is free (no rotation), but a sample of ``C`` values still costs whole
ciphertexts (about 330 kB at N = 8192 for a 10-class row), and slot-wise sums need rotation keys.
The public context therefore carries Galois keys only for the steps ``1, 2, 4, ... < max_classes``
that summing a row of at most ``max_classes`` values uses (TenSEAL's default set is about 35 MB at
N = 8192). Throughput packing (samples x tokens in the slots) is issue 4's block-evaluation work.

Wire format
-----------
A batch payload holds ``blob`` (each sample's serialized vector after an 8-byte little-endian
length), ``shape`` (int64), ``context`` (the fingerprint of the key it is under) and ``digest``
(SHA-256 over the other three). TenSEAL deserializes a ciphertext made under another key of the
same parameters without complaint, so loaders compare the fingerprint with their own; the digest
catches truncation and corruption in transit. Neither authenticates the sender: that is the
transport's job.
"""

from __future__ import annotations

import hashlib
import logging
import math
import tempfile
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import tenseal as ts
import tenseal.sealapi as sealapi  # registers SEAL's types (moduli, keys) with Python

from fedfm.crypto.backend import CryptoBackend, EncryptedBatch, Evaluator, KeyOwner
from fedfm.crypto.params import CKKS_8192, CkksParameters
from fedfm.errors import CryptoParameterError, ProtocolError

if TYPE_CHECKING:
    from fedfm.models.fhe_vit import FheViT

NAME = "ckks"
NOT_YET = "CKKS block evaluation is issue 4's next step"
_LENGTH_BYTES = 8
_FINGERPRINT_BYTES = 16
_LOG = logging.getLogger(__name__)


class _SealSerializable(Protocol):
    def save(self, path: str) -> None: ...


def _seal_bytes(item: _SealSerializable) -> bytes:
    """SEAL's serialization of ``item`` (the SEAL bindings only write to files)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "item"
        item.save(str(path))
        return path.read_bytes()


def _proto_bytes_field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field: tag, varint length, bytes."""
    header = bytearray([number << 3 | 2])
    length = len(value)
    while True:
        low, length = length & 0x7F, length >> 7
        header.append(low | (0x80 if length else 0))
        if not length:
            return bytes(header) + value


def summing_steps(width: int) -> list[int]:
    """Rotation steps TenSEAL's ``sum()`` uses on a vector of ``width`` values (powers of two)."""
    return [1 << k for k in range(max(width - 1, 0).bit_length())]


def _fingerprint(context: ts.Context) -> bytes:
    """Public identity of a key: hash of the parameters, scale and public key (no eval keys)."""
    identity = context.serialize(
        save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )
    return hashlib.sha256(b"fedfm-ckks-key" + identity).digest()[:_FINGERPRINT_BYTES]


def _check_parameters(context: ts.Context, params: CkksParameters) -> None:
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


def _public_context(context: ts.Context, max_classes: int) -> bytes:
    """``context`` serialized without its secret key, with relin and the summing Galois keys.

    TenSEAL 0.3.18 can only generate its full default Galois set, so the keys come from SEAL's
    ``KeyGenerator`` (seeded serialization, half the size) and are merged into the serialized
    ``TenSEALContextProto``: protobuf merges a repeated message field, so appending field 2
    (``public_context``) with its fields 4 (``relin_keys``) and 5 (``galois_keys``) sets them.
    """
    seal_context = context.seal_context().data
    keygen = sealapi.KeyGenerator(seal_context, context.secret_key().data)
    keys = _proto_bytes_field(4, _seal_bytes(keygen.create_relin_keys()))
    steps = summing_steps(max_classes)
    if steps:
        tool = seal_context.key_context_data().galois_tool()
        elements = [tool.get_elt_from_step(step) for step in steps]
        keys += _proto_bytes_field(5, _seal_bytes(keygen.create_galois_keys(elements)))
    base = context.serialize(
        save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )
    return base + _proto_bytes_field(2, keys)


def _context_from(data: bytes, what: str) -> ts.Context:
    try:
        return ts.context_from(data)
    except Exception as error:  # TenSEAL raises several types for malformed bytes
        raise CryptoParameterError(f"{what} is not a valid TenSEAL CKKS context: {error}") from None


@dataclass(frozen=True, eq=False)
class CkksBatch(EncryptedBatch):
    """Samples as CKKS vectors (one per sample) under the key with fingerprint ``fingerprint``."""

    vectors: tuple[ts.CKKSVector, ...]
    shape: tuple[int, ...]
    fingerprint: bytes
    backend: str = NAME

    def __post_init__(self) -> None:
        if not self.shape or self.shape[0] != len(self.vectors) or self.shape[0] < 1:
            raise ProtocolError(
                f"a CKKS batch of shape {self.shape} cannot hold {len(self.vectors)} samples"
            )

    @property
    def sample_size(self) -> int:
        """Values per sample (the slots each vector uses)."""
        return math.prod(self.shape[1:])

    @property
    def nbytes(self) -> int:
        """Bytes of :meth:`to_payload` (serialized ciphertexts plus shape, fingerprint, digest)."""
        return sum(array.nbytes for array in self._payload.values())

    def to_payload(self) -> dict[str, np.ndarray]:
        return {name: array.copy() for name, array in self._payload.items()}

    @cached_property
    def _payload(self) -> dict[str, np.ndarray]:
        parts = []
        for vector in self.vectors:
            data = vector.serialize()
            parts += [len(data).to_bytes(_LENGTH_BYTES, "little"), data]
        blob = b"".join(parts)
        shape = np.asarray(self.shape, dtype=np.int64)
        return {
            "blob": np.frombuffer(blob, dtype=np.uint8),
            "shape": shape,
            "context": np.frombuffer(self.fingerprint, dtype=np.uint8),
            "digest": np.frombuffer(_digest(self.fingerprint, shape, blob), dtype=np.uint8),
        }


def _digest(fingerprint: bytes, shape: np.ndarray, blob: bytes) -> bytes:
    shape_bytes = np.ascontiguousarray(shape, dtype="<i8").tobytes()
    header = fingerprint + len(shape_bytes).to_bytes(8, "little") + shape_bytes
    return hashlib.sha256(header + blob).digest()


def _load(payload: dict[str, np.ndarray], context: ts.Context, fingerprint: bytes) -> CkksBatch:
    """Rebuild a batch for ``context``; every failure is a :mod:`fedfm.errors` error."""
    try:
        blob, shape = payload["blob"], payload["shape"]
        sender, digest = payload["context"], payload["digest"]
    except KeyError as error:
        raise ProtocolError(f"CKKS batch payload lacks {error}") from None
    if any(array.dtype != np.uint8 for array in (blob, sender, digest)) or shape.dtype != np.int64:
        raise ProtocolError("CKKS batch payload arrays have the wrong dtypes")
    if sender.tobytes() != fingerprint:
        raise CryptoParameterError("batch was encrypted under another data owner's key")
    data = blob.tobytes()
    if digest.tobytes() != _digest(fingerprint, shape, data):
        raise ProtocolError("CKKS batch payload is truncated or corrupt (digest mismatch)")
    if shape.ndim != 1 or shape.size < 1 or (shape < 1).any():
        raise ProtocolError(f"CKKS batch payload has an invalid shape {shape.tolist()}")
    vectors = []
    offset = 0
    while offset < len(data):
        start = offset + _LENGTH_BYTES
        end = start + int.from_bytes(data[offset:start], "little")
        if start > len(data) or end > len(data):
            raise ProtocolError(f"CKKS blob is truncated at sample {len(vectors)}")
        try:
            vectors.append(ts.ckks_vector_from(context, data[start:end]))
        except Exception as error:  # TenSEAL raises several types for malformed bytes
            raise ProtocolError(f"CKKS ciphertext {len(vectors)} is malformed: {error}") from None
        offset = end
    batch = CkksBatch(tuple(vectors), tuple(int(size) for size in shape), fingerprint)
    if any(vector.size() != batch.sample_size for vector in vectors):
        raise ProtocolError(f"CKKS ciphertexts do not hold {batch.sample_size} values each")
    return batch


class CkksKeyOwner(KeyOwner):
    """The client's TenSEAL context: the only holder of the secret key."""

    backend = NAME

    def __init__(self, context: ts.Context, public_context: bytes) -> None:
        if not context.is_private():
            raise CryptoParameterError("a CKKS key owner needs a context with its secret key")
        self._context = context
        self._public_context = public_context
        self.fingerprint = _fingerprint(context)

    def public_context(self) -> bytes:
        return self._public_context

    def encrypt(self, values: np.ndarray) -> CkksBatch:
        array = np.asarray(values, dtype=np.float64)
        if array.ndim < 1 or array.shape[0] < 1 or array.size == 0:
            raise ProtocolError(f"cannot encrypt an empty batch of shape {array.shape}")
        rows = array.reshape(array.shape[0], -1)
        vectors = tuple(ts.ckks_vector(self._context, row.tolist()) for row in rows)
        return CkksBatch(vectors, tuple(array.shape), self.fingerprint)

    def decrypt(self, batch: EncryptedBatch) -> np.ndarray:
        if not isinstance(batch, CkksBatch) or batch.fingerprint != self.fingerprint:
            raise CryptoParameterError("cannot decrypt: batch is not under this owner's key")
        secret_key = self._context.secret_key()
        rows = [vector.decrypt(secret_key) for vector in batch.vectors]
        return np.asarray(rows, dtype=np.float64).reshape(batch.shape)

    def load(self, payload: dict[str, np.ndarray]) -> CkksBatch:
        return _load(payload, self._context, self.fingerprint)

    def secret_state(self) -> dict[str, np.ndarray]:
        private = self._context.serialize(
            save_public_key=True,
            save_secret_key=True,
            save_galois_keys=False,
            save_relin_keys=False,
        )
        return {
            "context": np.frombuffer(private, dtype=np.uint8).copy(),
            "public_context": np.frombuffer(self._public_context, dtype=np.uint8).copy(),
        }


class CkksEvaluator(Evaluator):
    """The server's TenSEAL context: relin and summing keys only, nothing that decrypts."""

    backend = NAME

    def __init__(self, public_context: bytes, params: CkksParameters) -> None:
        context = _context_from(public_context, "public context")
        if context.is_private():
            raise CryptoParameterError("refusing a public context that carries a secret key")
        _check_parameters(context, params)
        if not context.has_relin_keys():
            raise CryptoParameterError("public context lacks relinearization keys")
        self._context = context
        self.params = params
        self.fingerprint = _fingerprint(context)

    def _check(self, batch: EncryptedBatch) -> CkksBatch:
        if not isinstance(batch, CkksBatch) or batch.fingerprint != self.fingerprint:
            raise CryptoParameterError("batch is not under this evaluator's key")
        return batch

    def _bound(self, batch: EncryptedBatch) -> CkksBatch:
        """``batch`` checked, its vectors on this evaluator's context (needed to compute).

        A batch handed over in process rather than through a payload is linked to the owner's
        context, which has no rotation keys (and a secret key the server must never use).
        """
        vectors = tuple(
            vector
            if vector.context().data is self._context.data
            else ts.ckks_vector_from(self._context, vector.serialize())
            for vector in self._check(batch).vectors
        )
        return CkksBatch(vectors, batch.shape, self.fingerprint)

    def _require_summing(self, width: int) -> None:
        """Refuse sums over ``width`` slots the public context has no rotation keys for."""
        keys = self._context.galois_keys().data if self._context.has_galois_keys() else None
        tool = self._context.seal_context().data.key_context_data().galois_tool()
        steps = summing_steps(width)
        if any(keys is None or not keys.has_key(tool.get_elt_from_step(s)) for s in steps):
            raise CryptoParameterError(
                f"public context lacks the rotation keys (steps {steps}) to sum {width} values; "
                "raise max_classes on the data owner's backend"
            )

    def load(self, payload: dict[str, np.ndarray]) -> CkksBatch:
        return _load(payload, self._context, self.fingerprint)

    def take(self, batch: EncryptedBatch, indices: np.ndarray) -> CkksBatch:
        source = self._check(batch)
        order = np.asarray(indices)
        if order.ndim != 1 or order.size < 1 or not np.issubdtype(order.dtype, np.integer):
            raise ProtocolError("take needs a non-empty 1-D array of integer indices")
        if (order < 0).any() or (order >= len(source.vectors)).any():
            raise ProtocolError(f"indices out of range for a batch of {len(source.vectors)}")
        vectors = tuple(source.vectors[int(i)] for i in order)
        return CkksBatch(vectors, (order.size, *source.shape[1:]), self.fingerprint)

    def embed(self, model: FheViT, images: EncryptedBatch) -> CkksBatch:
        raise NotImplementedError(NOT_YET)

    def evaluate_block(self, model: FheViT, index: int, hidden: EncryptedBatch) -> CkksBatch:
        raise NotImplementedError(NOT_YET)

    def cross_entropy(
        self,
        probabilities: EncryptedBatch,
        log_probabilities: EncryptedBatch,
        labels: EncryptedBatch,
    ) -> tuple[CkksBatch, CkksBatch]:
        """Mean cross-entropy and logit gradient, homomorphically (two levels).

        Per sample ``y * log p`` (ciphertext product, one level) is summed over its slots by
        rotations; the samples' sums are added and scaled by ``-1/n`` (second level). The
        gradient is ``(p - y) * (1/n)`` per sample (one level).
        """
        p, log_p, y = (self._bound(b) for b in (probabilities, log_probabilities, labels))
        if not p.shape == log_p.shape == y.shape or len(p.shape) != 2:
            raise ProtocolError(
                f"cross-entropy needs three (n, C) batches of one shape, got {p.shape}, "
                f"{log_p.shape}, {y.shape}"
            )
        if self.params.depth < 2:
            raise CryptoParameterError(
                f"cross-entropy needs multiplicative depth 2, parameters give {self.params.depth}"
            )
        count, classes = p.shape
        self._require_summing(classes)
        total = (log_p.vectors[0] * y.vectors[0]).sum()
        for log_row, label_row in zip(log_p.vectors[1:], y.vectors[1:], strict=True):
            total = total + (log_row * label_row).sum()
        loss = CkksBatch((total * (-1.0 / count),), (1,), self.fingerprint)
        rows = tuple(
            (p_row - y_row) * (1.0 / count)
            for p_row, y_row in zip(p.vectors, y.vectors, strict=True)
        )
        return loss, CkksBatch(rows, p.shape, self.fingerprint)


class CkksBackend(CryptoBackend):
    """TenSEAL CKKS keys and evaluation (not yet selectable by the protocol; see module doc).

    Parameters
    ----------
    params : CkksParameters
        Ring degree, modulus chain and scale; refused unless they meet 128-bit security.
    max_classes : int
        Widest row the server will sum over (classes in the loss): fixes the rotation keys.
    allow_insecure : bool
        For tests only: skip fedfm's 128-bit check (with a warning). SEAL, as built into
        TenSEAL 0.3.18, enforces the same bound itself, so key generation still fails.
    """

    name = NAME

    def __init__(
        self,
        params: CkksParameters = CKKS_8192,
        *,
        max_classes: int = 16,
        allow_insecure: bool = False,
    ) -> None:
        if allow_insecure and not params.secure_128:
            message = (
                f"INSECURE CKKS parameters accepted (N={params.poly_modulus_degree}, "
                f"{params.modulus_bits}-bit modulus): for tests only"
            )
            _LOG.warning(message)
            warnings.warn(message, stacklevel=2)
        elif not allow_insecure:
            params.check_secure()
        if max_classes < 1:
            raise CryptoParameterError(f"max_classes must be >= 1, got {max_classes}")
        self.params = params
        self.max_classes = max_classes

    def create_key_owner(self, *, seed: int | None = None) -> CkksKeyOwner:
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
        return CkksKeyOwner(context, _public_context(context, self.max_classes))

    def restore_key_owner(self, state: dict[str, np.ndarray]) -> CkksKeyOwner:
        try:
            private, public = state["context"], state["public_context"]
        except KeyError as error:
            raise CryptoParameterError(f"CKKS key owner state lacks {error}") from None
        context = _context_from(private.astype(np.uint8).tobytes(), "key owner state")
        _check_parameters(context, self.params)
        public_bytes = public.astype(np.uint8).tobytes()
        if _fingerprint(_context_from(public_bytes, "public context")) != _fingerprint(context):
            raise CryptoParameterError("key owner state: public context is of another key")
        return CkksKeyOwner(context, public_bytes)

    def create_evaluator(self, public_context: bytes) -> CkksEvaluator:
        return CkksEvaluator(public_context, self.params)
