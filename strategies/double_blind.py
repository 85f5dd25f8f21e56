"""The learning service provider's role of double-blind adaptation as a Flower ``ServerApp``.

:func:`main` reads the run config (keys and defaults in
:data:`fedfm.protocols.double_blind.settings.DEFAULTS`), loads the distilled FHE-friendly student
(refusing, with the `fedfm distill` command that makes it, if the work directory has none), waits
for the clients' nodes and runs :func:`~fedfm.protocols.double_blind.run_double_blind` over a
:class:`FlowerTransport`, with aggregation through a Flower strategy (FedAvg by default). With
secure aggregation (run config ``secure-aggregation``, on by default) the strategy sees one train
reply, the securely averaged adapter and head, instead of one per client.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from flwr.serverapp import Grid

from fedfm.crypto import get_backend
from fedfm.crypto.randomness import SecretStream
from fedfm.flower.apps import log_info, make_server_app
from fedfm.flower.transport import FlowerTransport, wait_for_nodes
from fedfm.protocols.double_blind.driver import RoundRecord, run_double_blind
from fedfm.protocols.double_blind.runner import place_server_model
from fedfm.protocols.double_blind.server import DoubleBlindServer
from fedfm.protocols.double_blind.settings import app_settings
from fedfm_strategies.aggregation import StrategyAggregator, make_strategy

# The server's secret for reproducible research runs: a file only the server reads, named in the
# ServerApp's own environment (never in the run config, which every client receives).
SERVER_SECRET_ENV = "FEDFM_SERVER_SECRET_FILE"


def server_randomness(log: Callable[[str], None]) -> SecretStream:
    """The server's secret stream: keyed by ``$FEDFM_SERVER_SECRET_FILE`` if set, otherwise by
    a fresh key from the operating system."""
    path = os.environ.get(SERVER_SECRET_ENV)
    if not path:
        log("[fedfm] server randomness: a fresh key from the OS CSPRNG")
        return SecretStream()
    log(f"[fedfm] server randomness: keyed by the secret file ${SERVER_SECRET_ENV}")
    return SecretStream.from_file(Path(path))


def run_adaptation(
    grid: Grid, run_config: Mapping[str, object], *, log: Callable[[str], None] = log_info
) -> list[RoundRecord]:
    """Run double-blind adaptation with the nodes of ``grid``; return the per-round history."""
    settings = app_settings(run_config)
    strategy = make_strategy(settings.strategy)
    splits, _ = settings.student.load_data()
    # refuses, naming the command that makes it (`fedfm distill ...`), if absent
    model = settings.student.load_student()
    log(f"[fedfm] server model: FHE-friendly student {settings.student.student_path}")
    backend = get_backend(settings.protocol.backend)
    place_server_model(model, backend.name, settings.device, log=log)
    server = DoubleBlindServer(
        model,
        settings.protocol,
        backend,
        num_classes=splits.pool.num_classes,
        randomness=server_randomness(log),
        log=log,
    )
    nodes = wait_for_nodes(
        grid,
        settings.federation.num_clients,
        minimum=settings.min_clients,
        deadline_seconds=settings.connect_timeout,
        log=log,
    )
    secure = settings.protocol.secure_aggregation
    log(
        f"[fedfm] aggregation: {type(strategy).__name__} ({settings.strategy}) over "
        f"{'the secure aggregate' if secure else 'per-client updates'}"
    )
    return run_double_blind(
        server,
        FlowerTransport(grid, keep_warm=settings.keep_warm),
        nodes,
        aggregator=StrategyAggregator(strategy),
        checkpoint_dir=settings.checkpoint_dir,
        identity={
            "config": settings.protocol.to_config(),
            "federation": asdict(settings.federation),
            "strategy": settings.strategy,
        },
        timeout=settings.timeout,
        secagg_timeout=settings.secagg_timeout,
        min_clients=settings.min_clients,
        log=log,
        pipelined=settings.pipelined,
    )


app = make_server_app(run_adaptation)
