"""Typed messages of the double-blind protocol and their envelope encoding.

``query.setup`` (server): the run's client settings.
    Reply: public context; encrypted train/eval images and one-hot labels.
``train.block`` / ``evaluate.block`` (server): block ``l``'s permuted encrypted outputs, the
    round's batches packed into sets of ciphertexts (``batch_sizes``, ``set_sizes``); at
    ``l = 1`` the global adapter and head; at ``l = L`` the relative permutations of every batch
    (and, for evaluation, the encrypted labels permuted to ``pi_{L+1}``, packed the same way).
    A ``train.block`` may carry the held-out set too (its last ``evaluation_batches``
    batches, labels at ``l = L``), whose outputs the client keeps for ``evaluate.cached``.
    Reply for ``l < L``: the same sets decrypted and re-encrypted. For ``l = L``: in training,
    encrypted ``softmax`` and ``log_softmax`` of the logits; in evaluation, a confusion matrix.
``train.loss`` (server): encrypted mean cross-entropy and logit gradient per batch.
    Reply: updated adapter and head, number of examples, train loss.

Encrypted batches are carried as their payload arrays under ``<name>.<index>.<field>`` keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from fedfm.crypto.backend import EncryptedBatch, ModelGeometry
from fedfm.errors import ProtocolError
from fedfm.runtime.transport import ConfigValue, Envelope

ValueT = TypeVar("ValueT", int, float, str, bytes, bool)

Loader = Callable[[dict[str, np.ndarray]], EncryptedBatch]


def pack_batches(name: str, batches: list[EncryptedBatch]) -> dict[str, np.ndarray]:
    arrays = {}
    for index, batch in enumerate(batches):
        for key, value in batch.to_payload().items():
            arrays[f"{name}.{index}.{key}"] = value
    return arrays


def unpack_batches(envelope: Envelope, name: str, count: int, load: Loader) -> list[EncryptedBatch]:
    batches = []
    for index in range(count):
        prefix = f"{name}.{index}."
        payload = {
            key[len(prefix) :]: value
            for key, value in envelope.arrays.items()
            if key.startswith(prefix)
        }
        if not payload:
            raise ProtocolError(f"{envelope.message_type} lacks {name} batch {index}")
        batches.append(load(payload))
    return batches


def pack_arrays(name: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{name}.{key}": value for key, value in arrays.items()}


def unpack_arrays(envelope: Envelope, name: str) -> dict[str, np.ndarray]:
    prefix = f"{name}."
    return {
        key[len(prefix) :]: value
        for key, value in envelope.arrays.items()
        if key.startswith(prefix)
    }


def geometry_config(geometry: ModelGeometry) -> dict[str, int]:
    """The setup config entries that tell a data owner how the server's model reads images."""
    return {"model_tokens": geometry.tokens, "patch_size": geometry.patch_size}


def geometry_from(config: dict[str, ConfigValue]) -> ModelGeometry | None:
    """The model geometry in a setup config (see :func:`geometry_config`), if it has one."""
    tokens, patch = config.get("model_tokens"), config.get("patch_size")
    if tokens is None and patch is None:
        return None  # only packing backends need it; they say so when they do
    if not isinstance(tokens, int) or not isinstance(patch, int) or tokens < 1 or patch < 1:
        raise ProtocolError(
            f"setup config needs positive ints model_tokens and patch_size, got {tokens!r}, "
            f"{patch!r}"
        )
    return ModelGeometry(tokens, patch)


def require_config(envelope: Envelope, key: str, kind: type[ValueT]) -> ValueT:
    """A config value of the given type, or a :class:`ProtocolError` naming what is wrong."""
    value = envelope.config.get(key)
    if value is None or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(
            f"{envelope.message_type} needs config {key!r} of type {kind.__name__}, got {value!r}"
        )
    return value


# Integer arrays of a block request that are public sizes, not permutations.
SIZE_ARRAYS = ("batch_sizes", "set_sizes")


def pack_sets(sizes: list[int], capacity: int) -> list[list[int]]:
    """Consecutive batches (of ``sizes`` rows) grouped into sets of at most ``capacity`` rows,
    the samples one set of ciphertexts holds (a batch larger than that is a set of its own)."""
    sets: list[list[int]] = []
    rows = 0
    for index, size in enumerate(sizes):
        if sets and rows + size <= capacity:
            sets[-1].append(index)
            rows += size
        else:
            sets.append([index])
            rows = size
    return sets


@dataclass(frozen=True)
class BlockRequest:
    """Server to client: block ``block`` (1-based) of ``num_blocks``, permuted.

    The round's batches travel packed: ``batches`` holds one encrypted batch per *set*, the rows
    of ``set_sizes[s]`` consecutive batches one after the other (a block costs about the same
    for any batch that fits one set of ciphertexts, :attr:`~fedfm.crypto.backend.Evaluator.
    samples_per_set`); ``batch_sizes`` gives every batch's rows, in order. Each batch keeps its
    own permutations (``wrap`` and ``steps``, one per batch); ``labels`` are packed like
    ``batches``. In training, the last ``evaluation_batches`` batches are the client's held-out
    set riding along (every held-out sample once, as in an evaluation): the client keeps their
    outputs, and the last block carries the labels of every batch.
    """

    message_type: str
    node_id: int
    round: int
    block: int
    num_blocks: int
    batches: list[EncryptedBatch]
    batch_sizes: list[int]
    set_sizes: list[int]
    global_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    wrap: list[np.ndarray] = field(default_factory=list)
    steps: list[np.ndarray] = field(default_factory=list)
    labels: list[EncryptedBatch] = field(default_factory=list)
    evaluation_batches: int = 0
    # a text model's last block: each batch's key mask in label order (plaintext booleans)
    key_masks: list[np.ndarray] = field(default_factory=list)

    def sets(self) -> list[list[int]]:
        """The batch indices of each set."""
        bounds = np.cumsum([0, *self.set_sizes])
        return [list(range(bounds[s], bounds[s + 1])) for s in range(len(self.set_sizes))]

    def to_envelope(self) -> Envelope:
        arrays = {
            **pack_batches("batch", self.batches),
            **pack_arrays("global", self.global_arrays),
            **pack_batches("labels", self.labels),
            "batch_sizes": np.asarray(self.batch_sizes, dtype=np.int64),
            "set_sizes": np.asarray(self.set_sizes, dtype=np.int64),
        }
        for index, (wrap, steps) in enumerate(zip(self.wrap, self.steps, strict=True)):
            arrays[f"wrap.{index}"] = wrap.astype(np.int64)
            arrays[f"steps.{index}"] = steps.astype(np.int64)
        for index, mask in enumerate(self.key_masks):
            arrays[f"key_mask.{index}"] = mask.astype(np.bool_)
        config: dict[str, ConfigValue] = {
            "block": self.block,
            "num_blocks": self.num_blocks,
            "num_batches": len(self.batch_sizes),
            "num_sets": len(self.batches),
            "has_labels": bool(self.labels),
            "has_key_masks": bool(self.key_masks),
            "evaluation_batches": self.evaluation_batches,
        }
        return Envelope(self.message_type, self.node_id, self.round, arrays, config)

    @classmethod
    def from_envelope(cls, envelope: Envelope, load: Loader) -> BlockRequest:
        block = int(require_config(envelope, "block", int))
        num_blocks = int(require_config(envelope, "num_blocks", int))
        count = int(require_config(envelope, "num_batches", int))
        num_sets = int(require_config(envelope, "num_sets", int))
        if not 1 <= block <= num_blocks or count < 1 or not 1 <= num_sets <= count:
            raise ProtocolError(
                f"{envelope.message_type}: block {block} of {num_blocks} with {count} batches "
                f"in {num_sets} sets"
            )
        riding = envelope.config.get("evaluation_batches", 0)
        if not isinstance(riding, int) or isinstance(riding, bool) or not 0 <= riding < count:
            raise ProtocolError(
                f"{envelope.message_type}: evaluation_batches {riding!r} is not a count below "
                f"its {count} batches"
            )
        batch_sizes = _sizes(envelope, "batch_sizes", count)
        set_sizes = _sizes(envelope, "set_sizes", num_sets)
        if sum(set_sizes) != count:
            raise ProtocolError(
                f"{envelope.message_type}: sets of {set_sizes} batches do not hold {count} batches"
            )
        last = block == num_blocks
        wrap = [envelope.arrays.get(f"wrap.{i}") for i in range(count)] if last else []
        steps = [envelope.arrays.get(f"steps.{i}") for i in range(count)] if last else []
        if any(value is None for value in wrap + steps):
            raise ProtocolError(f"{envelope.message_type}: the last block lacks permutations")
        has_labels = bool(envelope.config.get("has_labels", False))
        key_masks = []
        if last and envelope.config.get("has_key_masks", False) is True:
            key_masks = [envelope.arrays.get(f"key_mask.{i}") for i in range(count)]
            if any(mask is None for mask in key_masks):
                raise ProtocolError(f"{envelope.message_type}: the last block lacks key masks")
        request = cls(
            message_type=envelope.message_type,
            node_id=envelope.node_id,
            round=envelope.round,
            block=block,
            num_blocks=num_blocks,
            batches=unpack_batches(envelope, "batch", num_sets, load),
            batch_sizes=batch_sizes,
            set_sizes=set_sizes,
            global_arrays=unpack_arrays(envelope, "global"),
            wrap=wrap,  # type: ignore[arg-type]
            steps=steps,  # type: ignore[arg-type]
            labels=unpack_batches(envelope, "labels", num_sets, load) if has_labels else [],
            evaluation_batches=riding,
            key_masks=key_masks,  # type: ignore[arg-type]
        )
        for packed in (request.batches, request.labels):
            for batch, members in zip(packed, request.sets(), strict=False):
                rows = sum(batch_sizes[i] for i in members)
                if batch.shape[0] != rows:
                    raise ProtocolError(
                        f"{envelope.message_type}: a set of batches {members} has "
                        f"{batch.shape[0]} rows, its batches {rows}"
                    )
        return request


def _sizes(envelope: Envelope, name: str, count: int) -> list[int]:
    """A message's ``name`` array: ``count`` positive sizes."""
    sizes = envelope.arrays.get(name)
    if (
        sizes is None
        or sizes.shape != (count,)
        or sizes.dtype.kind not in "iu"
        or (count and int(sizes.min()) < 1)
    ):
        raise ProtocolError(f"{envelope.message_type} needs {count} positive {name}")
    return [int(size) for size in sizes]


def batch_reply(
    request: Envelope, batches: dict[str, list[EncryptedBatch]], **config: ConfigValue
) -> Envelope:
    """A client's reply carrying encrypted batches under the given names."""
    arrays: dict[str, np.ndarray] = {}
    for name, items in batches.items():
        arrays.update(pack_batches(name, items))
    return Envelope(
        request.message_type,
        request.node_id,
        request.round,
        arrays,
        {"num_batches": max((len(v) for v in batches.values()), default=0), **config},
    )
