"""The seam between protocol logic and encryption.

A backend has two halves, as in Concrete ML's client/server split:

* :class:`KeyOwner` lives with a data owner: it generates the keys, encrypts and decrypts, and
  exports a *public* context (evaluation keys only) for the server;
* :class:`Evaluator` lives with the server: it is built from those public bytes alone and
  evaluates the FHE-friendly model and the loss on encrypted batches.

Protocol code only calls these interfaces, so the ``simulate`` backend (plaintext values, the same
flow and message sizes) and an encrypted backend are interchangeable. Encrypted batches travel as
``payload`` dictionaries of numpy arrays (:meth:`EncryptedBatch.to_payload`).

Evaluation may run out of multiplicative depth in the middle of a block. The evaluator's methods
therefore return a :data:`Work`: a generator that yields *refresh requests* (masked ciphertexts
for the data owner, :meth:`Evaluator.refresh_payload`), is sent the data owner's answer
(:meth:`KeyOwner.refresh`, read back with :meth:`Evaluator.refreshed`) and finally returns its
result. :func:`lockstep` merges the works of several batches so that their refreshes share round
trips. The server turns each request into a message; :func:`run_locally` answers them in process
(tests, benchmarks). The ``simulate`` backend never refreshes: its works finish at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from fedfm.errors import ProtocolError

if TYPE_CHECKING:
    from fedfm.models.fhe_text import FheTextClassifier
    from fedfm.models.fhe_vit import FheViT


R = TypeVar("R")
Work = Generator[list[Any], list[Any], R]
"""A computation that may yield ciphertexts to refresh and be sent the fresh ones."""


def finished(value: R) -> Work[R]:
    """A :data:`Work` that needs no refresh."""
    return value
    yield  # pragma: no cover - makes this function a generator


def lockstep(works: Sequence[Work[R]]) -> Work[list[R]]:
    """One work that runs ``works`` together: their pending refreshes travel in one request.

    Each yield concatenates the items of every waiting work (in order); the fresh items sent
    back are split among them the same way. Returns the works' results in order.
    """
    results: list[Any] = [None] * len(works)
    pending: dict[int, list[Any]] = {}
    for index, work in enumerate(works):
        try:
            pending[index] = next(work)
        except StopIteration as stop:
            results[index] = stop.value
    while pending:
        order = sorted(pending)
        flat = [item for index in order for item in pending[index]]
        fresh = yield flat
        if len(fresh) != len(flat):
            raise ProtocolError(f"refresh returned {len(fresh)} items for {len(flat)}")
        offset = 0
        waiting: dict[int, list[Any]] = {}
        for index in order:
            count = len(pending[index])
            try:
                waiting[index] = works[index].send(list(fresh[offset : offset + count]))
            except StopIteration as stop:
                results[index] = stop.value
            offset += count
        pending = waiting
    return results


def drive(work: Work[R], refresh: Callable[[list[Any]], list[Any]]) -> R:
    """Finish ``work``, answering each refresh request with ``refresh``."""
    try:
        items = next(work)
        while True:
            items = work.send(refresh(items))
    except StopIteration as stop:
        return stop.value


def run_locally(work: Work[R], evaluator: Evaluator, owner: KeyOwner) -> R:
    """Finish ``work`` answering its refreshes with ``owner`` in process (tests, benchmarks)."""
    return drive(
        work, lambda items: evaluator.refreshed(owner.refresh(evaluator.refresh_payload(items)))
    )


@dataclass(frozen=True)
class ModelGeometry:
    """What a data owner needs to lay out its data for the server's model (sent at setup)."""

    tokens: int
    patch_size: int


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

    def decrypt_received(self, batch: EncryptedBatch) -> np.ndarray:
        """Decrypt a batch the server computed and sent, refusing (:class:`ProtocolError`) one
        it did not release (:meth:`Evaluator.release`: for CKKS, at the lowest level with the
        scale the parameter set computes at). A protocol's data owner decrypts only this way;
        :meth:`decrypt` stays for measurements of unreleased values."""
        return self.decrypt(batch)

    @abstractmethod
    def load(self, payload: dict[str, np.ndarray]) -> EncryptedBatch:
        """Rebuild a batch received in a message."""

    @abstractmethod
    def secret_state(self) -> dict[str, np.ndarray]:
        """Arrays that restore this owner (secret key included): kept on the client only."""

    def refresh(self, payload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Answer a refresh request: re-encrypt the masked ciphertexts at the top level."""
        raise ProtocolError(f"the {self.backend} backend never asks for refreshes")


class Evaluator(ABC):
    """The server's half: built from public bytes, it can compute on but never decrypt batches."""

    backend: str

    @property
    @abstractmethod
    def samples_per_set(self) -> int:
        """Samples of the model's hidden states that one set of ciphertexts (one per feature)
        holds. A block costs about the same for any batch up to it, so a protocol packs several
        batches into one set; a backend without ciphertexts reports the capacity of the
        parameter set it stands for, so that both keep the same message flow."""

    @abstractmethod
    def load(self, payload: dict[str, np.ndarray]) -> EncryptedBatch:
        """Rebuild a batch received in a message, checking it belongs to this context."""

    @abstractmethod
    def take(self, batch: EncryptedBatch, indices: np.ndarray) -> Work[EncryptedBatch]:
        """The samples ``indices`` (distinct) of ``batch`` in that order: selection, permutation."""

    @abstractmethod
    def join(self, first: EncryptedBatch, second: EncryptedBatch) -> tuple[EncryptedBatch, int]:
        """One batch holding ``first``'s samples and, from row ``offset`` on, ``second``'s; the
        rows in between (if any) hold zeros and are never taken. ``offset`` is
        ``len(first)`` when ``second`` fits the free samples of ``first``'s last set of
        ciphertexts (it moves in by a rotation), else ``first`` rounded up to whole sets
        (:attr:`samples_per_set`), so that :meth:`take` can select from both at once."""

    @abstractmethod
    def embed(self, model: FheViT, images: EncryptedBatch) -> Work[EncryptedBatch]:
        """The embedding ``b_0`` of encrypted images."""

    @abstractmethod
    def evaluate_block(
        self, model: FheViT, index: int, hidden: EncryptedBatch
    ) -> Work[EncryptedBatch]:
        """Block ``index`` (0-based) of ``model`` on an encrypted batch of hidden states."""

    @abstractmethod
    def evaluate_text_block(
        self, model: FheTextClassifier, index: int, hidden: EncryptedBatch, key_mask: np.ndarray
    ) -> Work[EncryptedBatch]:
        """Block ``index`` of a BERT-family text ``model`` on encrypted ``(n, T, D)`` hidden
        states; ``key_mask`` (:func:`check_key_mask`) marks the real tokens, in plaintext."""

    @abstractmethod
    def cross_entropy(
        self,
        probabilities: EncryptedBatch,
        log_probabilities: EncryptedBatch,
        labels: EncryptedBatch,
    ) -> Work[tuple[EncryptedBatch, EncryptedBatch]]:
        """Mean cross-entropy ``-mean_i sum_c y_ic log p_ic`` and its logit gradient ``(p - y)/n``.

        All three inputs are ``(n, C)`` batches under the data owner's key; both outputs too
        (the loss as a ``(1,)`` batch).
        """

    def release(self, batch: EncryptedBatch) -> EncryptedBatch:
        """``batch`` as it may be sent to the data owner: for an encrypted backend re-randomised
        and noise-flooded (circuit privacy), so that nothing but its values tells how the server
        computed it. Backends apply it themselves when a batch they computed is serialized
        (:meth:`EncryptedBatch.to_payload`); ``simulate`` returns the batch as it is."""
        return batch

    def refresh_payload(self, items: list[Any]) -> dict[str, np.ndarray]:
        """The message arrays of a refresh request (the items a :data:`Work` yielded)."""
        raise ProtocolError(f"the {self.backend} backend never asks for refreshes")

    def refreshed(self, payload: dict[str, np.ndarray]) -> list[Any]:
        """The fresh items of a data owner's refresh answer, checked."""
        raise ProtocolError(f"the {self.backend} backend never asks for refreshes")


def check_key_mask(shape: tuple[int, ...], key_mask: np.ndarray) -> np.ndarray:
    """``key_mask`` as ``(n, T)`` booleans (``True`` at real tokens) for hidden states of
    ``shape`` ``(n, T, D)``; :class:`ProtocolError` for another shape or a text without a real
    token (its attention would have nothing to normalise)."""
    if len(shape) != 3:
        raise ProtocolError(f"a block needs (n, T, D) hidden states, got {shape}")
    keys = np.asarray(key_mask)
    if keys.shape != shape[:2]:
        raise ProtocolError(f"the key mask has shape {keys.shape}, the hidden states {shape[:2]}")
    if keys.dtype != np.bool_:
        raise ProtocolError(f"the key mask must be booleans, got {keys.dtype}")
    if not keys.any(axis=1).all():
        raise ProtocolError("every text needs at least one real token in its key mask")
    return keys


def join_offset(first: int, second: int, capacity: int) -> int:
    """Where :meth:`Evaluator.join` puts a batch of ``second`` samples after one of ``first``
    when a set of ciphertexts holds ``capacity`` samples (one rule for every backend)."""
    free = -first % capacity
    if second <= free:
        return first
    return first + free


class CryptoBackend(ABC):
    """Creates the two halves of one backend."""

    name: str

    @abstractmethod
    def create_key_owner(
        self, *, seed: int | None = None, geometry: ModelGeometry | None = None
    ) -> KeyOwner:
        """Generate a fresh key pair (``seed`` only for reproducible tests of ``simulate``).

        ``geometry`` says how the server's model reads the data (packing backends need it).
        """

    @abstractmethod
    def restore_key_owner(self, state: dict[str, np.ndarray]) -> KeyOwner:
        """Restore a key owner from :meth:`KeyOwner.secret_state`."""

    @abstractmethod
    def create_evaluator(
        self, public_context: bytes, geometry: ModelGeometry | None = None
    ) -> Evaluator:
        """An evaluator for one data owner's public context (and the server model's geometry)."""
