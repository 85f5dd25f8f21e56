"""Running double-blind adaptation in one process, without Flower or Ray.

The same server and client roles as the Flower apps, wired through an
:class:`~fedfm.runtime.transport.InProcessTransport` to the runtime's one in-process driver
(:class:`~fedfm.runtime.local.LocalNode`: each client keeps only its state's records between
messages, as in Flower's ``context.state``). Client data come from the clients' pool
of the dataset splits, partitioned with flwr-datasets partitioners.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fedfm.crypto import get_backend
from fedfm.crypto.randomness import RandomSource
from fedfm.data import DataSplits, ImageDataset, partition
from fedfm.errors import ConfigError
from fedfm.models.fhe_vit import FheViT
from fedfm.protocols.double_blind.client import ClientData, ClientState, DoubleBlindClient
from fedfm.protocols.double_blind.config import DoubleBlindConfig
from fedfm.protocols.double_blind.defaults import FEDERATION
from fedfm.protocols.double_blind.driver import Aggregator, RoundRecord, run_double_blind
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.server import DoubleBlindServer
from fedfm.runtime.local import LocalNode
from fedfm.runtime.transport import Envelope, InProcessTransport


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
) -> tuple[list[RoundRecord], InProcessTransport]:
    """Run the protocol with every client in this process; return history and transport stats.

    ``policy`` is every data owner's privacy policy (the default refuses the plaintext
    ``simulate`` backend: pass ``DataOwnerPolicy(allow_plaintext=True)`` to opt in);
    ``randomness`` the server's secret stream (default: a fresh key from the OS; a stream from a
    secret file, or a :class:`~fedfm.crypto.randomness.ResearchStream` in experiments, makes a
    run reproducible).
    """
    backend = get_backend(config.backend)
    datasets = federation_data(splits, federation, config)
    handlers = {
        node_id: LocalNode(
            DoubleBlindClient(data, backend, policy=policy, partition_id=node_id), ClientState
        )
        for node_id, data in enumerate(datasets)
    }
    transport = InProcessTransport(handlers, drop=drop)
    server = DoubleBlindServer(
        model,
        config,
        backend,
        num_classes=splits.pool.num_classes,
        randomness=randomness,
        log=log,
    )
    history = run_double_blind(
        server,
        transport,
        transport.node_ids(),
        aggregator=aggregator,
        checkpoint_dir=checkpoint_dir,
        identity={"config": config.to_config(), "federation": asdict(federation)},
        log=log,
    )
    return history, transport
