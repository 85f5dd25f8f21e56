"""The ``simulate`` backend: the encrypted flow with plaintext values (Concrete ML's ``simulate``).

Values are not encrypted: this backend exists for speed and for checking the protocol. It keeps
everything else of the real flow: a batch is bound to the key of the data owner who made it
(decrypting or loading it under another key fails), the server's evaluator never holds anything
that decrypts, the model runs the same FHE-friendly polynomials, and every batch reports the
bytes it would take as CKKS ciphertexts under :data:`~fedfm.crypto.params.CKKS_8192` with the
packing of one ciphertext per feature (the other axes in the slots).

The model runs on its own device (wherever the caller put it: a GPU with ``--device cuda``);
values cross to and from numpy at each call, in IEEE float32 (no autocast, no TF32:
:func:`~fedfm.models.device.ieee_float32`), so that the ``simulate`` and CKKS backends stay
comparable value by value.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedfm.crypto.backend import (
    CryptoBackend,
    EncryptedBatch,
    Evaluator,
    KeyOwner,
    ModelGeometry,
    Work,
    check_key_mask,
    finished,
    join_offset,
)
from fedfm.crypto.params import CKKS_8192, CkksParameters
from fedfm.errors import CryptoParameterError, ProtocolError
from fedfm.models.device import ieee_float32

if TYPE_CHECKING:  # annotations only: timm stays out of a data owner's ClientApp process
    from fedfm.models.fhe_text import FheTextClassifier
    from fedfm.models.fhe_vit import FheViT

NAME = "simulate"
_KEY_BYTES = 32


def _key_id(secret: bytes) -> bytes:
    """Public fingerprint of a secret key: what binds batches to their owner's key."""
    return hashlib.sha256(b"fedfm-simulate-key" + secret).digest()[:16]


@dataclass(frozen=True)
class SimulatedBatch(EncryptedBatch):
    """Plaintext values standing in for ciphertexts under the key ``key_id``."""

    values: np.ndarray
    key_id: bytes
    params: CkksParameters = CKKS_8192
    backend: str = NAME

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        features = self.values.shape[-1] if self.values.ndim > 1 else 1
        per_feature = self.values.size // max(features, 1)
        return features * self.params.ciphertexts_for(per_feature) * self.params.ciphertext_bytes

    def to_payload(self) -> dict[str, np.ndarray]:
        return {
            "values": np.ascontiguousarray(self.values, dtype=np.float32),
            "key_id": np.frombuffer(self.key_id, dtype=np.uint8).copy(),
        }


def _from_payload(payload: dict[str, np.ndarray], expected_key: bytes) -> SimulatedBatch:
    try:
        values, key_id = payload["values"], bytes(payload["key_id"].astype(np.uint8))
    except KeyError as error:
        raise ProtocolError(f"encrypted batch payload lacks {error}") from error
    if key_id != expected_key:
        raise CryptoParameterError("batch was encrypted under another data owner's key")
    return SimulatedBatch(np.asarray(values, dtype=np.float32), key_id)


class SimulatedKeyOwner(KeyOwner):
    """Holds a random secret whose fingerprint marks the batches it encrypts."""

    backend = NAME

    def __init__(self, secret: bytes) -> None:
        if len(secret) != _KEY_BYTES:
            raise CryptoParameterError(f"simulated secret key must be {_KEY_BYTES} bytes")
        self._secret = secret
        self.key_id = _key_id(secret)

    def public_context(self) -> bytes:
        return b"fedfm-simulate-context:" + self.key_id

    def encrypt(self, values: np.ndarray) -> SimulatedBatch:
        return SimulatedBatch(np.asarray(values, dtype=np.float32).copy(), self.key_id)

    def decrypt(self, batch: EncryptedBatch) -> np.ndarray:
        if not isinstance(batch, SimulatedBatch) or batch.key_id != self.key_id:
            raise CryptoParameterError("cannot decrypt: batch is not under this owner's key")
        return batch.values.copy()

    def load(self, payload: dict[str, np.ndarray]) -> SimulatedBatch:
        return _from_payload(payload, self.key_id)

    def secret_state(self) -> dict[str, np.ndarray]:
        return {"secret": np.frombuffer(self._secret, dtype=np.uint8).copy()}


class SimulatedEvaluator(Evaluator):
    """Computes on batches of one key; has no ``decrypt`` and no secret."""

    backend = NAME

    def __init__(self, public_context: bytes, geometry: ModelGeometry | None = None) -> None:
        prefix = b"fedfm-simulate-context:"
        if not public_context.startswith(prefix) or len(public_context) != len(prefix) + 16:
            raise CryptoParameterError("not a simulate-backend public context")
        self.key_id = public_context[len(prefix) :]
        self.geometry = geometry

    @property
    def samples_per_set(self) -> int:
        """As under :data:`~fedfm.crypto.params.CKKS_8192`, which this backend stands for."""
        tokens = 1 if self.geometry is None else self.geometry.tokens
        return CKKS_8192.samples_per_set(tokens)

    def _check(self, batch: EncryptedBatch) -> SimulatedBatch:
        if not isinstance(batch, SimulatedBatch) or batch.key_id != self.key_id:
            raise CryptoParameterError("batch is not under this evaluator's key")
        return batch

    def _wrap(self, values: np.ndarray | torch.Tensor) -> SimulatedBatch:
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().numpy()
        return SimulatedBatch(np.asarray(values, dtype=np.float32), self.key_id)

    def load(self, payload: dict[str, np.ndarray]) -> SimulatedBatch:
        return _from_payload(payload, self.key_id)

    def take(self, batch: EncryptedBatch, indices: np.ndarray) -> Work[SimulatedBatch]:
        order = np.asarray(indices)
        if order.ndim != 1 or len(set(order.tolist())) != order.size:
            raise ProtocolError("take needs a 1-D array of distinct indices")
        return finished(self._wrap(self._check(batch).values[order]))

    def join(self, first: EncryptedBatch, second: EncryptedBatch) -> tuple[SimulatedBatch, int]:
        a, b = self._check(first).values, self._check(second).values
        if a.shape[1:] != b.shape[1:]:
            raise ProtocolError(f"cannot join batches of shapes {a.shape} and {b.shape}")
        offset = join_offset(len(a), len(b), self.samples_per_set)
        gap = np.zeros((offset - len(a), *a.shape[1:]), dtype=a.dtype)
        return self._wrap(np.concatenate([a, gap, b])), offset

    @staticmethod
    def _on_model_device(model: torch.nn.Module, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(next(model.parameters()).device)

    @torch.no_grad()
    def embed(self, model: FheViT, images: EncryptedBatch) -> Work[SimulatedBatch]:
        values = self._on_model_device(model, self._check(images).values)
        with ieee_float32():
            return finished(self._wrap(model.embed(values)))

    @torch.no_grad()
    def evaluate_block(
        self, model: FheViT, index: int, hidden: EncryptedBatch
    ) -> Work[SimulatedBatch]:
        values = self._on_model_device(model, self._check(hidden).values)
        with ieee_float32():
            return finished(self._wrap(model.block(index, values)))

    @torch.no_grad()
    def evaluate_text_block(
        self, model: FheTextClassifier, index: int, hidden: EncryptedBatch, key_mask: np.ndarray
    ) -> Work[SimulatedBatch]:
        source = self._check(hidden)
        keys = check_key_mask(source.values.shape, key_mask)
        if not 0 <= index < model.num_blocks:
            raise ProtocolError(f"block index {index} out of range 0..{model.num_blocks - 1}")
        values = self._on_model_device(model, source.values)
        with ieee_float32():
            mask = torch.from_numpy(keys).to(values.device)
            return finished(self._wrap(model.block(index, values, mask)))

    def cross_entropy(
        self,
        probabilities: EncryptedBatch,
        log_probabilities: EncryptedBatch,
        labels: EncryptedBatch,
    ) -> Work[tuple[SimulatedBatch, SimulatedBatch]]:
        p = self._check(probabilities).values
        log_p = self._check(log_probabilities).values
        y = self._check(labels).values
        if not p.shape == log_p.shape == y.shape or p.ndim != 2:
            raise ProtocolError(
                f"cross-entropy needs three (n, C) batches of one shape, got {p.shape}, "
                f"{log_p.shape}, {y.shape}"
            )
        count = p.shape[0]
        loss = -(y * log_p).sum(axis=1).mean(keepdims=True)
        return finished((self._wrap(loss), self._wrap((p - y) / count)))


class SimulateBackend(CryptoBackend):
    """Plaintext stand-in with the real flow; logs and results always name it."""

    name = NAME

    def create_key_owner(
        self, *, seed: int | None = None, geometry: ModelGeometry | None = None
    ) -> SimulatedKeyOwner:
        if seed is None:
            secret = secrets.token_bytes(_KEY_BYTES)
        else:
            secret = hashlib.sha256(f"fedfm-simulate-seed:{seed}".encode()).digest()
        return SimulatedKeyOwner(secret)

    def restore_key_owner(self, state: dict[str, np.ndarray]) -> SimulatedKeyOwner:
        try:
            return SimulatedKeyOwner(bytes(state["secret"].astype(np.uint8)))
        except KeyError as error:
            raise CryptoParameterError("key owner state lacks the secret key") from error

    def create_evaluator(
        self, public_context: bytes, geometry: ModelGeometry | None = None
    ) -> SimulatedEvaluator:
        return SimulatedEvaluator(public_context, geometry)
