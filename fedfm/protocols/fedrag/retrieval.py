"""Vector retrieval (spec 002 §5.1): the query embedding against each owner's local index.

``faithful``
    As the seed: the coordinator sends its query embedding in the clear; each owner returns the
    ids and cosine scores of its local top-k. What an owner learns from the embedding is measured
    by :func:`fedfm.experiments.fedrag_attacks.query_leakage` (nearest documents recovered).
``private``
    The scores under CKKS (TenSEAL, N = 8192, 128-bit security, the parameters HELIX uses): the
    coordinator encrypts its embedding, replicated in blocks of :data:`BLOCK` slots; an owner
    multiplies it by its documents packed ``slots / BLOCK`` per plaintext, sums each block by
    ``log2 BLOCK`` rotations and multiplies by a 0/1 mask that keeps only each block's total (the
    other slots hold partial sums of the owner's embeddings). The owner never holds a secret key;
    the coordinator decrypts every score of every owner and picks the global top-k: it learns the
    scores, the owner learns nothing about the query (only its key's public context and a
    ciphertext).
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

BLOCK = 512  # slots per embedding copy: a power of two >= the embedding width (MiniLM: 384)
PARAMETERS = CKKS_8192  # [60, 40, 40, 60]: two rescales (documents, then the mask)


def check_embeddings(what: str, values: np.ndarray, width: int | None = None) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or not values.shape[0] or not np.isfinite(values).all():
        raise ConfigError(f"{what} must be a non-empty finite 2-D array, got shape {values.shape}")
    if width is not None and values.shape[1] != width:
        raise ConfigError(f"{what} has {values.shape[1]} dimensions, the query {width}")
    if values.shape[1] > BLOCK:
        raise ConfigError(f"{what} has {values.shape[1]} dimensions; at most {BLOCK} fit a block")
    return values


def plaintext_scores(query: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Inner products (cosines for normalised embeddings) of one query with every document."""
    return check_embeddings("the index", index, np.asarray(query).size) @ np.asarray(
        query, dtype=np.float64
    ).reshape(-1)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest scores, best first (ties: lower index first)."""
    order = np.lexsort((np.arange(scores.size), -np.asarray(scores)))
    return order[: min(k, scores.size)]


def rotation_steps() -> list[int]:
    return [1 << i for i in range(int(np.log2(BLOCK)))]


class QueryKeys:
    """The coordinator's CKKS keys for one query: encrypt the embedding, decrypt the scores."""

    def __init__(self, context: ts.Context, params: CkksParameters = PARAMETERS) -> None:
        if not context.is_private():
            raise CryptoParameterError("the coordinator's keys need a context with its secret key")
        check_context_parameters(context, params)
        self.params, self._context = params, context
        self.fingerprint = context_fingerprint(context)
        seal = context.seal_context().data
        self._seal = seal
        self._encoder = sealapi.CKKSEncoder(seal)
        self._encryptor = sealapi.Encryptor(seal, context.secret_key().data)
        self._decryptor = sealapi.Decryptor(seal, context.secret_key().data)
        self._io = SealIO(seal)

    @classmethod
    def generate(cls, params: CkksParameters = PARAMETERS) -> QueryKeys:
        params.accept()
        context = ts.context(
            ts.SCHEME_TYPE.CKKS,
            params.poly_modulus_degree,
            coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
        )
        context.global_scale = 2.0**params.scale_bits
        return cls(context, params)

    @classmethod
    def restore(cls, secret: np.ndarray) -> QueryKeys:
        data = np.asarray(secret, dtype=np.uint8).tobytes()
        return cls(context_from_bytes(data, "the coordinator's saved keys"))

    @property
    def slots(self) -> int:
        return int(self._encoder.slot_count())

    def secret_state(self) -> np.ndarray:
        data = self._context.serialize(
            save_public_key=True,
            save_secret_key=True,
            save_galois_keys=False,
            save_relin_keys=False,
        )
        return np.frombuffer(data, dtype=np.uint8).copy()

    def public_context(self) -> np.ndarray:
        """Public key, relinearisation keys, Galois keys for :func:`rotation_steps` only."""
        data = public_context_bytes(self._context, rotation_steps())
        return np.frombuffer(data, dtype=np.uint8).copy()

    def encrypt_query(self, query: np.ndarray) -> dict[str, np.ndarray]:
        query = np.asarray(query, dtype=np.float64).reshape(-1)
        if query.size > BLOCK:
            raise ConfigError(f"the query embedding has {query.size} > {BLOCK} dimensions")
        block = np.zeros(BLOCK)
        block[: query.size] = query
        vector = np.tile(block, self.slots // BLOCK)
        plain = sealapi.Plaintext()
        self._encoder.encode(
            vector.tolist(), self._seal.first_parms_id(), 2.0**self.params.scale_bits, plain
        )
        ciphertext = sealapi.Ciphertext(self._seal)
        self._encryptor.encrypt_symmetric(plain, ciphertext)
        return list_payload([self._io.save(ciphertext)], self.fingerprint)

    def decrypt_scores(self, payload: dict[str, np.ndarray], documents: int) -> np.ndarray:
        """The ``documents`` scores an owner returned (slot ``BLOCK * i`` of each ciphertext)."""
        ciphertexts = load_list(payload, self._io, self.fingerprint)
        per = self.slots // BLOCK
        if len(ciphertexts) != -(-documents // per):
            raise ProtocolError(
                f"expected {-(-documents // per)} score ciphertexts for {documents} documents, "
                f"got {len(ciphertexts)}"
            )
        scores = []
        for ciphertext in ciphertexts:
            plain = sealapi.Plaintext()
            self._decryptor.decrypt(ciphertext, plain)
            values = np.asarray(self._encoder.decode_double(plain))
            scores.append(values[::BLOCK])
        return np.concatenate(scores)[:documents]


class IndexEvaluator:
    """An owner's side: the coordinator's public context, its own embeddings in plaintext."""

    def __init__(self, public_context: np.ndarray, params: CkksParameters = PARAMETERS) -> None:
        params.accept()
        context = context_from_bytes(
            np.asarray(public_context, dtype=np.uint8).tobytes(), "the coordinator's public context"
        )
        if context.is_private():
            raise CryptoParameterError("refusing a coordinator context that carries a secret key")
        check_context_parameters(context, params)
        if not context.has_galois_keys():
            raise CryptoParameterError("the coordinator's public context carries no Galois keys")
        self.params = params
        self.fingerprint = context_fingerprint(context)
        seal = context.seal_context().data
        self._seal = seal
        self._encoder = sealapi.CKKSEncoder(seal)
        self._evaluator = sealapi.Evaluator(seal)
        self._io = SealIO(seal)
        self._galois = context.galois_keys().data
        self._scale = 2.0**params.scale_bits

    @property
    def slots(self) -> int:
        return int(self._encoder.slot_count())

    def _plain(self, values: np.ndarray, parms_id: Any) -> Any:
        plain = sealapi.Plaintext()
        self._encoder.encode(
            np.asarray(values, dtype=np.float64).tolist(), parms_id, self._scale, plain
        )
        return plain

    def scores(self, query: dict[str, np.ndarray], index: np.ndarray) -> dict[str, np.ndarray]:
        """``E(<q, d_i>)`` for every document ``d_i`` of ``index``, packed (module docstring)."""
        (ciphertext,) = _one(load_list(query, self._io, self.fingerprint))
        if ciphertext.size() != 2 or ciphertext.parms_id() != self._seal.first_parms_id():
            raise ProtocolError("the query is not a fresh two-polynomial ciphertext")
        per = self.slots // BLOCK
        index = check_embeddings("the index", index)
        mask = np.zeros(self.slots)
        mask[::BLOCK] = 1.0
        outputs = []
        for start in range(0, index.shape[0], per):
            rows = index[start : start + per]
            packed = np.zeros((per, BLOCK))
            packed[: rows.shape[0], : rows.shape[1]] = rows
            product = sealapi.Ciphertext(self._seal)
            self._evaluator.multiply_plain(
                ciphertext, self._plain(packed.reshape(-1), ciphertext.parms_id()), product
            )
            self._evaluator.rescale_to_next_inplace(product)
            for step in reversed(rotation_steps()):
                rotated = sealapi.Ciphertext(self._seal)
                self._evaluator.rotate_vector(product, step, self._galois, rotated)
                self._evaluator.add_inplace(product, rotated)
            product.scale = self._scale
            masked = sealapi.Ciphertext(self._seal)
            self._evaluator.multiply_plain(product, self._plain(mask, product.parms_id()), masked)
            self._evaluator.rescale_to_next_inplace(masked)
            outputs.append(self._io.save(masked))
        return list_payload(outputs, self.fingerprint)


def _one(items: Sequence[Any]) -> Sequence[Any]:
    if len(items) != 1:
        raise ProtocolError(f"expected one query ciphertext, got {len(items)}")
    return items
