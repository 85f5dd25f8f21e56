"""The seam between protocol logic and encryption.

A backend has two halves, as in Concrete ML's client/server split:

* :class:`KeyOwner` lives with a data owner: it generates the keys, encrypts and decrypts, and
  exports a *public* context (evaluation keys only) for the server;
* :class:`Evaluator` lives with the server: it is built from those public bytes alone and
  evaluates the FHE-friendly model and the loss on encrypted batches.

Protocol code only calls these interfaces, so the ``simulate`` backend (plaintext values, the same
flow and message sizes) and an encrypted backend are interchangeable. Encrypted batches travel as
``payload`` dictionaries of numpy arrays (:meth:`EncryptedBatch.to_payload`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fedfm.models.fhe_vit import FheViT


class EncryptedBatch(ABC):
    """A batch of samples under one data owner's key; the first axis indexes samples."""

    backend: str
    shape: tuple[int, ...]

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this batch takes on the wire (as ciphertexts, whatever the backend)."""

    @abstractmethod
    def to_payload(self) -> dict[str, np.ndarray]:
        """Arrays that carry the batch in a message."""


class KeyOwner(ABC):
    """The data owner's half: the only object that ever holds a secret key."""

    backend: str

    @abstractmethod
    def public_context(self) -> bytes:
        """Serialized context without the secret key, for the server's :class:`Evaluator`."""

    @abstractmethod
    def encrypt(self, values: np.ndarray) -> EncryptedBatch:
        """Encrypt ``values`` (samples on the first axis)."""

    @abstractmethod
    def decrypt(self, batch: EncryptedBatch) -> np.ndarray:
        """Decrypt a batch encrypted under this owner's key; refuse any other."""

    @abstractmethod
    def load(self, payload: dict[str, np.ndarray]) -> EncryptedBatch:
        """Rebuild a batch received in a message."""

    @abstractmethod
    def secret_state(self) -> dict[str, np.ndarray]:
        """Arrays that restore this owner (secret key included): kept on the client only."""


class Evaluator(ABC):
    """The server's half: built from public bytes, it can compute on but never decrypt batches."""

    backend: str

    @abstractmethod
    def load(self, payload: dict[str, np.ndarray]) -> EncryptedBatch:
        """Rebuild a batch received in a message, checking it belongs to this context."""

    @abstractmethod
    def take(self, batch: EncryptedBatch, indices: np.ndarray) -> EncryptedBatch:
        """The samples ``indices`` of ``batch``, in that order (selection and permutation)."""

    @abstractmethod
    def embed(self, model: FheViT, images: EncryptedBatch) -> EncryptedBatch:
        """The embedding ``b_0`` of encrypted images."""

    @abstractmethod
    def evaluate_block(self, model: FheViT, index: int, hidden: EncryptedBatch) -> EncryptedBatch:
        """Block ``index`` (0-based) of ``model`` on an encrypted batch of hidden states."""

    @abstractmethod
    def cross_entropy(
        self,
        probabilities: EncryptedBatch,
        log_probabilities: EncryptedBatch,
        labels: EncryptedBatch,
    ) -> tuple[EncryptedBatch, EncryptedBatch]:
        """Mean cross-entropy ``-mean_i sum_c y_ic log p_ic`` and its logit gradient ``(p - y)/n``.

        All three inputs are ``(n, C)`` batches under the data owner's key; both outputs too
        (the loss as a ``(1,)`` batch).
        """


class CryptoBackend(ABC):
    """Creates the two halves of one backend."""

    name: str

    @abstractmethod
    def create_key_owner(self, *, seed: int | None = None) -> KeyOwner:
        """Generate a fresh key pair (``seed`` only for reproducible tests of ``simulate``)."""

    @abstractmethod
    def restore_key_owner(self, state: dict[str, np.ndarray]) -> KeyOwner:
        """Restore a key owner from :meth:`KeyOwner.secret_state`."""

    @abstractmethod
    def create_evaluator(self, public_context: bytes) -> Evaluator:
        """An evaluator for one data owner's public context."""
