"""The data owner's role: keys, uploads, decrypt/re-encrypt, side adapter and head training.

The client's state is a plain :class:`ClientState` (arrays and config values) that the Flower
adapter keeps in ``context.state`` between messages; :meth:`DoubleBlindClient.handle` takes a
state and a message and returns the reply and the new state, never mutating the old one, so a
refused message loses nothing. The secret key lives only in that state. One exception: a request
refused after setup (a refresh outside the calibrated range, labels or a loss that are not the
client's own, a block out of order) is answered with :class:`~fedfm.errors.ProtocolAbort`, whose
state is the client having left the run (stage ``left``: no key, every later message refused).
Whether the client refuses a ciphertext the server chose is an answer about what it decrypted,
so it gives that answer once; a refusal's text never names a decrypted value. The client
decrypts only released ciphertexts (:meth:`~fedfm.crypto.backend.KeyOwner.decrypt_received`).

What the client sees (spec ``001`` §3.2): every block's outputs for its own batches, permuted by
a permutation it never receives; relative permutations between consecutive blocks (enough to
align ``B_{l-1}`` and ``B_l`` row by row, which the adapter needs); in training, the logit
gradient ``(p - y)/n``, from which it learns the label of each permuted row but not which of its
samples the row is; in evaluation, the labels in the same permuted order. With secure
aggregation (the default) also what :mod:`fedfm.secagg` shows a client: its neighbours' ids and
public keys, one share of each neighbour's secrets, which neighbours the server says survived.

Secure aggregation: ``train.loss`` leaves the client in stage ``trained`` holding its update,
the new adapter and head minus the global ones it received this round (``update.*`` arrays; a
difference is small, so a small clipping range suffices), and its number of examples. The
``train.secagg`` stages then mask it (``advertise_keys`` only from ``trained`` of the same round,
so an update is masked at most once; the others from ``secagg``), with the SecAgg client state
kept under ``secagg.`` keys of the state's arrays and config; after ``unmask`` the client is
``ready`` again and the update is gone. The SecAgg keys are authenticated as the data owner
chose when building the client (``authentication``: signed by its identity and checked against
its pins, or semi-honest), never as the server says; a client built without a choice refuses
the SecAgg stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import torch

from fedfm.crypto import get_backend
from fedfm.crypto.backend import CryptoBackend, KeyOwner, ModelGeometry
from fedfm.errors import (
    ConfigError,
    DataError,
    FedfmError,
    InvariantError,
    ProtocolAbort,
    ProtocolError,
)
from fedfm.models.device import to_numpy
from fedfm.protocols.double_blind.adapter import SideAdapterHead
from fedfm.protocols.double_blind.config import (
    EVALUATE_BLOCK,
    EVALUATE_CACHED,
    REFRESH,
    SETUP,
    TRAIN_BLOCK,
    TRAIN_LOSS,
    TRAIN_SECAGG,
    DoubleBlindConfig,
)
from fedfm.protocols.double_blind.messages import (
    BlockRequest,
    batch_reply,
    geometry_from,
    pack_arrays,
    require_config,
    unpack_arrays,
    unpack_batches,
)
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.text import (
    EMBEDDING,
    TEXT_INPUT,
    TextClientData,
    check_label_order_masks,
    embed_tokens,
)
from fedfm.runtime.transport import ConfigValue, Envelope
from fedfm.secagg import (
    ADVERTISE_KEYS,
    UNMASK,
    ClientSecAggState,
    KeyAuthentication,
    decode_request,
)
from fedfm.secagg import ClientUpdate as MaskedUpdate
from fedfm.secagg import handle as handle_secagg
from fedfm.secagg.messages import PREFIX as SECAGG
from fedfm.secagg.messages import UnmaskRequest


@dataclass(frozen=True)
class ClientData:
    """A data owner's private images (float32 ``(N, 3, H, W)``) and labels, split train/eval."""

    train_images: np.ndarray
    train_labels: np.ndarray
    eval_images: np.ndarray
    eval_labels: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        for name in ("train", "eval"):
            images, labels = getattr(self, f"{name}_images"), getattr(self, f"{name}_labels")
            if len(images) != len(labels):
                raise DataError(f"{name}: {len(images)} images but {len(labels)} labels")
            if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise DataError(
                    f"{name} labels span [{labels.min()}, {labels.max()}], outside "
                    f"0..{self.num_classes - 1}"
                )
        if len(self.train_labels) == 0:
            raise DataError("this client's partition has no training samples")


# ClientState's fields kept as config values
_SCALARS = ("stage", "round", "block", "num_blocks", "trained_round", "evaluated_round")
_CONFIG_PREFIX = "config."


@dataclass(frozen=True)
class ClientState:
    """Everything a client carries between messages (all of it stays on the client).

    ``round``, ``block`` and ``num_blocks`` describe the round in flight; ``trained_round`` and
    ``evaluated_round`` are the last rounds whose training and evaluation the client started:
    rounds only move forward, so no round is trained (or evaluated) twice.
    """

    stage: str = "new"
    round: int = 0
    block: int = 0
    num_blocks: int = 0
    trained_round: int = 0
    evaluated_round: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def to_records(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The state as ``(arrays, config)`` records (the protocol config under ``config.``)."""
        config: dict[str, Any] = {name: getattr(self, name) for name in _SCALARS}
        config.update({f"{_CONFIG_PREFIX}{key}": value for key, value in self.config.items()})
        return dict(self.arrays), config

    @classmethod
    def from_records(cls, arrays: dict[str, np.ndarray], config: dict[str, Any]) -> ClientState:
        """The state :meth:`to_records` wrote."""
        try:
            return cls(
                **{name: int(config[name]) for name in _SCALARS if name != "stage"},
                stage=str(config["stage"]),
                config={
                    key[len(_CONFIG_PREFIX) :]: value
                    for key, value in config.items()
                    if key.startswith(_CONFIG_PREFIX)
                },
                arrays=dict(arrays),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ProtocolError(f"a damaged client state: {error!r}") from error

    def group(self, name: str) -> dict[str, np.ndarray]:
        prefix = f"{name}."
        return {k[len(prefix) :]: v for k, v in self.arrays.items() if k.startswith(prefix)}

    def with_group(self, name: str, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This state's arrays with group ``name`` replaced by ``values``."""
        kept = {k: v for k, v in self.arrays.items() if not k.startswith(f"{name}.")}
        return {**kept, **pack_arrays(name, values)}


# Which message each stage accepts (the Flower SecAgg+ shape: a table, and every other
# transition refused). Setup only when no round is open. Block 1 of a *later* round may start
# from an open stage (the server dropped the round, e.g. after a timeout; the open round's update
# is discarded), but rounds only move forward (:meth:`DoubleBlindClient._open_round`); other
# blocks follow in order; ``train.loss`` only after the last block. Refreshes re-encrypt masked
# ciphertexts and change nothing, so they are served in every stage after setup.
_OPEN = {TRAIN_BLOCK, EVALUATE_BLOCK, EVALUATE_CACHED, REFRESH}  # a round may start
ALLOWED = {
    "new": {SETUP},
    "ready": {SETUP, *_OPEN},
    "train": {TRAIN_LOSS, *_OPEN},
    "trained": {TRAIN_SECAGG, *_OPEN},
    "secagg": {TRAIN_SECAGG, *_OPEN},
    "evaluate": _OPEN,
}
# The arrays a client keeps from its first full evaluation (group ``kept``): the revealed block
# outputs of its held-out set in the server's order, the relative permutations and the labels
# in that order. The server's blocks are frozen, so a later evaluation of the same samples would
# send the same values again (in a new order); the client evaluates new heads on its copy.
KEPT = "kept"
# The stage of a client that refused a request after setup: it answers nothing more in this run
# (see :meth:`DoubleBlindClient.handle`).
LEFT = "left"


def left_run(state: ClientState) -> ClientState:
    """``state`` after the client leaves the run: no key, no round, only the round counters."""
    return ClientState(
        stage=LEFT,
        round=state.round,
        trained_round=state.trained_round,
        evaluated_round=state.evaluated_round,
    )


# A decrypted one-hot label or a gradient row ``(p - y) n`` is within this of 0 or 1 (CKKS adds
# errors of about 1e-4 of the range; anything further is not a label the client holds).
LABEL_TOLERANCE = 0.1
# The update a client keeps for secure aggregation: ``update.*`` arrays and this config entry.
UPDATE_WEIGHT = "update.num_examples"
# The held-out batches riding along the training round in flight (config entry, from block 1).
RIDING = "round.evaluation_batches"
# What the server's model reads (config entry from setup): ``"text"`` or absent (images).
INPUT = "input"
# A text round's key masks in label order, per batch (array group, from the last block).
KEY_MASKS = "keymask"


def run_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A state's config without the round's entries (the update's weight, the held-out batches
    riding along, the SecAgg state)."""
    return {
        k: v
        for k, v in config.items()
        if k not in (UPDATE_WEIGHT, RIDING) and not k.startswith(SECAGG)
    }


def one_hot(labels: np.ndarray, num_classes: int) -> np.ndarray:
    return np.eye(num_classes, dtype=np.float32)[labels]


def require_count(envelope: Envelope) -> int:
    """The ``num_batches`` a message announces (a positive int)."""
    count = envelope.config.get("num_batches")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ProtocolError(f"{envelope.message_type} needs a positive int num_batches")
    return count


def _unpacked(
    key: KeyOwner, packed: list[Any], sets: list[list[int]], sizes: list[int]
) -> dict[str, np.ndarray]:
    """Each batch's rows (by batch index, as a string) out of the decrypted sets that carry
    them (:class:`~fedfm.protocols.double_blind.messages.BlockRequest`)."""
    plain = {}
    for batch, members in zip(packed, sets, strict=True):
        values = key.decrypt_received(batch)
        parts = np.split(values, np.cumsum([sizes[i] for i in members])[:-1])
        plain.update({str(index): part for index, part in zip(members, parts, strict=True)})
    return plain


def _between_rounds(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays a client carries from one round to the next: key, momentum, kept outputs."""
    return {k: v for k, v in arrays.items() if k.startswith(("key.", "momentum.", f"{KEPT}."))}


def _check_evaluation_round(message_type: str, server_round: int, state: ClientState) -> None:
    """Evaluations only move forward: each round once, never before its training."""
    if server_round <= state.evaluated_round or server_round < state.trained_round:
        raise ProtocolError(
            f"{message_type} of round {server_round}: this client already evaluated round "
            f"{state.evaluated_round} and trained round {state.trained_round}"
        )


def _check_permutations(
    what: str, wrap: np.ndarray, steps: np.ndarray, size: int, num_blocks: int
) -> None:
    """The relative permutations of the last block: ``wrap`` of ``size`` and ``num_blocks``
    steps, each a permutation of ``range(size)``."""
    rows = [wrap, *steps] if steps.ndim == 2 else []
    if (
        wrap.shape != (size,)
        or steps.shape != (num_blocks, size)
        or any(not np.array_equal(np.sort(row), np.arange(size)) for row in rows)
    ):
        raise ProtocolError(
            f"{what}: relative permutations of shapes {wrap.shape} and {steps.shape} are not "
            f"{num_blocks + 1} permutations of {size} rows"
        )


class DoubleBlindClient:
    """Handles the protocol's messages for one data owner.

    Parameters
    ----------
    data:
        The data owner's private images and labels, or a function that loads them (called
        once, at the first message that needs them).
    backend:
        The crypto backend the data owner encrypts with; ``None`` takes the one the server's
        setup names (by its registered name), if ``policy`` allows it.
    policy:
        What the data owner accepts (:class:`DataOwnerPolicy`); its own decision, never the
        server's. The default refuses plaintext and updates outside secure aggregation.
    partition_id:
        An ordering key for the server, not a secret.
    authentication:
        How this data owner authenticates the other clients' SecAgg keys (its identity and
        pins, or the explicit semi-honest mode); ``None`` refuses secure aggregation.
    device:
        Where the side adapters and head run (:func:`fedfm.models.device.resolve_device`;
        default the CPU). Decrypted values move there and the replies' values back to numpy.
    """

    def __init__(
        self,
        data: ClientData | TextClientData | Callable[[], ClientData | TextClientData],
        backend: CryptoBackend | None = None,
        *,
        policy: DataOwnerPolicy | None = None,
        partition_id: int = -1,
        authentication: KeyAuthentication | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._data = data
        self.device = device if device is not None else torch.device("cpu")
        self._backend = backend
        self.policy = policy or DataOwnerPolicy()
        self.partition_id = partition_id
        self.authentication = authentication
        # The last restored key owner and the state arrays it came from: a role that lives
        # across messages (a site process) restores its keys once, not per message.
        self._key_owner: tuple[list[np.ndarray], KeyOwner] | None = None

    @property
    def data(self) -> ClientData | TextClientData:
        """The data owner's data; a callable given for it is called once, when first needed
        (a ClientApp process that only answers a refresh never loads it)."""
        if not isinstance(self._data, ClientData | TextClientData):
            self._data = self._data()
        return self._data

    def backend_for(self, name: str) -> CryptoBackend:
        """The backend called ``name``: the data owner's own if it set one (which must match)."""
        if self._backend is None:
            self._backend = get_backend(name)
        if self._backend.name != name:
            raise ProtocolError(
                f"the server asks for backend {name!r}; this data owner encrypts with "
                f"{self._backend.name!r}"
            )
        return self._backend

    # -- entry point -----------------------------------------------------------------------
    def handle(self, envelope: Envelope, state: ClientState) -> tuple[Envelope, ClientState]:
        """Answer ``envelope`` from ``state``; raises :class:`ProtocolError` if it does not fit."""
        if state.stage == LEFT:
            raise ProtocolError(
                f"{envelope.message_type!r} refused: this data owner left the run after refusing "
                f"a request in round {state.round}"
            )
        if envelope.message_type not in ALLOWED.get(state.stage, set()):
            raise ProtocolError(
                f"client in stage {state.stage!r} cannot accept {envelope.message_type!r}"
            )
        if envelope.message_type == SETUP:
            return self._setup(envelope, state)
        if envelope.message_type == TRAIN_SECAGG:
            return self._secure_aggregation(envelope, state)
        backend = self.backend_for(str(state.config.get("backend")))
        key = self._restored_key_owner(backend, state.group("key"))
        try:
            if envelope.message_type == REFRESH:
                # Masked ciphertexts only: the client re-encrypts them and learns nothing; its
                # state does not change.
                fresh = key.refresh(envelope.arrays)
                return Envelope(REFRESH, envelope.node_id, envelope.round, fresh, {}), state
            if envelope.message_type == TRAIN_LOSS:
                return self._loss(envelope, state, key)
            if envelope.message_type == EVALUATE_CACHED:
                return self._kept_evaluation(envelope, state)
            return self._block(envelope, state, key)
        except FedfmError as error:
            # Whether the client refuses a ciphertext the server chose is itself an answer (an
            # oracle: "is this value in range / a label of mine / my loss?"). Answering once
            # leaks at most that one bit; staying to answer again would let the server search.
            raise ProtocolAbort(
                f"{error} (this data owner leaves the run: after a refusal it answers nothing "
                "more, so the fact of refusing tells the server at most one bit)",
                state=left_run(state),
            ) from error

    def _restored_key_owner(
        self, backend: CryptoBackend, arrays: dict[str, np.ndarray]
    ) -> KeyOwner:
        """The key owner of ``arrays``: restored once while the same arrays come back."""
        values = [arrays[name] for name in sorted(arrays)]
        cached = self._key_owner
        if (
            cached is not None
            and len(cached[0]) == len(values)
            and all(old is new for old, new in zip(cached[0], values, strict=True))
        ):
            return cached[1]
        owner = backend.restore_key_owner(arrays)
        self._key_owner = (values, owner)
        return owner

    # -- steps -------------------------------------------------------------------------------
    def _setup(self, envelope: Envelope, state: ClientState) -> tuple[Envelope, ClientState]:
        try:
            config = DoubleBlindConfig.from_config(envelope.config)
        except (ConfigError, TypeError) as error:
            raise ProtocolError(f"setup carries invalid settings: {error}") from error
        self.policy.check_setup(
            backend=config.backend,
            secure_aggregation=config.secure_aggregation,
            rounds=config.rounds,
        )
        backend = self.backend_for(config.backend)
        text = envelope.config.get(INPUT) == TEXT_INPUT
        data, classes = self.data, self.data.num_classes
        if text != isinstance(data, TextClientData):
            raise ProtocolError(
                f"the server's model reads {'texts' if text else 'images'}; this data owner "
                f"holds {'texts' if isinstance(data, TextClientData) else 'images'}"
            )
        geometry = geometry_from(envelope.config)
        if isinstance(data, TextClientData):
            inputs, masks = self._embedded(envelope, data, geometry)
        else:
            inputs, masks = (data.train_images, data.eval_images), {}
        key = backend.create_key_owner(geometry=geometry)
        uploads = {
            "train_images": [key.encrypt(inputs[0])],
            "train_labels": [key.encrypt(one_hot(data.train_labels, classes))],
            "eval_images": [key.encrypt(inputs[1])],
            "eval_labels": [key.encrypt(one_hot(data.eval_labels, classes))],
        }
        reply = batch_reply(
            envelope,
            uploads,
            public_context=key.public_context(),
            num_classes=classes,
            num_train=len(data.train_labels),
            num_eval=len(data.eval_labels),
            backend=backend.name,
            partition_id=self.partition_id,
        )
        reply.arrays.update(masks)
        # a new key, the rounds already done stay done
        state = replace(
            state,
            stage="ready",
            round=0,
            block=0,
            num_blocks=0,
            config={**config.to_config(), **({INPUT: TEXT_INPUT} if text else {})},
            arrays=pack_arrays("key", key.secret_state()),
        )
        return reply, state

    def _embedded(
        self, envelope: Envelope, data: TextClientData, geometry: ModelGeometry | None
    ) -> tuple[tuple[np.ndarray, np.ndarray], dict[str, np.ndarray]]:
        """The training and held-out texts embedded with the server's tables, and the key
        masks to upload: the texts' own, or all real with the policy's ``hide_text_lengths``
        (the server then learns no length, and the model attends to padding as to text)."""
        tokens = data.train_tokens.shape[1]
        if geometry is None or geometry.tokens != tokens:
            raise ProtocolError(
                f"the server's text model reads {None if geometry is None else geometry.tokens} "
                f"tokens per text; this data owner's texts are padded to {tokens}"
            )
        eps = envelope.config.get("embedding_eps")
        tables = unpack_arrays(envelope, EMBEDDING)
        embedded = (
            embed_tokens(tables, eps, data.train_tokens),  # type: ignore[arg-type]
            embed_tokens(tables, eps, data.eval_tokens),  # type: ignore[arg-type]
        )
        masks = {"train_key_mask": data.train_key_mask, "eval_key_mask": data.eval_key_mask}
        if self.policy.hide_text_lengths:
            masks = {name: np.ones_like(mask) for name, mask in masks.items()}
        return embedded, masks

    def _open_round(self, request: BlockRequest, kind: str, state: ClientState) -> ClientState:
        """Start round ``request.round`` (block 1): only forward, each round trained and
        evaluated at most once; an open round of another kind is discarded."""
        server_round = request.round
        if kind == "train":
            done = max(state.trained_round, state.evaluated_round)
            if server_round <= done:
                raise ProtocolError(
                    f"train.block 1 of round {server_round}: this client already took part in "
                    f"round {done} (rounds only move forward; a round is trained once)"
                )
        else:
            _check_evaluation_round(EVALUATE_BLOCK, server_round, state)
        self._check_round(server_round, state)
        self.policy.check_blocks(request.num_blocks)
        if not request.global_arrays:
            raise ProtocolError(f"{request.message_type} block 1 lacks the global adapter")
        self._check_batch_sizes(request, kind, DoubleBlindConfig.from_config(state.config))
        settings = run_settings(state.config)
        if request.evaluation_batches:
            settings[RIDING] = request.evaluation_batches
        arrays = _between_rounds(state.arrays)
        arrays.update(pack_arrays("params", request.global_arrays))
        counters = (
            {"trained_round": server_round}
            if kind == "train"
            else {"evaluated_round": server_round}
        )
        return replace(
            state,
            stage=kind,
            round=server_round,
            block=0,
            num_blocks=request.num_blocks,
            config=settings,
            arrays=arrays,
            **counters,
        )

    def _check_round(self, server_round: int, state: ClientState) -> None:
        """A round within the run the server announced at setup and within this data owner's
        ``max-rounds``: an evaluation on kept outputs costs the server nothing, so without a
        bound it could ask for confusion matrices under heads of its choosing at will."""
        announced = DoubleBlindConfig.from_config(state.config).rounds
        if server_round > announced:
            raise ProtocolError(
                f"round {server_round} is past the {announced} rounds the server announced at setup"
            )
        self.policy.check_round(server_round)

    def _check_batch_sizes(
        self, request: BlockRequest, kind: str, config: DoubleBlindConfig
    ) -> None:
        """Batches as the run's settings allow: training ``batches_per_round`` of ``n``
        distinct samples at most, evaluation (alone, or riding along a training round as its
        last ``evaluation_batches``) every held-out sample once in batches of ``n`` to
        ``2n - 1``."""
        n = config.batch_size
        riding = request.evaluation_batches
        if kind == "evaluate" and riding:
            raise ProtocolError("evaluate.block 1 says some of its batches ride along")
        held_out = request.batch_sizes[len(request.batch_sizes) - riding :] if riding else []
        sizes = request.batch_sizes[: len(request.batch_sizes) - riding]
        if kind == "train":
            total = len(self.data.train_labels)
            if len(sizes) > config.batches_per_round or any(size != n for size in sizes):
                raise ProtocolError(
                    f"train.block 1 carries batches of {sizes} samples; the run trains at most "
                    f"{config.batches_per_round} batches of {n}"
                )
            if sum(sizes) > total:
                raise ProtocolError(f"train.block 1 asks for {sum(sizes)} of {total} samples")
        else:
            held_out = sizes
        if kind == "evaluate" or riding:
            total = len(self.data.eval_labels)
            if any(not n <= size < 2 * n for size in held_out) or sum(held_out) != total:
                raise ProtocolError(
                    f"{request.message_type} 1 carries held-out batches of {held_out} samples; "
                    f"expected all {total} held-out samples in batches of {n} to {2 * n - 1}"
                )

    def _block(
        self, envelope: Envelope, state: ClientState, key: KeyOwner
    ) -> tuple[Envelope, ClientState]:
        request = BlockRequest.from_envelope(envelope, key.load)
        kind = "train" if envelope.message_type == TRAIN_BLOCK else "evaluate"
        if request.block == 1:
            state = self._open_round(request, kind, state)
        elif (state.stage, state.round, state.block, state.num_blocks) != (
            kind,
            envelope.round,
            request.block - 1,
            request.num_blocks,
        ):
            raise ProtocolError(
                f"{envelope.message_type} block {request.block} of {request.num_blocks} in round "
                f"{envelope.round} does not follow block {state.block} of {state.num_blocks} in "
                f"round {state.round} ({state.stage})"
            )
        if request.block > 1 and request.evaluation_batches != state.config.get(RIDING, 0):
            raise ProtocolError(
                f"{envelope.message_type} block {request.block}: {request.evaluation_batches} "
                f"held-out batches ride along, block 1 said {state.config.get(RIDING, 0)}"
            )
        first = state.group("block1")
        if request.block > 1 and request.batch_sizes != [
            first[str(i)].shape[0] for i in range(len(first))
        ]:
            raise ProtocolError(
                f"{envelope.message_type} block {request.block}: batches of "
                f"{request.batch_sizes} rows differ from block 1's"
            )
        sets = request.sets()
        plain = _unpacked(key, request.batches, sets, request.batch_sizes)
        if request.block > 1 and any(
            plain[str(i)].shape[1:] != first[str(i)].shape[1:] for i in range(len(first))
        ):
            raise ProtocolError(
                f"{envelope.message_type} block {request.block}: hidden states of another shape "
                "than block 1's"
            )
        arrays = state.with_group(f"block{request.block}", plain)
        state = replace(state, stage=kind, block=request.block, arrays=arrays)
        if request.block < request.num_blocks:
            # re-encrypted as they came: one set of ciphertexts per set of batches
            fresh = [
                key.encrypt(np.concatenate([plain[str(i)] for i in members])) for members in sets
            ]
            return batch_reply(envelope, {"batch": fresh}), state

        sizes = request.batch_sizes
        for index, (wrap, steps, size) in enumerate(
            zip(request.wrap, request.steps, sizes, strict=True)
        ):
            _check_permutations(f"batch {index}", wrap, steps, size, request.num_blocks)
        relatives = {f"wrap.{i}": w for i, w in enumerate(request.wrap)}
        relatives |= {f"steps.{i}": s for i, s in enumerate(request.steps)}
        state = replace(state, arrays=state.with_group("perm", relatives))
        if state.config.get(INPUT) == TEXT_INPUT:
            # mean pooling over real tokens needs every batch's key mask in label order
            check_label_order_masks(request.key_masks, sizes, int(plain["0"].shape[1]))
            masks = {str(i): mask for i, mask in enumerate(request.key_masks)}
            state = replace(state, arrays=state.with_group(KEY_MASKS, masks))
        elif request.key_masks:
            raise ProtocolError(f"{envelope.message_type}: key masks for an image model")
        # the held-out batches: all of an evaluation's, or the last ones riding along training
        training = len(sizes) - request.evaluation_batches if kind == "train" else 0
        held_out = list(range(training, len(sizes)))
        labels: list[np.ndarray] = []
        if held_out:
            if len(request.labels) != len(sets):
                raise ProtocolError(
                    f"{envelope.message_type}: the last block lacks the encrypted labels"
                )
            decrypted = _unpacked(key, request.labels, sets, sizes)
            every = [
                self._labels(
                    decrypted[str(i)],
                    size,
                    "held-out labels" if i >= training else "training labels",
                )
                for i, size in enumerate(sizes)
            ]
            labels = every[training:]
            # every held-out sample once: the labels are exactly the client's own held-out ones
            self._check_label_counts(np.concatenate(labels), self.data.eval_labels, exact=True)
            if training:
                train_labels = np.concatenate(every[:training])
                self._check_label_counts(train_labels, self.data.train_labels, exact=False)
            state = self._keep_held_out(state, request.num_blocks, held_out, labels)
        if kind == "evaluate":
            logits = self._forward(state, len(sizes))
            state = replace(state, stage="ready")
            return self._evaluation_reply(envelope, logits, labels), state
        logits = self._forward(state, training)
        with torch.no_grad():
            probs = [key.encrypt(to_numpy(batch.softmax(dim=1))) for batch in logits]
            log_probs = [key.encrypt(to_numpy(batch.log_softmax(dim=1))) for batch in logits]
        kept: dict[str, Any] = {"kept": True} if held_out else {}
        return batch_reply(envelope, {"probs": probs, "log_probs": log_probs}, **kept), state

    @staticmethod
    def _keep_held_out(
        state: ClientState, num_blocks: int, held_out: list[int], labels: list[np.ndarray]
    ) -> ClientState:
        """``state`` keeping the outputs, relative permutations and labels of the held-out
        batches ``held_out`` (renumbered from 0) under :data:`KEPT`; batches riding along a
        training round leave the round's groups, which keep the training batches only."""
        kept: dict[str, np.ndarray] = {}
        arrays = dict(state.arrays)
        groups = [f"block{b}" for b in range(1, num_blocks + 1)]
        for new, old in enumerate(held_out):
            for group in groups:
                kept[f"{group}.{new}"] = state.group(group)[str(old)]
            for name in ("wrap", "steps"):
                kept[f"perm.{name}.{new}"] = state.group("perm")[f"{name}.{old}"]
            if str(old) in state.group(KEY_MASKS):
                kept[f"{KEY_MASKS}.{new}"] = state.group(KEY_MASKS)[str(old)]
            kept[f"labels.{new}"] = labels[new]
        if held_out[0] > 0:  # riding along: the training batches stay for the loss
            for old in held_out:
                for group in groups:
                    del arrays[f"{group}.{old}"]
                for name in ("wrap", "steps"):
                    del arrays[f"perm.{name}.{old}"]
                arrays.pop(f"{KEY_MASKS}.{old}", None)
        state = replace(state, arrays=arrays)
        return replace(state, arrays=state.with_group(KEPT, kept))

    def _evaluation_reply(
        self, envelope: Envelope, logits: list[torch.Tensor], labels: list[np.ndarray]
    ) -> Envelope:
        """The confusion matrix of ``logits`` against ``labels``; the client keeps its outputs."""
        confusion = np.zeros((self.data.num_classes,) * 2, dtype=np.int64)
        for batch_logits, truth in zip(logits, labels, strict=True):
            np.add.at(confusion, (truth, to_numpy(batch_logits.argmax(dim=1))), 1)
        return Envelope(
            envelope.message_type,
            envelope.node_id,
            envelope.round,
            {"confusion": confusion},
            {"num_examples": int(confusion.sum()), "kept": True},
        )

    def _kept_evaluation(
        self, envelope: Envelope, state: ClientState
    ) -> tuple[Envelope, ClientState]:
        """Evaluate the server's new adapter and head on the outputs kept from the first
        evaluation; answer ``kept: False`` (state unchanged) if there are none, and the server
        runs a full evaluation of this round instead."""
        kept = state.group(KEPT)
        num_blocks = int(require_config(envelope, "num_blocks", int))
        count = sum(1 for name in kept if name.startswith("labels."))
        if count == 0 or any(f"block{num_blocks}.{i}" not in kept for i in range(count)):
            lost: dict[str, Any] = {"kept": False}
            return Envelope(EVALUATE_CACHED, envelope.node_id, envelope.round, config=lost), state
        _check_evaluation_round(EVALUATE_CACHED, envelope.round, state)
        self._check_round(envelope.round, state)
        global_arrays = unpack_arrays(envelope, "global")
        if not global_arrays:
            raise ProtocolError(f"{EVALUATE_CACHED} lacks the global adapter")
        view = {name: value for name, value in kept.items() if not name.startswith("labels.")}
        view |= pack_arrays("params", global_arrays)
        logits = self._forward(replace(state, arrays=view), count)
        labels = [kept[f"labels.{i}"] for i in range(count)]
        state = replace(
            state,
            stage="ready",
            round=envelope.round,
            block=0,
            evaluated_round=envelope.round,
            config=run_settings(state.config),
            arrays=_between_rounds(state.arrays),
        )
        return self._evaluation_reply(envelope, logits, labels), state

    def _labels(self, values: np.ndarray, rows: int, what: str) -> np.ndarray:
        """The class of each row of decrypted one-hot ``values``; a :class:`ProtocolError` if
        they are not ``rows`` one-hot rows over the task's classes (within CKKS error)."""
        classes = self.data.num_classes
        if values.shape != (rows, classes):
            raise ProtocolError(f"{what} have shape {values.shape}, expected {(rows, classes)}")
        rounded = np.rint(values)
        if (
            np.abs(values - rounded).max(initial=0.0) > LABEL_TOLERANCE
            or not np.isin(rounded, (0.0, 1.0)).all()
            or not (rounded.sum(axis=1) == 1).all()
        ):
            raise ProtocolError(
                f"{what} are not one-hot rows: refused (not a label this client holds)"
            )
        return rounded.argmax(axis=1)

    def _check_label_counts(self, labels: np.ndarray, own: np.ndarray, *, exact: bool) -> None:
        """The server's labels are the client's own: per class as many (``exact``) or at most
        as many as the client holds. Anything else is a ciphertext the server chose."""
        classes = self.data.num_classes
        got = np.bincount(labels, minlength=classes)
        held = np.bincount(own, minlength=classes)
        if (exact and not np.array_equal(got, held)) or (got > held).any():
            # neither histogram goes into the message: one is the client's, the other decrypted
            raise ProtocolError("the labels the server returned are not this client's: refused")

    def _loss(
        self, envelope: Envelope, state: ClientState, key: KeyOwner
    ) -> tuple[Envelope, ClientState]:
        if (state.stage, state.round) != ("train", envelope.round) or (
            state.block != state.num_blocks or state.num_blocks == 0
        ):
            raise ProtocolError(
                f"train.loss for round {envelope.round} but the client is at block {state.block} "
                f"of {state.num_blocks} in round {state.round} ({state.stage}): the loss comes "
                "after the last block, once"
            )
        count = len(state.group("block1"))
        if require_count(envelope) != count:
            raise ProtocolError(
                f"train.loss carries {envelope.config.get('num_batches')!r} "
                f"batches, the round has {count}"
            )
        losses = unpack_batches(envelope, "loss", count, key.load)
        gradients = unpack_batches(envelope, "grad", count, key.load)
        model = self._adapter(state)
        logits = self._forward(state, count, model=model)
        # The client uses only values of its own computation: the labels the gradient
        # (p - y)/n implies (checked one-hot and its own), then its own loss and gradient. The
        # server's loss must agree; a reply never carries a value the server had decrypted.
        own_losses, own_gradients, all_labels = [], [], []
        for index, (out, loss, gradient) in enumerate(zip(logits, losses, gradients, strict=True)):
            rows = out.shape[0]
            probs = to_numpy(out.detach().softmax(dim=1))
            decrypted = key.decrypt_received(gradient)
            if decrypted.shape != probs.shape:
                raise ProtocolError(
                    f"train.loss gradient {index} has shape {decrypted.shape}, expected "
                    f"{probs.shape}"
                )
            labels = self._labels(
                probs - rows * decrypted, rows, f"labels implied by gradient {index}"
            )
            one_hot_labels = one_hot(labels, self.data.num_classes)
            # from the exact log-softmax the client encrypted for the server, not log(probs):
            # a probability below float precision would clamp and differ from the server's loss
            log_probs = to_numpy(out.detach().log_softmax(dim=1))
            own_loss = float(-(one_hot_labels * log_probs).sum(axis=1).mean())
            # one value: (1,) under simulate, a (1, 1) row under CKKS
            server_loss = key.decrypt_received(loss).reshape(-1)
            if server_loss.size != 1 or abs(float(server_loss[0]) - own_loss) > LABEL_TOLERANCE:
                # no value in the message: the server must not read what the client decrypted
                raise ProtocolError(
                    f"train.loss {index}: the server's loss is not the cross-entropy of this "
                    "client's predictions: refused"
                )
            own_losses.append(own_loss)
            own_gradients.append((probs - one_hot_labels) / rows)
            all_labels.append(labels)
        self._check_label_counts(np.concatenate(all_labels), self.data.train_labels, exact=False)
        objective = cast(
            torch.Tensor,
            sum(
                (out * torch.from_numpy(grad.astype(np.float32)).to(self.device)).sum()
                for out, grad in zip(logits, own_gradients, strict=True)
            ),
        )
        (objective / count).backward()
        config = DoubleBlindConfig.from_config(state.config)
        momentum = state.group("momentum")
        new_momentum = {}
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if parameter.grad is None:
                    raise InvariantError(f"internal: no gradient for {name}")
                velocity = (
                    config.momentum
                    * torch.from_numpy(
                        momentum.get(name, np.zeros(parameter.shape, dtype=np.float32))
                    ).to(self.device)
                    + parameter.grad
                )
                parameter.sub_(config.lr * config.lr_factor(state.round) * velocity)
                new_momentum[name] = to_numpy(velocity).copy()
        params = model.get_arrays()
        train_loss = float(np.mean(own_losses))
        num_examples = count * int(state.group("block1")["0"].shape[0])
        metrics: dict[str, ConfigValue] = {"num_examples": num_examples, "train_loss": train_loss}
        arrays = _between_rounds(state.arrays)
        arrays.update(pack_arrays("momentum", new_momentum))  # replaces the old momentum
        closed = replace(state, block=0, num_blocks=0, arrays=arrays)
        if not config.secure_aggregation:
            reply = Envelope(
                envelope.message_type,
                envelope.node_id,
                envelope.round,
                pack_arrays("params", params),
                metrics,
            )
            return reply, replace(closed, stage="ready")
        received = state.group("params")
        arrays = {
            **arrays,
            **pack_arrays("update", {k: v - received[k] for k, v in params.items()}),
        }
        reply = Envelope(envelope.message_type, envelope.node_id, envelope.round, {}, metrics)
        settings = {**state.config, UPDATE_WEIGHT: num_examples}
        return reply, replace(closed, stage="trained", config=settings, arrays=arrays)

    def _secure_aggregation(
        self, envelope: Envelope, state: ClientState
    ) -> tuple[Envelope, ClientState]:
        """One SecAgg stage on the update this round's training left in the state."""
        if self.authentication is None:
            raise ConfigError(
                "this data owner has no SecAgg identity: without one it cannot tell its "
                "neighbours' keys from the server's (ClientApp: set node config 'identity-key' "
                "and 'secagg-pins', or 'secagg-mode' = 'semi-honest' to trust the server)"
            )
        request = decode_request(envelope.arrays, envelope.config)
        if isinstance(request, UnmaskRequest):  # the aggregate: the survivors and this client
            self.policy.check_aggregate(len(request.survivors) + 1)
        expected = "trained" if request.stage == ADVERTISE_KEYS else "secagg"
        if (state.stage, state.round) != (expected, envelope.round) or (
            request.round_id != envelope.round
        ):
            raise ProtocolError(
                f"{TRAIN_SECAGG} {request.stage} for round {envelope.round} (secagg round "
                f"{request.round_id}), but the client is in round {state.round} ({state.stage})"
            )
        secagg_arrays = {k: v for k, v in state.arrays.items() if k.startswith(SECAGG)}
        secagg_config = {k: v for k, v in state.config.items() if k.startswith(SECAGG)}
        previous = (
            ClientSecAggState()
            if request.stage == ADVERTISE_KEYS
            else ClientSecAggState.from_records(secagg_arrays, secagg_config)
        )
        update = MaskedUpdate(state.group("update"), int(state.config[UPDATE_WEIGHT]))
        reply, secagg_state = handle_secagg(
            previous, request, update=update, authentication=self.authentication
        )
        answer = Envelope(TRAIN_SECAGG, envelope.node_id, envelope.round, *reply.to_records())
        kept = {k: v for k, v in state.arrays.items() if not k.startswith(SECAGG)}
        if request.stage == UNMASK:  # the last stage: the update has served its purpose
            kept = {k: v for k, v in kept.items() if not k.startswith("update.")}
            return answer, replace(
                state, stage="ready", block=0, config=run_settings(state.config), arrays=kept
            )
        new_arrays, new_config = secagg_state.to_records()
        config = {**run_settings(state.config), UPDATE_WEIGHT: update.num_examples, **new_config}
        return answer, replace(
            state, stage="secagg", block=0, config=config, arrays={**kept, **new_arrays}
        )

    # -- local model -------------------------------------------------------------------------
    def _adapter(self, state: ClientState) -> SideAdapterHead:
        config = DoubleBlindConfig.from_config(state.config)
        params = state.group("params")
        first = state.group("block1")["0"]
        model = SideAdapterHead(
            num_blocks=state.group("perm")["steps.0"].shape[0],
            dim=first.shape[-1],
            num_classes=self.data.num_classes,
            rank=config.rank,
            alpha=config.alpha,
            pooling="mean" if state.config.get(INPUT) == TEXT_INPUT else "class-token",
        )
        model.set_arrays(params)
        return model.to(self.device)

    def _forward(
        self, state: ClientState, count: int, *, model: SideAdapterHead | None = None
    ) -> list[torch.Tensor]:
        model = model or self._adapter(state)
        perms = state.group("perm")
        masks = state.group(KEY_MASKS)
        outputs = []
        for i in range(count):
            blocks = [
                torch.from_numpy(state.group(f"block{b}")[str(i)]).to(self.device)
                for b in range(1, model.num_blocks + 1)
            ]
            wrap = torch.from_numpy(perms[f"wrap.{i}"]).to(self.device)
            steps = torch.from_numpy(perms[f"steps.{i}"]).to(self.device)
            mask = torch.from_numpy(masks[str(i)]).to(self.device) if masks else None
            outputs.append(model(blocks, wrap, steps, mask))
        return outputs


def unpack_params(envelope: Envelope) -> dict[str, np.ndarray]:
    """The adapter and head arrays a client's ``train.loss`` reply carries."""
    params = unpack_arrays(envelope, "params")
    if not params:
        raise ProtocolError("update reply carries no parameters")
    return params
