"""HELIX's only contact with TenSEAL: the client's keys and the provider's evaluator.

Roles of keys (spec 000, Sec. 4.4-4.5): the client (:class:`ClientKeys`) generates a key pair
per phase (alignment, then fresh keys for inference), keeps the secret key and hands the
provider a *public* context: the parameters, the public key, and Galois keys for exactly the
rotations the layout needs (built with SEAL's ``KeyGenerator``, see
:func:`fedfm.crypto.ckks.public_context_bytes`). The provider's :class:`ProviderEvaluator` refuses a
context that carries a secret key, so it can never decrypt.

Levels: with ``[60, 40, 40, 60]`` a fresh ciphertext allows two rescales; every HELIX circuit is
one plaintext multiplication deep, so the client drops one prime before sending (a third less
upload) and the provider returns ciphertexts on the last 60-bit prime (scale ``2^40``: logits
up to about ``2^19`` in magnitude).

Wire format: a list of ciphertexts as :func:`fedfm.crypto.ckks.list_payload` writes it (SEAL's
zstd-compressed serialization, the fingerprint of the key, a SHA-256 digest); loading checks the
key fingerprint (:class:`CryptoParameterError` for a ciphertext under another key), the digest,
SEAL's own validation, two polynomials and the expected level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tenseal as ts
import tenseal.sealapi as sealapi

from fedfm.crypto import (
    CKKS_8192,
    CkksParameters,
    SealIO,
    check_context_parameters,
    context_fingerprint,
    context_from_bytes,
    list_payload,
    load_list,
    public_context_bytes,
)
from fedfm.errors import ConfigError, CryptoParameterError, ProtocolError
from fedfm.protocols.helix.packing import FeatureMajor, ReplicatedRows, RowBlocks

Payload = dict[str, np.ndarray]
CIRCUIT_DEPTH = 1  # one ciphertext-plaintext multiplication, then one rescale


def check_parameters(params: CkksParameters, *, allow_insecure: bool = False) -> None:
    """Refuse ``params`` below 128-bit security (unless ``allow_insecure``, for tests: a
    warning; SEAL in TenSEAL 0.3.18 still enforces the bound itself) or too shallow."""
    params.accept(allow_insecure=allow_insecure)
    if params.depth < CIRCUIT_DEPTH:
        raise CryptoParameterError(
            f"CKKS parameters {params.coeff_mod_bit_sizes} allow no rescale; HELIX needs "
            f"{CIRCUIT_DEPTH}"
        )


def _upload_parms_id(seal_context: Any, params: CkksParameters) -> Any:
    """The level uploads come at: top, minus the primes the circuit does not use."""
    data = seal_context.first_context_data()
    for _ in range(params.depth - CIRCUIT_DEPTH):
        data = data.next_context_data()
    return data.parms_id()


def _as_bytes(data: bytes | np.ndarray) -> bytes:
    return data if isinstance(data, bytes) else np.asarray(data, dtype=np.uint8).tobytes()


class ClientKeys:
    """The client's CKKS key pair: encrypt slot vectors, decrypt results."""

    def __init__(self, context: ts.Context, params: CkksParameters) -> None:
        if not context.is_private():
            raise CryptoParameterError("the client's keys need a context with its secret key")
        check_context_parameters(context, params)
        self.params = params
        self._context = context
        self.fingerprint = context_fingerprint(context)
        seal_context = context.seal_context().data
        self._seal = seal_context
        self._encoder = sealapi.CKKSEncoder(seal_context)
        self._encryptor = sealapi.Encryptor(seal_context, context.secret_key().data)
        self._decryptor = sealapi.Decryptor(seal_context, context.secret_key().data)
        self._evaluator = sealapi.Evaluator(seal_context)
        self._io = SealIO(seal_context)
        self._upload = _upload_parms_id(seal_context, params)

    @classmethod
    def generate(
        cls, params: CkksParameters = CKKS_8192, *, allow_insecure: bool = False
    ) -> ClientKeys:
        """A fresh key pair (SEAL's randomness)."""
        check_parameters(params, allow_insecure=allow_insecure)
        try:
            context = ts.context(
                ts.SCHEME_TYPE.CKKS,
                params.poly_modulus_degree,
                coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
            )
        except ValueError as error:
            raise CryptoParameterError(
                f"SEAL refused the CKKS parameters {params} ({error}); SEAL enforces 128-bit "
                "security itself, whatever allow_insecure says"
            ) from None
        context.global_scale = 2.0**params.scale_bits
        return cls(context, params)

    @classmethod
    def restore(cls, secret: bytes | np.ndarray, params: CkksParameters) -> ClientKeys:
        """The keys :meth:`secret_state` saved (kept in the client's role state)."""
        return cls(context_from_bytes(_as_bytes(secret), "the client's saved keys"), params)

    @property
    def slots(self) -> int:
        return int(self._encoder.slot_count())

    def secret_state(self) -> np.ndarray:
        """The secret key and parameters as bytes, to keep between the client's steps."""
        data = self._context.serialize(
            save_public_key=True,
            save_secret_key=True,
            save_galois_keys=False,
            save_relin_keys=False,
        )
        return np.frombuffer(data, dtype=np.uint8).copy()

    def public_context(self, rotation_steps: Sequence[int]) -> np.ndarray:
        """What the provider gets: no secret key, Galois keys for ``rotation_steps`` only."""
        data = public_context_bytes(self._context, sorted(set(rotation_steps)))
        return np.frombuffer(data, dtype=np.uint8).copy()

    def encrypt(self, slot_vectors: np.ndarray) -> Payload:
        """One ciphertext per row of ``slot_vectors`` (``m x slots``), at the upload level."""
        vectors = np.asarray(slot_vectors, dtype=np.float64)
        if vectors.ndim != 2 or vectors.shape[1] != self.slots or not vectors.shape[0]:
            raise ConfigError(
                f"encrypt takes a non-empty (m, {self.slots}) array, got {vectors.shape}"
            )
        top = self._seal.first_parms_id()
        scale = float(self._context.global_scale)
        parts = []
        for vector in vectors:
            plain = sealapi.Plaintext()
            self._encoder.encode(vector.tolist(), top, scale, plain)
            ciphertext = sealapi.Ciphertext(self._seal)
            self._encryptor.encrypt_symmetric(plain, ciphertext)
            self._evaluator.mod_switch_to_inplace(ciphertext, self._upload)
            parts.append(self._io.save(ciphertext))
        return list_payload(parts, self.fingerprint)

    def decrypt(self, payload: Payload) -> np.ndarray:
        """``(m, slots)`` values of a result payload; :class:`CryptoParameterError` if it is
        under another key."""
        ciphertexts = load_list(payload, self._io, self.fingerprint)
        values = np.empty((len(ciphertexts), self.slots))
        for index, ciphertext in enumerate(ciphertexts):
            plain = sealapi.Plaintext()
            self._decryptor.decrypt(ciphertext, plain)
            values[index] = self._encoder.decode_double(plain)
        return values


class ProviderEvaluator:
    """The provider's side: a public context, plaintext-ciphertext products, rotations."""

    def __init__(
        self,
        public_context: bytes | np.ndarray,
        params: CkksParameters,
        *,
        allow_insecure: bool = False,
    ) -> None:
        check_parameters(params, allow_insecure=allow_insecure)
        context = context_from_bytes(_as_bytes(public_context), "the client's public context")
        if context.is_private():
            raise CryptoParameterError("refusing a client context that carries a secret key")
        check_context_parameters(context, params)
        self.context = context
        self.fingerprint = context_fingerprint(context)
        seal_context = context.seal_context().data
        self._seal = seal_context
        self._encoder = sealapi.CKKSEncoder(seal_context)
        self._evaluator = sealapi.Evaluator(seal_context)
        self._io = SealIO(seal_context)
        self._upload = _upload_parms_id(seal_context, params)
        self._scale = 2.0**params.scale_bits
        self._galois = context.galois_keys().data if context.has_galois_keys() else None

    @property
    def slots(self) -> int:
        return int(self._encoder.slot_count())

    def load(self, payload: Payload, expected: int) -> list[Any]:
        """The ``expected`` uploaded ciphertexts of ``payload``, checked (module docstring)."""
        ciphertexts = load_list(payload, self._io, self.fingerprint)
        if len(ciphertexts) != expected:
            raise ProtocolError(f"expected {expected} ciphertexts, got {len(ciphertexts)}")
        for ciphertext in ciphertexts:
            if ciphertext.size() != 2 or ciphertext.parms_id() != self._upload:
                raise ProtocolError(
                    "an uploaded ciphertext is not a fresh two-polynomial ciphertext at the "
                    "upload level"
                )
        return ciphertexts

    def dump(self, ciphertexts: Sequence[Any]) -> Payload:
        """Results as a payload under the client's key."""
        return list_payload([self._io.save(c) for c in ciphertexts], self.fingerprint)

    def _plain(self, values: np.ndarray | float, parms_id: Any, scale: float) -> Any:
        plain = sealapi.Plaintext()
        value = float(values) if np.ndim(values) == 0 else np.asarray(values).tolist()
        self._encoder.encode(value, parms_id, scale, plain)
        return plain

    def _accumulate(self, total: Any | None, ciphertext: Any, plain: Any) -> Any:
        """``total + ciphertext * plain`` (``total`` ``None``: start a sum), unrescaled."""
        if total is None:
            total = sealapi.Ciphertext(self._seal)
            self._evaluator.multiply_plain(ciphertext, plain, total)
            return total
        product = sealapi.Ciphertext(self._seal)
        self._evaluator.multiply_plain(ciphertext, plain, product)
        self._evaluator.add_inplace(total, product)
        return total

    def _rescaled(self, total: Any | None) -> Any:
        if total is None:
            raise ProtocolError("a HELIX output has no nonzero term")
        self._evaluator.rescale_to_next_inplace(total)
        return total

    def _rotate(self, ciphertext: Any, step: int) -> Any:
        if self._galois is None:
            raise CryptoParameterError("the client's public context carries no Galois keys")
        out = sealapi.Ciphertext(self._seal)
        self._evaluator.rotate_vector(ciphertext, step, self._galois, out)
        return out

    def _add_plain(self, ciphertext: Any, values: np.ndarray | float) -> None:
        plain = self._plain(values, ciphertext.parms_id(), ciphertext.scale)
        self._evaluator.add_plain_inplace(ciphertext, plain)

    def cross_covariance(
        self, uploads: Sequence[Any], layout: RowBlocks, provider_rows: np.ndarray
    ) -> list[Any]:
        """``E(Z_A^T Z_B)`` from the row-block uploads (see :class:`RowBlocks`), streaming: one
        upload's plaintexts at a time, ``d_A`` accumulators in memory."""
        s = layout.per_ciphertext
        groups = layout.groups(provider_rows.shape[1])
        totals: list[Any | None] = [None] * (groups * s)
        for index, upload in enumerate(uploads):
            vectors = layout.provider_plaintexts(provider_rows, index).reshape(groups * s, -1)
            for slot, vector in enumerate(vectors):  # slot = g s + u
                if vector.any():
                    plain = self._plain(vector, self._upload, self._scale)
                    totals[slot] = self._accumulate(totals[slot], upload, plain)
        outputs = []
        for g in range(groups):
            folded = None
            for u in reversed(range(s)):  # Horner: sum_u rot(acc_u, u blocks)
                total = totals[g * s + u]
                if folded is not None:
                    rotated = self._rotate(folded, layout.block)
                    if total is None:
                        total = rotated
                    else:
                        self._evaluator.add_inplace(total, rotated)
                folded = total
            outputs.append(self._rescaled(folded))
        return outputs

    def linear_features(
        self, uploads: Sequence[Any], layout: FeatureMajor, weight: np.ndarray, bias: np.ndarray
    ) -> list[Any]:
        """``E(x) weight + bias`` per class, queries in the slots: no rotation."""
        features = layout.features
        outputs = []
        for start in range(0, len(uploads), features):
            chunk = uploads[start : start + features]
            for k in range(weight.shape[1]):
                total = None
                for i in range(features):
                    if round(abs(weight[i, k]) * self._scale) > 0:  # SEAL refuses zero products
                        plain = self._plain(weight[i, k], self._upload, self._scale)
                        total = self._accumulate(total, chunk[i], plain)
                output = self._rescaled(total)
                self._add_plain(output, bias[k])
                outputs.append(output)
        return outputs

    def linear_rows(
        self, uploads: Sequence[Any], layout: ReplicatedRows, weight: np.ndarray, bias: np.ndarray
    ) -> list[Any]:
        """``E(x) weight + bias`` for one query per ciphertext: ``log2 B`` rotations each."""
        classes = weight.shape[1]
        plains = [
            self._plain(layout.weight_plaintext(weight, g), self._upload, self._scale)
            for g in range(layout.groups(classes))
        ]
        outputs = []
        for upload in uploads:
            for group, plain in enumerate(plains):
                output = self._rescaled(self._accumulate(None, upload, plain))
                for step in layout.rotation_steps():
                    self._evaluator.add_inplace(output, self._rotate(output, step))
                self._add_plain(output, layout.bias_plaintext(bias, group))
                outputs.append(output)
        return outputs
