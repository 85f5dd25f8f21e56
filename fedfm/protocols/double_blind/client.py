"""The data owner's role: keys, uploads, decrypt/re-encrypt, side adapter and head training.

The client's state is a plain :class:`ClientState` (arrays and config values) that the Flower
adapter keeps in ``context.state`` between messages; :meth:`DoubleBlindClient.handle` takes a
state and a message and returns the reply and the new state, never mutating the old one, so a
refused message loses nothing. The secret key lives only in that state.

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

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fedfm.crypto.backend import CryptoBackend, KeyOwner
from fedfm.errors import ConfigError, DataError, ProtocolError
from fedfm.protocols.double_blind.adapter import SideAdapterHead
from fedfm.protocols.double_blind.config import (
    EVALUATE_BLOCK,
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
    unpack_arrays,
    unpack_batches,
)
from fedfm.runtime.transport import Envelope
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


_SCALARS = ("stage", "round", "block")  # ClientState's fields kept as config values
_CONFIG_PREFIX = "config."


@dataclass(frozen=True)
class ClientState:
    """Everything a client carries between messages (all of it stays on the client)."""

    stage: str = "new"
    round: int = 0
    block: int = 0
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
                stage=str(config["stage"]),
                round=int(config["round"]),
                block=int(config["block"]),
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


# Which message each stage accepts. A round may always restart at block 1 (the server dropped
# the previous one, e.g. after a timeout, or left the client out of the aggregate); everything
# else must follow in order.
ALLOWED = {
    "new": {SETUP},
    "ready": {SETUP, TRAIN_BLOCK, EVALUATE_BLOCK, REFRESH},
    "train": {SETUP, TRAIN_BLOCK, EVALUATE_BLOCK, TRAIN_LOSS, REFRESH},
    "trained": {SETUP, TRAIN_BLOCK, EVALUATE_BLOCK, TRAIN_SECAGG, REFRESH},
    "secagg": {SETUP, TRAIN_BLOCK, EVALUATE_BLOCK, TRAIN_SECAGG, REFRESH},
    "evaluate": {SETUP, TRAIN_BLOCK, EVALUATE_BLOCK, REFRESH},
}
# The update a client keeps for secure aggregation: ``update.*`` arrays and this config entry.
UPDATE_WEIGHT = "update.num_examples"


def run_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A state's config without the round's entries (the update's weight, the SecAgg state)."""
    return {k: v for k, v in config.items() if k != UPDATE_WEIGHT and not k.startswith(SECAGG)}


def one_hot(labels: np.ndarray, num_classes: int) -> np.ndarray:
    return np.eye(num_classes, dtype=np.float32)[labels]


class DoubleBlindClient:
    """Handles the protocol's messages for one data owner.

    ``authentication``: how this data owner authenticates the other clients' SecAgg keys (its
    identity and pins, or the explicit semi-honest mode); ``None`` refuses secure aggregation.
    """

    def __init__(
        self,
        data: ClientData,
        backend: CryptoBackend,
        *,
        partition_id: int = -1,
        authentication: KeyAuthentication | None = None,
    ) -> None:
        self.data = data
        self.backend = backend
        self.partition_id = partition_id  # an ordering key for the server, not a secret
        self.authentication = authentication

    # -- entry point -----------------------------------------------------------------------
    def handle(self, envelope: Envelope, state: ClientState) -> tuple[Envelope, ClientState]:
        """Answer ``envelope`` from ``state``; raises :class:`ProtocolError` if it does not fit."""
        if envelope.message_type not in ALLOWED.get(state.stage, set()):
            raise ProtocolError(
                f"client in stage {state.stage!r} cannot accept {envelope.message_type!r}"
            )
        if envelope.message_type == SETUP:
            return self._setup(envelope)
        if envelope.message_type == TRAIN_SECAGG:
            return self._secure_aggregation(envelope, state)
        key = self.backend.restore_key_owner(state.group("key"))
        if envelope.message_type == REFRESH:
            # Masked ciphertexts only: the client re-encrypts them and learns nothing; its state
            # does not change.
            fresh = key.refresh(envelope.arrays)
            return Envelope(REFRESH, envelope.node_id, envelope.round, fresh, {}), state
        if envelope.message_type == TRAIN_LOSS:
            return self._loss(envelope, state, key)
        return self._block(envelope, state, key)

    # -- steps -------------------------------------------------------------------------------
    def _setup(self, envelope: Envelope) -> tuple[Envelope, ClientState]:
        config = DoubleBlindConfig.from_config(envelope.config)
        key = self.backend.create_key_owner(geometry=geometry_from(envelope.config))
        data, classes = self.data, self.data.num_classes
        uploads = {
            "train_images": [key.encrypt(data.train_images)],
            "train_labels": [key.encrypt(one_hot(data.train_labels, classes))],
            "eval_images": [key.encrypt(data.eval_images)],
            "eval_labels": [key.encrypt(one_hot(data.eval_labels, classes))],
        }
        reply = batch_reply(
            envelope,
            uploads,
            public_context=key.public_context(),
            num_classes=classes,
            num_train=len(data.train_labels),
            num_eval=len(data.eval_labels),
            backend=self.backend.name,
            partition_id=self.partition_id,
        )
        state = ClientState(
            stage="ready",
            config=config.to_config(),
            arrays=pack_arrays("key", key.secret_state()),
        )
        return reply, state

    def _block(
        self, envelope: Envelope, state: ClientState, key: KeyOwner
    ) -> tuple[Envelope, ClientState]:
        request = BlockRequest.from_envelope(envelope, key.load)
        kind = "train" if envelope.message_type == TRAIN_BLOCK else "evaluate"
        if request.block == 1:
            if not request.global_arrays:
                raise ProtocolError(f"{envelope.message_type} block 1 lacks the global adapter")
            arrays = {k: v for k, v in state.arrays.items() if k.startswith(("key.", "momentum."))}
            arrays.update(pack_arrays("params", request.global_arrays))
            state = replace(
                state, round=envelope.round, config=run_settings(state.config), arrays=arrays
            )
        elif (state.stage, state.round, state.block) != (kind, envelope.round, request.block - 1):
            raise ProtocolError(
                f"{envelope.message_type} block {request.block} of round {envelope.round} does not "
                f"follow block {state.block} of round {state.round} ({state.stage})"
            )
        plain = {str(i): key.decrypt(batch) for i, batch in enumerate(request.batches)}
        arrays = state.with_group(f"block{request.block}", plain)
        state = replace(state, stage=kind, block=request.block, arrays=arrays)
        if request.block < request.num_blocks:
            fresh = [key.encrypt(plain[str(i)]) for i in range(len(request.batches))]
            return batch_reply(envelope, {"batch": fresh}), state

        relatives = {f"wrap.{i}": w for i, w in enumerate(request.wrap)}
        relatives |= {f"steps.{i}": s for i, s in enumerate(request.steps)}
        state = replace(state, arrays=state.with_group("perm", relatives))
        logits = self._forward(state, len(request.batches))
        if kind == "evaluate":
            labels = [key.decrypt(batch).argmax(axis=1) for batch in request.labels]
            confusion = np.zeros((self.data.num_classes,) * 2, dtype=np.int64)
            for batch_logits, truth in zip(logits, labels, strict=True):
                np.add.at(confusion, (truth, batch_logits.argmax(dim=1).numpy()), 1)
            reply = Envelope(
                envelope.message_type,
                envelope.node_id,
                envelope.round,
                {"confusion": confusion},
                {"num_examples": int(confusion.sum())},
            )
            return reply, replace(state, stage="ready")
        with torch.no_grad():
            probs = [key.encrypt(batch.softmax(dim=1).numpy()) for batch in logits]
            log_probs = [key.encrypt(batch.log_softmax(dim=1).numpy()) for batch in logits]
        return batch_reply(envelope, {"probs": probs, "log_probs": log_probs}), state

    def _loss(
        self, envelope: Envelope, state: ClientState, key: KeyOwner
    ) -> tuple[Envelope, ClientState]:
        if state.stage != "train" or state.round != envelope.round:
            raise ProtocolError(
                f"train.loss for round {envelope.round} but the client is in round {state.round} "
                f"({state.stage}, block {state.block})"
            )
        count = len(state.group("block1"))
        losses = unpack_batches(envelope, "loss", count, key.load)
        gradients = unpack_batches(envelope, "grad", count, key.load)
        model = self._adapter(state)
        logits = self._forward(state, count, model=model)
        objective = sum(
            (out * torch.from_numpy(key.decrypt(grad))).sum()
            for out, grad in zip(logits, gradients, strict=True)
        )
        (objective / count).backward()
        config = DoubleBlindConfig.from_config(state.config)
        momentum = state.group("momentum")
        new_momentum = {}
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                velocity = (
                    config.momentum
                    * torch.from_numpy(
                        momentum.get(name, np.zeros(parameter.shape, dtype=np.float32))
                    )
                    + parameter.grad
                )
                parameter -= config.lr * config.lr_factor(state.round) * velocity
                new_momentum[name] = velocity.numpy().copy()
        params = model.get_arrays()
        train_loss = float(np.mean([key.decrypt(loss)[0] for loss in losses]))
        num_examples = count * int(state.group("block1")["0"].shape[0])
        metrics = {"num_examples": num_examples, "train_loss": train_loss}
        arrays = {k: v for k, v in state.arrays.items() if k.startswith("key.")}
        arrays.update(pack_arrays("momentum", new_momentum))
        if not config.secure_aggregation:
            reply = Envelope(
                envelope.message_type,
                envelope.node_id,
                envelope.round,
                pack_arrays("params", params),
                metrics,
            )
            return reply, ClientState("ready", state.round, 0, state.config, arrays)
        received = state.group("params")
        arrays.update(pack_arrays("update", {k: v - received[k] for k, v in params.items()}))
        reply = Envelope(envelope.message_type, envelope.node_id, envelope.round, {}, metrics)
        settings = {**state.config, UPDATE_WEIGHT: num_examples}
        return reply, ClientState("trained", state.round, 0, settings, arrays)

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
            return answer, ClientState("ready", state.round, 0, run_settings(state.config), kept)
        new_arrays, new_config = secagg_state.to_records()
        config = {**run_settings(state.config), UPDATE_WEIGHT: update.num_examples, **new_config}
        return answer, ClientState("secagg", state.round, 0, config, {**kept, **new_arrays})

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
        )
        model.set_arrays(params)
        return model

    def _forward(
        self, state: ClientState, count: int, *, model: SideAdapterHead | None = None
    ) -> list[torch.Tensor]:
        model = model or self._adapter(state)
        perms = state.group("perm")
        outputs = []
        for i in range(count):
            blocks = [
                torch.from_numpy(state.group(f"block{b}")[str(i)])
                for b in range(1, model.num_blocks + 1)
            ]
            wrap = torch.from_numpy(perms[f"wrap.{i}"])
            steps = torch.from_numpy(perms[f"steps.{i}"])
            outputs.append(model(blocks, wrap, steps))
        return outputs


def unpack_params(envelope: Envelope) -> dict[str, np.ndarray]:
    """The adapter and head arrays a client's ``train.loss`` reply carries."""
    params = unpack_arrays(envelope, "params")
    if not params:
        raise ProtocolError("update reply carries no parameters")
    return params
