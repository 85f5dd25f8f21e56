"""The double-blind protocol in one process, with observers on every client message.

:func:`~fedfm.protocols.double_blind.runner.run_in_process` wires the real server and client
roles through an in-process transport; this module does the same but lets callers watch each
client's traffic (the request it received, its reply and its state afterwards) and records the
permutations the server drew. Benchmarks use it to account message sizes; the extraction tests
use it to take a curious client's view (:mod:`fedfm.experiments.attacks`). Nothing here changes
what the roles do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fedfm.crypto import get_backend
from fedfm.crypto.backend import CryptoBackend
from fedfm.crypto.randomness import ResearchStream
from fedfm.crypto.simulate import SimulatedBatch
from fedfm.errors import ConfigError
from fedfm.experiments.baselines import RESEARCHER_POLICY
from fedfm.models.fhe_vit import FheViT
from fedfm.protocols.double_blind.client import ClientData, ClientState, DoubleBlindClient
from fedfm.protocols.double_blind.config import EVALUATE_BLOCK, TRAIN_BLOCK, DoubleBlindConfig
from fedfm.protocols.double_blind.driver import RoundRecord, run_double_blind
from fedfm.protocols.double_blind.permutation import RoundPermutations
from fedfm.protocols.double_blind.runner import server_model_on
from fedfm.protocols.double_blind.server import DoubleBlindServer
from fedfm.protocols.secure_aggregation import signed_federation
from fedfm.runtime.local import LocalNode
from fedfm.runtime.transport import Envelope, InProcessTransport

# (node id, request the client received, its reply, its state after answering)
Observer = Callable[[int, Envelope, Envelope, ClientState], None]
BLOCK_MESSAGES = (TRAIN_BLOCK, EVALUATE_BLOCK)


class ObservedClient(LocalNode[ClientState]):
    """A client role whose every answered message is shown to ``observers``."""

    def __init__(
        self, role: DoubleBlindClient, node_id: int, observers: Sequence[Observer]
    ) -> None:
        super().__init__(role, ClientState)
        self.node_id = node_id
        self.observers = list(observers)

    def __call__(self, envelope: Envelope) -> Envelope:
        reply = super().__call__(envelope)
        for observer in self.observers:
            observer(self.node_id, envelope, reply, self.state)
        return reply


@dataclass(frozen=True)
class DrawnBatches:
    """The batches (sample indices) and permutations the server drew for one client's round."""

    kind: str
    round: int
    node_id: int
    indices: list[np.ndarray]
    permutations: list[RoundPermutations]


class RecordingServer(DoubleBlindServer):
    """The real server role, also keeping every batch and permutation it drew (for tests)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.drawn: list[DrawnBatches] = []

    def start(
        self,
        kind: str,
        node_id: int,
        server_round: int,
        global_arrays: dict[str, np.ndarray],
        *,
        with_evaluation: bool = False,
    ) -> Envelope | None:
        """The server's ``start``, recording the draw; a held-out set riding along a training
        round is recorded as that round's evaluation draw (indices into the held-out set)."""
        request = super().start(
            kind, node_id, server_round, global_arrays, with_evaluation=with_evaluation
        )
        session = self.sessions[node_id]
        flight = session.in_flight
        if request is None or flight is None or flight.kept_evaluation is not None:
            return request  # nothing drawn (an evaluation on the client's kept outputs)
        training = len(flight.indices) - flight.evaluation_batches
        draws = [(kind, 0, slice(0, training))]
        if flight.evaluation_batches:
            draws.append(("evaluate", session.joined_uploads()[2], slice(training, None)))
        for drawn_kind, offset, part in draws:
            self.drawn.append(
                DrawnBatches(
                    drawn_kind,
                    server_round,
                    node_id,
                    [i - offset for i in flight.indices[part]],
                    list(flight.permutations[part]),
                )
            )
        return request


@dataclass
class ObservedRun:
    """History, transport and the recording server of an observed run."""

    history: list[RoundRecord]
    transport: InProcessTransport
    server: RecordingServer


def run_observed(
    model: FheViT,
    datasets: Sequence[ClientData],
    config: DoubleBlindConfig,
    *,
    observers: Sequence[Observer] = (),
    seed: int = 0,
    log: Callable[[str], None] = print,
    device: str | torch.device | None = "auto",
) -> ObservedRun:
    """Run the protocol over ``datasets`` (node ``i`` holds ``datasets[i]``) with observers.

    One researcher plays every party: the data owners accept the plaintext ``simulate`` backend
    and the server draws from ``ResearchStream(seed)`` (reproducible, not secret). Plaintext
    torch runs on ``device`` (the model is back where it was afterwards).
    """
    if not datasets:
        raise ConfigError("an observed run needs at least one client")
    classes = {data.num_classes for data in datasets}
    if len(classes) != 1:
        raise ConfigError(f"clients disagree on the number of classes: {sorted(classes)}")
    backend = get_backend(config.backend)
    with server_model_on(model, backend.name, device, log=log) as target:
        return _run_observed(
            model, datasets, config, backend, target, observers=observers, seed=seed, log=log
        )


def _run_observed(
    model: FheViT,
    datasets: Sequence[ClientData],
    config: DoubleBlindConfig,
    backend: CryptoBackend,
    device: torch.device,
    *,
    observers: Sequence[Observer],
    seed: int,
    log: Callable[[str], None],
) -> ObservedRun:
    classes = {data.num_classes for data in datasets}
    keys = signed_federation(range(len(datasets)))  # each data owner signs its SecAgg keys
    handlers = {
        node: ObservedClient(
            DoubleBlindClient(
                data,
                backend,
                policy=RESEARCHER_POLICY,
                partition_id=node,
                authentication=keys[node],
                device=device,
            ),
            node,
            observers,
        )
        for node, data in enumerate(datasets)
    }
    transport = InProcessTransport(handlers)  # type: ignore[arg-type]
    server = RecordingServer(
        model,
        config,
        backend,
        num_classes=classes.pop(),
        randomness=ResearchStream(seed),
        log=log,
    )
    history = run_double_blind(server, transport, transport.node_ids(), log=log)
    return ObservedRun(history, transport, server)


def ckks_bytes(values: np.ndarray) -> int:
    """Bytes of ``values`` as the ``simulate`` backend accounts them (CKKS, N=8192, one
    ciphertext per feature with the other axes in the slots)."""
    return SimulatedBatch(np.asarray(values, dtype=np.float32), b"").nbytes


def encrypted_arrays(envelope: Envelope, name: str) -> list[np.ndarray]:
    """The values of the encrypted batches ``<name>.<i>`` an envelope carries, in order."""
    found = {}
    for key, value in envelope.arrays.items():
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == name and parts[2] == "values":
            found[int(parts[1])] = value
    return [found[i] for i in sorted(found)]


@dataclass
class BlockTraffic:
    """Ciphertext-accounted bytes of block outputs, per message type and direction."""

    bytes_down: dict[str, int] = field(default_factory=dict)
    samples_down: dict[str, int] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    samples_up: dict[str, int] = field(default_factory=dict)
    bytes_all: int = 0  # every encrypted batch in every message, both directions

    def __call__(self, node: int, request: Envelope, reply: Envelope, state: ClientState) -> None:
        for envelope in (request, reply):
            for key in {k.split(".")[0] for k in envelope.arrays if k.endswith(".values")}:
                self.bytes_all += sum(ckks_bytes(v) for v in encrypted_arrays(envelope, key))
        if request.message_type not in BLOCK_MESSAGES:
            return
        kind = request.message_type
        for direction, envelope in (("down", request), ("up", reply)):
            batches = encrypted_arrays(envelope, "batch")
            if not batches:
                continue  # the last block's reply carries predictions, not a block
            sizes, samples = (
                getattr(self, f"bytes_{direction}"),
                getattr(self, f"samples_{direction}"),
            )
            sizes[kind] = sizes.get(kind, 0) + sum(ckks_bytes(b) for b in batches)
            samples[kind] = samples.get(kind, 0) + sum(len(b) for b in batches)

    def per_sample_block(self, direction: str, kind: str = TRAIN_BLOCK) -> float:
        """Bytes per sample per block: total block bytes / (samples x blocks) of ``kind``."""
        sizes = getattr(self, f"bytes_{direction}")
        samples = getattr(self, f"samples_{direction}")
        return sizes.get(kind, 0) / samples[kind] if samples.get(kind) else float("nan")
