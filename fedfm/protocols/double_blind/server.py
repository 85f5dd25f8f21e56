"""The learning service provider's role: encrypted block-by-block inference with permutations.

The server holds the FHE-friendly model and, per client, an :class:`~fedfm.crypto.Evaluator`
built from that client's public context, the client's encrypted uploads and, while a round is in
flight, the batches' indices and permutations. It never holds a secret key.

Per round and client (spec ``001`` §3.2-3.3): draw ``batches_per_round`` batches of ``n``
samples; for ``l = 1 .. L`` evaluate block ``l`` on each encrypted batch, re-order it into a
fresh permutation ``pi_l`` and send it; the client re-encrypts and returns it. The batches travel
packed into sets of ciphertexts (as many as one set holds, :attr:`~fedfm.crypto.backend.
Evaluator.samples_per_set`): a block costs about the same for one batch as for a full set, and
each batch keeps its own permutations (a set's permutation is block-diagonal). With the last
block go the relative permutations. In the first evaluated round the client's held-out batches
ride along in the same sets (:meth:`DoubleBlindServer.start`, ``with_evaluation``); the client
keeps their outputs and every evaluation is one ``evaluate.cached`` round trip on them. The
client answers with encrypted ``softmax`` and
``log_softmax`` of its logits (rows in order ``pi_{L+1}``); the server permutes its encrypted
one-hot labels into the same order and returns the encrypted mean cross-entropy and logit
gradient. What the server sees: ciphertexts, their sizes, the number of samples per client and
its training loss, and after aggregation the global adapter and head. With secure aggregation
(the default) the ``train.loss`` reply carries no parameters and the server learns only the
weighted average of the round's updates (:mod:`fedfm.protocols.secure_aggregation`).

With an encrypted backend the server's evaluation runs out of depth inside a block; each stage
(batch selection, a block, the loss) is then a generator that sends ``query.refresh`` requests
with masked ciphertexts to the client and resumes on its answers, all batches of a round together
(:func:`~fedfm.crypto.backend.lockstep`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedfm.crypto.backend import (
    CryptoBackend,
    EncryptedBatch,
    Evaluator,
    ModelGeometry,
    R,
    Work,
    lockstep,
)
from fedfm.crypto.randomness import RandomSource, SecretStream
from fedfm.errors import InvariantError, ProtocolError
from fedfm.protocols.double_blind.adapter import SideAdapterHead
from fedfm.protocols.double_blind.config import (
    EVALUATE_BLOCK,
    EVALUATE_CACHED,
    REFRESH,
    SETUP,
    TRAIN_BLOCK,
    TRAIN_LOSS,
    DoubleBlindConfig,
    revealed_blocks,
)
from fedfm.protocols.double_blind.messages import (
    BlockRequest,
    geometry_config,
    pack_arrays,
    pack_batches,
    pack_sets,
    require_config,
    unpack_arrays,
    unpack_batches,
)
from fedfm.protocols.double_blind.permutation import (
    RoundPermutations,
    draw_round_permutations,
    relative,
)
from fedfm.protocols.double_blind.text import (
    TEXT_INPUT,
    check_uploaded_masks,
    embedding_arrays,
    is_text_model,
)
from fedfm.runtime.transport import Envelope

if TYPE_CHECKING:  # annotations only: timm stays out of a data owner's ClientApp process
    from fedfm.models.fhe_text import FheTextClassifier
    from fedfm.models.fhe_vit import FheViT

    ServerModel = FheViT | FheTextClassifier


@dataclass(frozen=True)
class ClientUpdate:
    """A client's trained adapter and head after a round (what aggregation combines).

    Under secure aggregation ``arrays`` is empty: the client keeps its update for the SecAgg
    stages and the server knows only its number of examples and training loss.
    """

    node_id: int
    arrays: dict[str, np.ndarray]
    num_examples: int
    train_loss: float


@dataclass(frozen=True)
class EvaluationResult:
    """A client's confusion matrix on its held-out data (rows: truth, columns: prediction)."""

    node_id: int
    confusion: np.ndarray


Stage = Generator[Envelope, Envelope, Envelope]
"""Server work between two protocol messages: yields refresh requests, returns the next message."""


@dataclass
class _InFlight:
    kind: str
    round: int
    block: int
    indices: list[np.ndarray]
    permutations: list[RoundPermutations]
    current: list[EncryptedBatch]  # one per set of batches
    sets: list[list[int]] = field(default_factory=list)  # the batches of each set
    stage: Stage | None = None  # waiting for a refresh answer
    refreshes: int = 0  # refresh round trips towards the next block message (progress lines)
    # an evaluation on the client's kept outputs: the global arrays, for a full one if needed
    kept_evaluation: dict[str, np.ndarray] | None = None
    # held-out batches riding along a training round (the last ones of ``indices``, as rows of
    # the joined upload); 0 once the client said it kept their outputs
    evaluation_batches: int = 0
    # a text model: the key masks of the upload ``indices`` select from (plaintext)
    key_masks: np.ndarray | None = None

    def packed(self, per_batch: list[np.ndarray], offsets: bool = False) -> list[np.ndarray]:
        """Per-batch index arrays joined per set; with ``offsets`` each batch's (orders within
        its batch) shifted to its rows in the set."""
        joined = []
        for members in self.sets:
            parts, start = [], 0
            for index in members:
                parts.append(per_batch[index] + (start if offsets else 0))
                start += len(per_batch[index])
            joined.append(np.concatenate(parts))
        return joined


def model_geometry(model: ServerModel) -> ModelGeometry:
    """Tokens per sample and patch size of ``model``: what a packing data owner needs (a text
    model's "patch" is one token)."""
    if is_text_model(model):
        return ModelGeometry(int(model.max_tokens), 1)
    embed = model.vit.patch_embed
    return ModelGeometry(embed.num_patches + model.vit.num_prefix_tokens, embed.patch_size[0])


@dataclass
class ClientSession:
    """What the server keeps about one client: public evaluator and encrypted data."""

    evaluator: Evaluator
    # the uploaded patches as they came (n, C, H, W): each round selects its batches from them
    # and embeds only those; a text model's embedded tokens (n, T, D)
    train_images: EncryptedBatch
    train_labels: EncryptedBatch
    eval_images: EncryptedBatch
    eval_labels: EncryptedBatch
    num_train: int
    num_eval: int
    order_key: int = -1
    in_flight: _InFlight | None = field(default=None)
    # the client said it keeps the revealed outputs of its held-out set (from a full
    # evaluation or from a training round the held-out set rode along)
    evaluation_kept: bool = False
    # images and labels of both uploads in one batch each, and the row where the held-out
    # samples start (:meth:`~fedfm.crypto.backend.Evaluator.join`): made for the first round
    # the held-out set rides along
    joined: tuple[EncryptedBatch, EncryptedBatch, int] | None = None
    # a text model: the uploaded key masks (n, T), True at real tokens
    train_key_mask: np.ndarray | None = None
    eval_key_mask: np.ndarray | None = None

    def key_masks(self, kind: str, joined: bool = False) -> np.ndarray | None:
        """The key masks of the upload a ``kind`` round selects from (of the joined upload, rows
        as :meth:`joined_uploads` has them, with ``joined``); ``None`` for images."""
        if self.train_key_mask is None or self.eval_key_mask is None:
            return None
        if not joined:
            return self.train_key_mask if kind == "train" else self.eval_key_mask
        offset = self.joined_uploads()[2]
        rows = np.ones((offset + self.num_eval, self.train_key_mask.shape[1]), dtype=np.bool_)
        rows[: self.num_train] = self.train_key_mask
        rows[offset:] = self.eval_key_mask
        return rows

    def joined_uploads(self) -> tuple[EncryptedBatch, EncryptedBatch, int]:
        """Training and held-out images, then labels, in one batch each; the held-out offset."""
        if self.joined is None:
            images, offset = self.evaluator.join(self.train_images, self.eval_images)
            labels, label_offset = self.evaluator.join(self.train_labels, self.eval_labels)
            if label_offset != offset:
                raise InvariantError("images and labels of one upload join at different rows")
            self.joined = (images, labels, offset)
        return self.joined


def balanced_accuracy(confusion: np.ndarray) -> float:
    """Mean per-class recall over the classes that occur (the paper's metric)."""
    support = confusion.sum(axis=1)
    present = support > 0
    if not present.any():
        return float("nan")
    return float(np.mean(np.diag(confusion)[present] / support[present]))


class DoubleBlindServer:
    """Drives the server side of each client's round; pure logic, no transport."""

    def __init__(
        self,
        model: ServerModel,
        config: DoubleBlindConfig,
        backend: CryptoBackend,
        *,
        num_classes: int,
        randomness: RandomSource | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.model = model.eval()
        self.config = config
        self.backend = backend
        self.num_classes = num_classes
        self.log = log
        # Batch draws, permutations and the adapter's initialisation: the server's secrets, from
        # a keyed stream cipher (the OS CSPRNG's key unless the operator gives a secret file).
        self.rng = randomness if randomness is not None else SecretStream()
        self.sessions: dict[int, ClientSession] = {}
        self.geometry = model_geometry(model)
        self.revealed = revealed_blocks(config.reveal, model.num_blocks)
        self.text = is_text_model(model)

    @property
    def hidden_size(self) -> int:
        """Width ``D`` of the hidden states the side adapter reads."""
        model = self.model
        if is_text_model(model):
            return int(model.hidden_size)
        return int(model.vit.embed_dim)

    def _vit(self) -> FheViT:
        """The model, on a step only a ViT takes."""
        model = self.model
        if is_text_model(model):
            raise InvariantError("internal: an image step on a text model")
        return model

    def _text_model(self) -> FheTextClassifier:
        """The model, on a step only a text encoder takes."""
        model = self.model
        if not is_text_model(model):
            raise InvariantError("internal: a text step on a ViT")
        return model

    @property
    def num_blocks(self) -> int:
        """Block outputs the client receives per batch (the model's blocks unless some are
        hidden by ``reveal``): the protocol's blocks, permutations and adapter taps."""
        return len(self.revealed)

    def ordered_nodes(self) -> list[int]:
        """Registered clients in a transport-independent order (partition id when known).

        The server's random draws follow this order, so an in-process run and a Flower run with
        the same server secret and partitions draw the same batches and permutations.
        """
        return sorted(self.sessions, key=lambda node: (self.sessions[node].order_key, node))

    # -- setup -----------------------------------------------------------------------------------
    def setup_request(self, node_id: int) -> Envelope:
        settings = {**self.config.client_settings(), **geometry_config(self.geometry)}
        if not self.text:
            return Envelope(SETUP, node_id, 0, {}, settings)
        # the data owner embeds its tokens itself (spec 001 embeds on the server: a token lookup
        # under CKKS is out of reach), so the model owner reveals its embedding layer
        tables, eps = embedding_arrays(self._text_model())
        settings |= {"input": TEXT_INPUT, "embedding_eps": eps}
        return Envelope(SETUP, node_id, 0, tables, settings)

    def on_setup(self, reply: Envelope) -> None:
        """Register a client from its uploads. The spec embeds them once, here (§3.2); fedfm keeps
        the patches and embeds each round's selected batches instead (:meth:`_start_stage`):
        under CKKS selecting from the embedding permuted twice as many ciphertexts (tiny ViT)."""
        context = require_config(reply, "public_context", bytes)
        backend = require_config(reply, "backend", str)
        if backend != self.backend.name:
            raise ProtocolError(f"client uses backend {backend!r}, server {self.backend.name!r}")
        classes = int(require_config(reply, "num_classes", int))
        if classes != self.num_classes:
            raise ProtocolError(f"client has {classes} classes, the task has {self.num_classes}")
        evaluator = self.backend.create_evaluator(context, self.geometry)
        uploads = {
            name: unpack_batches(reply, name, 1, evaluator.load)[0]
            for name in ("train_images", "train_labels", "eval_images", "eval_labels")
        }
        num_train = int(require_config(reply, "num_train", int))
        num_eval = int(require_config(reply, "num_eval", int))
        masks = (
            self._text_key_masks(reply, uploads, num_train, num_eval)
            if self.text
            else self._check_images(uploads, num_train, num_eval)
        )
        self.sessions[reply.node_id] = ClientSession(
            evaluator=evaluator,
            train_images=uploads["train_images"],
            train_labels=uploads["train_labels"],
            eval_images=uploads["eval_images"],
            eval_labels=uploads["eval_labels"],
            num_train=num_train,
            num_eval=num_eval,
            order_key=int(reply.config.get("partition_id", -1)),
            train_key_mask=masks.get("train"),
            eval_key_mask=masks.get("eval"),
        )

    def _check_images(
        self, uploads: dict[str, EncryptedBatch], num_train: int, num_eval: int
    ) -> dict[str, np.ndarray]:
        """Refuse image uploads the model cannot read; images have no key masks."""
        embed = self._vit().vit.patch_embed
        size = embed.img_size if embed.img_size is not None else (None, None)
        image_shape = (embed.proj.in_channels, *size)
        for name, count in (("train", num_train), ("eval", num_eval)):
            images, labels = uploads[f"{name}_images"], uploads[f"{name}_labels"]
            if images.shape[0] != count or labels.shape != (count, self.num_classes):
                raise ProtocolError(
                    f"{name} upload has images {images.shape} and labels {labels.shape}, "
                    f"expected {count} samples and {self.num_classes} classes"
                )
            # refused here, not at the first round that embeds a batch of them
            if len(images.shape) != 4 or any(
                want is not None and got != want
                for got, want in zip(images.shape[1:], image_shape, strict=True)
            ):
                raise ProtocolError(
                    f"{name} upload has images of shape {tuple(images.shape[1:])}; the model "
                    f"reads {image_shape} (channels, height, width)"
                )
        return {}

    def _text_key_masks(
        self,
        reply: Envelope,
        uploads: dict[str, EncryptedBatch],
        num_train: int,
        num_eval: int,
    ) -> dict[str, np.ndarray]:
        """A text client's key masks per upload, after checking its embedded tokens
        ``(n, T, D)``."""
        shape = (self.geometry.tokens, self.hidden_size)
        masks: dict[str, np.ndarray] = {}
        for name, count in (("train", num_train), ("eval", num_eval)):
            hidden, labels = uploads[f"{name}_images"], uploads[f"{name}_labels"]
            if tuple(hidden.shape) != (count, *shape) or labels.shape != (count, self.num_classes):
                raise ProtocolError(
                    f"{name} upload has hidden states {hidden.shape} and labels {labels.shape}, "
                    f"expected {(count, *shape)} (texts, tokens, width) and "
                    f"{(count, self.num_classes)}"
                )
            masks[name] = check_uploaded_masks(
                reply.arrays.get(f"{name}_key_mask"), count, shape[0], f"the {name} upload's"
            )
        return masks

    def initial_arrays(self, dim: int) -> dict[str, np.ndarray]:
        """The round-1 global adapter and head, initialised from the server's stream (every
        client receives them, so they are not secret once drawn)."""
        with torch.random.fork_rng():
            torch.manual_seed(self.rng.torch_seed())
            adapter = SideAdapterHead(
                num_blocks=self.num_blocks,
                dim=dim,
                num_classes=self.num_classes,
                rank=self.config.rank,
                alpha=self.config.alpha,
                pooling="mean" if self.text else "class-token",
            )
        return adapter.get_arrays()

    # -- rounds ----------------------------------------------------------------------------------
    def _batches(self, kind: str, session: ClientSession) -> list[np.ndarray] | None:
        n = self.config.batch_size
        total = session.num_train if kind == "train" else session.num_eval
        if total < n:
            return None
        if kind == "train":
            count = min(self.config.batches_per_round, total // n)
            chosen = self.rng.choice(total, size=count * n, replace=False)
            return list(chosen.reshape(count, n))
        # every held-out sample once, in batches of n .. 2n - 1 (all at least the minimum)
        return list(np.array_split(np.arange(total), total // n))

    def start(
        self,
        kind: str,
        node_id: int,
        server_round: int,
        global_arrays: dict[str, np.ndarray],
        *,
        with_evaluation: bool = False,
    ) -> Envelope | None:
        """Block 1 of a train or evaluate round; ``None`` if the client has too few samples.

        ``with_evaluation`` (training only): unless the client already keeps its held-out
        outputs, its held-out batches ride along in the training round's sets of ciphertexts
        (a block costs about the same for one set whatever it holds), the client keeps their
        outputs, and the round's evaluation is one ``evaluate.cached`` round trip."""
        session = self._session(node_id)
        indices = self._batches(kind, session)
        if indices is None:
            self.log(
                f"[fedfm] node {node_id}: fewer {kind} samples than the batch size "
                f"{self.config.batch_size}; it sits out this {kind} round"
            )
            session.in_flight = None
            return None
        if kind == "evaluate" and session.evaluation_kept:
            # The frozen blocks' outputs on the held-out set are what the client already holds:
            # no ciphertext, no refresh, one round trip (the client evaluates the new head).
            session.in_flight = _InFlight(
                kind, server_round, self.num_blocks, indices, [], [], kept_evaluation=global_arrays
            )
            return Envelope(
                EVALUATE_CACHED,
                node_id,
                server_round,
                pack_arrays("global", global_arrays),
                {"num_blocks": self.num_blocks},
            )
        inputs = session.train_images if kind == "train" else session.eval_images
        key_masks = session.key_masks(kind)
        riding = 0
        held_out = self._batches("evaluate", session) if kind == "train" else None
        if with_evaluation and not session.evaluation_kept and held_out is not None:
            inputs, _, offset = session.joined_uploads()
            indices = [*indices, *(batch + offset for batch in held_out)]
            riding = len(held_out)
            key_masks = session.key_masks(kind, joined=True)
        permutations = [
            draw_round_permutations(
                self.num_blocks, len(batch), self.rng, permute=self.config.permute
            )
            for batch in indices
        ]
        sets = pack_sets([len(batch) for batch in indices], session.evaluator.samples_per_set)
        session.in_flight = _InFlight(
            kind,
            server_round,
            0,
            indices,
            permutations,
            [],
            sets,
            evaluation_batches=riding,
            key_masks=key_masks,
        )
        return self._advance(session, self._start_stage(node_id, session, inputs, global_arrays))

    def position(self, node_id: int) -> str:
        """Where ``node_id``'s round stands, for progress lines: the block the server is
        evaluating and its refreshes so far, or the block message the client is answering."""
        session = self.sessions.get(node_id)
        flight = session.in_flight if session is not None else None
        if flight is None:
            return "done"
        step = flight.block + (flight.stage is not None)  # the step under way
        where = (
            f"{flight.kind} loss"  # the step after the last block
            if step > self.num_blocks
            else f"{flight.kind} block {step}/{self.num_blocks}"
        )
        if flight.stage is not None:
            return f"{where}, refresh {flight.refreshes}"
        return f"{where} at the client"

    def _advance(
        self, session: ClientSession, stage: Stage, reply: Envelope | None = None
    ) -> Envelope:
        """Run ``stage`` until it needs the client: a refresh request or the next message."""
        flight = session.in_flight
        if flight is None:
            raise InvariantError("no request in flight for this node (callers check)")
        try:
            request = stage.send(reply)  # type: ignore[arg-type]  # None starts the generator
        except StopIteration as stop:
            flight.stage = None
            return stop.value
        flight.stage = stage
        return request

    def _refreshing(
        self, node_id: int, session: ClientSession, work: Work[R]
    ) -> Generator[Envelope, Envelope, R]:
        """Carry ``work``'s refreshes to the client as ``query.refresh`` round trips."""
        flight = session.in_flight
        if flight is None:
            raise InvariantError("no request in flight for this node (callers check)")
        evaluator = session.evaluator

        def ask(items: list[Any]) -> Envelope:
            flight.refreshes += 1
            return Envelope(REFRESH, node_id, flight.round, evaluator.refresh_payload(items), {})

        try:
            items = next(work)
            while True:
                reply = yield ask(items)
                items = work.send(evaluator.refreshed(reply.arrays))
        except StopIteration as stop:
            return stop.value

    def _start_stage(
        self,
        node_id: int,
        session: ClientSession,
        inputs: EncryptedBatch,
        global_arrays: dict[str, np.ndarray],
    ) -> Stage:
        flight = session.in_flight
        if flight is None:
            raise InvariantError("no request in flight for this node (callers check)")
        evaluator = session.evaluator
        works = [evaluator.take(inputs, rows) for rows in flight.packed(flight.indices)]
        selected = yield from self._refreshing(node_id, session, lockstep(works))
        if self.text:  # the data owner uploaded embedded tokens
            flight.current = selected
            return (yield from self._block_stage(node_id, session, global_arrays))
        # Select from the patches, then embed: the selection's Benes network permutes
        # C * p * p ciphertexts per set instead of the embedding's D (48 instead of 96 for the
        # default tiny ViT), and under CKKS each of its layers is a refresh of all of them.
        works = [evaluator.embed(self._vit(), batch) for batch in selected]
        flight.current = yield from self._refreshing(node_id, session, lockstep(works))
        return (yield from self._block_stage(node_id, session, global_arrays))

    def _block_stage(
        self, node_id: int, session: ClientSession, global_arrays: dict[str, np.ndarray]
    ) -> Stage:
        flight = session.in_flight
        if flight is None:
            raise InvariantError("no request in flight for this node (callers check)")
        evaluator = session.evaluator
        block = flight.block + 1
        # the model's blocks up to the next revealed one, chained on ciphertexts
        first = self.revealed[block - 2] if block > 1 else 0
        evaluated = flight.current
        # a text model's key masks follow the rows: in order pi_{block-1} (block 1: as drawn)
        masks = self._key_masks_in_order(flight, block - 1)
        for index in range(first, self.revealed[block - 1]):
            if masks is None:
                works = [evaluator.evaluate_block(self._vit(), index, b) for b in evaluated]
            else:
                works = [
                    evaluator.evaluate_text_block(self._text_model(), index, b, m)
                    for b, m in zip(evaluated, masks, strict=True)
                ]
            evaluated = yield from self._refreshing(node_id, session, lockstep(works))
        orders = []
        for perms in flight.permutations:
            previous = (
                np.arange(len(perms.after_block(1))) if block == 1 else perms.after_block(block - 1)
            )
            orders.append(relative(previous, perms.after_block(block)))
        packed = flight.packed(orders, offsets=True)
        works = [evaluator.take(b, order) for b, order in zip(evaluated, packed, strict=True)]
        outputs = yield from self._refreshing(node_id, session, lockstep(works))
        flight.block, flight.current = block, outputs
        last = block == self.num_blocks
        views = [perms.client_view() for perms in flight.permutations] if last else []
        labels = []
        if last and (flight.kind == "evaluate" or flight.evaluation_batches):
            # every batch's labels in order pi_{L+1}; with a held-out set riding along, from the
            # joined upload (the training rows' labels are the client's, as its gradient shows)
            source = (
                session.eval_labels if flight.kind == "evaluate" else session.joined_uploads()[1]
            )
            rows = [
                batch[perms.after_block(block + 1)]
                for batch, perms in zip(flight.indices, flight.permutations, strict=True)
            ]
            works = [evaluator.take(source, r) for r in flight.packed(rows)]
            labels = yield from self._refreshing(node_id, session, lockstep(works))
        flight.refreshes = 0
        request = BlockRequest(
            message_type=TRAIN_BLOCK if flight.kind == "train" else EVALUATE_BLOCK,
            node_id=node_id,
            round=flight.round,
            block=block,
            num_blocks=self.num_blocks,
            batches=outputs,
            batch_sizes=[len(batch) for batch in flight.indices],
            set_sizes=[len(members) for members in flight.sets],
            global_arrays=global_arrays if block == 1 else {},
            wrap=[view["wrap"] for view in views],
            steps=[view["steps"] for view in views],
            labels=labels,
            evaluation_batches=flight.evaluation_batches,
            key_masks=(self._key_masks_in_order(flight, block + 1, per_batch=True) or [])
            if last
            else [],
        )
        return request.to_envelope()

    @staticmethod
    def _key_masks_in_order(
        flight: _InFlight, after: int, *, per_batch: bool = False
    ) -> list[np.ndarray] | None:
        """A text round's key masks in the rows' order after permutation ``pi_after`` (0: as
        drawn), per set (or ``per_batch``); ``None`` for images or before the last block when
        ``per_batch`` (only the last block carries them to the client)."""
        if flight.key_masks is None:
            return None
        rows = [
            batch if after == 0 else batch[perms.after_block(after)]
            for batch, perms in zip(flight.indices, flight.permutations, strict=True)
        ]
        if per_batch:
            return [flight.key_masks[r] for r in rows]
        return [flight.key_masks[r] for r in flight.packed(rows)]

    def on_reply(self, reply: Envelope) -> Envelope | ClientUpdate | EvaluationResult:
        """Consume a client's reply: the next request, or the client's result for the round."""
        session = self._session(reply.node_id)
        flight = session.in_flight
        if flight is None or reply.round != flight.round:
            raise ProtocolError(
                f"unexpected {reply.message_type} reply for round {reply.round} from node "
                f"{reply.node_id}"
            )
        if reply.message_type == REFRESH:
            if flight.stage is None:
                raise ProtocolError(f"unexpected refresh answer from node {reply.node_id}")
            return self._advance(session, flight.stage, reply)
        if flight.stage is not None:
            raise ProtocolError(f"expected a refresh answer, got {reply.message_type}")
        if reply.message_type == EVALUATE_CACHED and flight.kept_evaluation is not None:
            if reply.config.get("kept") is not True:
                # the client lost its copy (a new key or state): evaluate in full this round
                session.evaluation_kept = False
                request = self.start(
                    "evaluate", reply.node_id, flight.round, flight.kept_evaluation
                )
                if request is None:
                    raise InvariantError("an evaluation was kept from a set too small to run")
                return request
            return self._evaluation_result(reply, session)
        if reply.message_type == TRAIN_LOSS:
            return self._update(reply, session)
        expected = TRAIN_BLOCK if flight.kind == "train" else EVALUATE_BLOCK
        if flight.kept_evaluation is not None:
            expected = EVALUATE_CACHED
        if reply.message_type != expected:
            raise ProtocolError(f"expected a {expected} reply, got {reply.message_type}")
        count = len(flight.indices)
        if flight.block < self.num_blocks:
            fresh = unpack_batches(reply, "batch", len(flight.sets), session.evaluator.load)
            for old, new in zip(flight.current, fresh, strict=True):
                if old.shape != new.shape:
                    raise ProtocolError(
                        f"re-encrypted batch has shape {new.shape}, sent {old.shape}"
                    )
            flight.current = fresh
            return self._advance(session, self._block_stage(reply.node_id, session, {}))
        if flight.kind == "evaluate":
            return self._evaluation_result(reply, session)
        if flight.evaluation_batches:
            # the held-out batches rode along: the client kept their outputs, and the loss is on
            # the training batches only
            if reply.config.get("kept") is not True:
                raise ProtocolError(
                    f"node {reply.node_id} did not keep the held-out outputs of round "
                    f"{flight.round}"
                )
            session.evaluation_kept = True
            count -= flight.evaluation_batches
            flight.indices, flight.permutations = (
                flight.indices[:count],
                flight.permutations[:count],
            )
            flight.evaluation_batches = 0
        probs = unpack_batches(reply, "probs", count, session.evaluator.load)
        log_probs = unpack_batches(reply, "log_probs", count, session.evaluator.load)
        for p, log_p, batch in zip(probs, log_probs, flight.indices, strict=True):
            expected_shape = (len(batch), self.num_classes)
            if p.shape != expected_shape or log_p.shape != expected_shape:
                raise ProtocolError(f"predictions have shape {p.shape}, expected {expected_shape}")
        return self._advance(session, self._loss_stage(reply.node_id, session, probs, log_probs))

    def _evaluation_result(self, reply: Envelope, session: ClientSession) -> EvaluationResult:
        """The confusion matrix of a client's evaluation; whether it keeps the outputs."""
        confusion = reply.arrays.get("confusion")
        if confusion is None or confusion.shape != (self.num_classes,) * 2:
            raise ProtocolError("evaluation reply lacks a confusion matrix of the task's shape")
        if int(confusion.sum()) != session.num_eval:
            raise ProtocolError(
                f"evaluation reply counts {int(confusion.sum())} samples; node {reply.node_id} "
                f"holds {session.num_eval}"
            )
        session.in_flight = None
        session.evaluation_kept = reply.config.get("kept") is True
        return EvaluationResult(reply.node_id, confusion.astype(np.int64))

    def _loss_stage(
        self,
        node_id: int,
        session: ClientSession,
        probs: list[EncryptedBatch],
        log_probs: list[EncryptedBatch],
    ) -> Stage:
        flight = session.in_flight
        if flight is None:
            raise InvariantError("no request in flight for this node (callers check)")
        evaluator = session.evaluator
        works = [
            evaluator.take(session.train_labels, batch[perms.after_block(self.num_blocks + 1)])
            for batch, perms in zip(flight.indices, flight.permutations, strict=True)
        ]
        labels = yield from self._refreshing(node_id, session, lockstep(works))
        loss_works = [
            evaluator.cross_entropy(p, log_p, y)
            for p, log_p, y in zip(probs, log_probs, labels, strict=True)
        ]
        results = yield from self._refreshing(node_id, session, lockstep(loss_works))
        losses = [loss for loss, _ in results]
        gradients = [gradient for _, gradient in results]
        flight.block += 1  # the loss step
        flight.refreshes = 0
        arrays = {**pack_batches("loss", losses), **pack_batches("grad", gradients)}
        return Envelope(TRAIN_LOSS, node_id, flight.round, arrays, {"num_batches": len(losses)})

    def _update(self, reply: Envelope, session: ClientSession) -> ClientUpdate:
        flight = session.in_flight
        if flight is None or flight.block != self.num_blocks + 1:
            raise ProtocolError(f"train.loss reply from node {reply.node_id} before its loss step")
        session.in_flight = None
        arrays = unpack_arrays(reply, "params")
        if self.config.secure_aggregation and arrays:
            raise ProtocolError(
                f"update from node {reply.node_id} carries parameters although secure "
                "aggregation is on"
            )
        if not self.config.secure_aggregation and not arrays:
            raise ProtocolError(f"update from node {reply.node_id} carries no parameters")
        return ClientUpdate(
            reply.node_id,
            arrays,
            int(require_config(reply, "num_examples", int)),
            float(require_config(reply, "train_loss", float)),
        )

    def abandon(self, node_id: int) -> None:
        """Forget a client's in-flight round (it failed or timed out); its uploads stay."""
        if node_id in self.sessions:
            self.sessions[node_id].in_flight = None

    def _session(self, node_id: int) -> ClientSession:
        try:
            return self.sessions[node_id]
        except KeyError:
            raise ProtocolError(f"node {node_id} has not completed setup") from None
