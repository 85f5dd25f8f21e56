"""Running double-blind adaptation in one process, without Flower or Ray.

The same server and client roles as the Flower apps, wired through an
:class:`~fedfm.runtime.transport.InProcessTransport` to the runtime's one in-process driver
(:class:`~fedfm.runtime.local.LocalNode`: each client keeps only its state's records between
messages, as in Flower's ``context.state``). Client data come from the clients' pool
of the dataset splits, partitioned with flwr-datasets partitioners. Each client signs its SecAgg
keys with a fresh identity and pins the other clients' identities, unless the caller passes the
data owners' own choices (``secagg_authentication``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedfm.crypto import get_backend
from fedfm.crypto.randomness import RandomSource
from fedfm.data import DataSplits, ImageDataset, partition
from fedfm.errors import ConfigError
from fedfm.models.device import cpu_only_note, resolve_device
from fedfm.protocols.double_blind.client import ClientData, ClientState, DoubleBlindClient
from fedfm.protocols.double_blind.config import DoubleBlindConfig
from fedfm.protocols.double_blind.defaults import FEDERATION
from fedfm.protocols.double_blind.driver import (
    PROGRESS_SECONDS,
    Aggregator,
    RoundRecord,
    run_double_blind,
)
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.server import DoubleBlindServer
from fedfm.protocols.double_blind.text import TextClientData
from fedfm.protocols.secure_aggregation import signed_federation
from fedfm.runtime.local import LocalNode
from fedfm.runtime.transport import ClientHandler, Envelope, InProcessTransport
from fedfm.secagg import KeyAuthentication

if TYPE_CHECKING:  # annotations only: timm stays out of a data owner's ClientApp process
    from fedfm.data.text_task import TokenizedTexts
    from fedfm.models.fhe_text import FheTextClassifier
    from fedfm.models.fhe_vit import FheViT


@dataclass(frozen=True)
class Federation:
    """How the clients' pool is split: K clients, partitioning scheme, Dirichlet alpha."""

    num_clients: int = FEDERATION.num_clients
    scheme: str = FEDERATION.scheme
    alpha: float = FEDERATION.alpha
    seed: int = FEDERATION.seed

    def __post_init__(self) -> None:
        if self.num_clients < 1:
            raise ConfigError(f"num_clients must be >= 1, got {self.num_clients}")


def client_data(
    pool: ImageDataset, indices: np.ndarray, *, eval_fraction: float, seed: int
) -> ClientData:
    """One client's share of the pool, split (seeded) into its training and held-out data."""
    order = np.random.default_rng(seed).permutation(np.asarray(indices))
    held_out = round(len(order) * eval_fraction)
    train, evaluation = order[held_out:], order[:held_out]
    images, labels = pool.images.numpy(), pool.labels.numpy()
    return ClientData(
        train_images=images[train],
        train_labels=labels[train],
        eval_images=images[evaluation],
        eval_labels=labels[evaluation],
        num_classes=pool.num_classes,
    )


def federation_data(
    splits: DataSplits, federation: Federation, config: DoubleBlindConfig
) -> list[ClientData]:
    """Every client's data, in partition order."""
    parts = partition(
        splits.pool,
        num_partitions=federation.num_clients,
        scheme=federation.scheme,
        alpha=federation.alpha,
        seed=federation.seed,
    )
    return [
        client_data(splits.pool, part, eval_fraction=config.eval_fraction, seed=federation.seed + i)
        for i, part in enumerate(parts)
    ]


def text_client_data(
    pool: TokenizedTexts,
    indices: np.ndarray,
    *,
    pad_token_id: int,
    eval_fraction: float,
    seed: int,
) -> TextClientData:
    """One client's share of a text pool (key masks: tokens other than ``pad_token_id``),
    split (seeded) into its training and held-out texts as :func:`client_data` splits images."""
    order = np.random.default_rng(seed).permutation(np.asarray(indices))
    held_out = round(len(order) * eval_fraction)
    train, evaluation = order[held_out:], order[:held_out]
    ids, labels = pool.input_ids.numpy(), pool.labels.numpy()
    return TextClientData(
        train_tokens=ids[train],
        train_key_mask=ids[train] != pad_token_id,
        train_labels=labels[train],
        eval_tokens=ids[evaluation],
        eval_key_mask=ids[evaluation] != pad_token_id,
        eval_labels=labels[evaluation],
        num_classes=pool.num_classes,
    )


def text_federation_data(
    pool: TokenizedTexts,
    federation: Federation,
    config: DoubleBlindConfig,
    *,
    pad_token_id: int,
) -> list[TextClientData]:
    """Every client's texts, in partition order (flwr-datasets partitioners, as for images)."""
    parts = partition(
        pool,
        num_partitions=federation.num_clients,
        scheme=federation.scheme,
        alpha=federation.alpha,
        seed=federation.seed,
    )
    return [
        text_client_data(
            pool,
            part,
            pad_token_id=pad_token_id,
            eval_fraction=config.eval_fraction,
            seed=federation.seed + i,
        )
        for i, part in enumerate(parts)
    ]


def place_server_model(
    model: FheViT | FheTextClassifier,
    backend: str,
    device: str | torch.device | None,
    *,
    log: Callable[[str], None] = print,
) -> torch.device:
    """Move the server's ``model`` (in place) to where ``backend`` evaluates it and return the
    resolved ``device`` (what the clients' adapters use): ``simulate`` evaluates on ``device``,
    CKKS on the CPU, which is logged when a GPU was asked for."""
    target = resolve_device(device)
    if backend == "simulate":
        model.to(target)
    else:
        model.cpu()
        if (note := cpu_only_note(target, f"the {backend} evaluation")) is not None:
            log(note)
    return target


@contextmanager
def server_model_on(
    model: FheViT | FheTextClassifier,
    backend: str,
    device: str | torch.device | None,
    *,
    log: Callable[[str], None] = print,
) -> Iterator[torch.device]:
    """:func:`place_server_model` for one run: the model goes back to the device it was on."""
    before = next(model.parameters()).device
    try:
        yield place_server_model(model, backend, device, log=log)
    finally:
        model.to(before)


def run_in_process(
    model: FheViT,
    splits: DataSplits,
    config: DoubleBlindConfig,
    federation: Federation,
    *,
    aggregator: Aggregator | None = None,
    checkpoint_dir: Path | None = None,
    drop: Callable[[Envelope], bool] | None = None,
    policy: DataOwnerPolicy | None = None,
    randomness: RandomSource | None = None,
    log: Callable[[str], None] = print,
    secagg_authentication: Sequence[KeyAuthentication] | None = None,
    device: str | torch.device | None = "auto",
    progress_every: float = PROGRESS_SECONDS,
) -> tuple[list[RoundRecord], InProcessTransport]:
    """Run the protocol with every client in this process; return history and transport stats.

    ``policy`` is every data owner's privacy policy (the default refuses the plaintext
    ``simulate`` backend: pass ``DataOwnerPolicy(allow_plaintext=True)`` to opt in);
    ``randomness`` the server's secret stream (default: a fresh key from the OS; a stream from a
    secret file, or a :class:`~fedfm.crypto.randomness.ResearchStream` in experiments, makes a
    run reproducible).
    ``secagg_authentication`` is each client's (in partition order) choice of SecAgg key
    authentication, a data owner's setting; by default every client signs with a fresh
    identity and pins the others' (:func:`~fedfm.protocols.secure_aggregation.signed_federation`).
    ``device`` (:func:`~fedfm.models.device.resolve_device`) is where the plaintext torch runs:
    the clients' adapters and heads and, with the ``simulate`` backend, the server's model
    (for the run; it is back where it was afterwards); CKKS evaluates on the CPU.
    ``progress_every``: seconds between progress lines within a phase (``run_double_blind``).
    """
    return run_clients_in_process(
        model,
        federation_data(splits, federation, config),
        config,
        num_classes=splits.pool.num_classes,
        identity={"config": config.to_config(), "federation": asdict(federation)},
        aggregator=aggregator,
        checkpoint_dir=checkpoint_dir,
        drop=drop,
        policy=policy,
        randomness=randomness,
        log=log,
        secagg_authentication=secagg_authentication,
        device=device,
        progress_every=progress_every,
    )


def run_clients_in_process(
    model: FheViT | FheTextClassifier,
    datasets: Sequence[ClientData | TextClientData],
    config: DoubleBlindConfig,
    *,
    num_classes: int,
    identity: dict[str, Any],
    aggregator: Aggregator | None = None,
    checkpoint_dir: Path | None = None,
    drop: Callable[[Envelope], bool] | None = None,
    policy: DataOwnerPolicy | None = None,
    randomness: RandomSource | None = None,
    log: Callable[[str], None] = print,
    secagg_authentication: Sequence[KeyAuthentication] | None = None,
    device: str | torch.device | None = "auto",
    progress_every: float = PROGRESS_SECONDS,
) -> tuple[list[RoundRecord], InProcessTransport]:
    """:func:`run_in_process` on given data owners' data (in partition order): images for a
    ViT, :class:`~fedfm.protocols.double_blind.text.TextClientData` for a text encoder.
    ``identity`` names the run in its checkpoints (a resumed run must match it)."""
    backend = get_backend(config.backend)
    with server_model_on(model, backend.name, device, log=log) as target:
        if secagg_authentication is None:
            chosen = list(signed_federation(range(len(datasets))).values())
        elif len(secagg_authentication) != len(datasets):
            raise ConfigError(
                f"secagg_authentication has {len(secagg_authentication)} entries for "
                f"{len(datasets)} clients"
            )
        else:
            chosen = list(secagg_authentication)
        handlers: dict[int, ClientHandler] = {
            node_id: LocalNode(
                DoubleBlindClient(
                    data,
                    backend,
                    policy=policy,
                    partition_id=node_id,
                    authentication=chosen[node_id],
                    device=target,
                ),
                ClientState,
            )
            for node_id, data in enumerate(datasets)
        }
        transport = InProcessTransport(handlers, drop=drop)
        server = DoubleBlindServer(
            model,
            config,
            backend,
            num_classes=num_classes,
            randomness=randomness,
            log=log,
        )
        history = run_double_blind(
            server,
            transport,
            transport.node_ids(),
            aggregator=aggregator,
            checkpoint_dir=checkpoint_dir,
            identity=identity,
            log=log,
            progress_every=progress_every,
        )
        return history, transport
