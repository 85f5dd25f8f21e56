"""The relay of any fedfm runtime protocol as a Flower ``ServerApp``.

:func:`make_server_app` builds a ServerApp that waits for the run's nodes, runs
:func:`~fedfm.runtime.run_protocol` over a :class:`FlowerTransport` (the ServerApp orchestrates
and relays sealed frames it cannot open) and, if the run config names a ``results-file``, writes
the run's result there as JSON. Run config keys: :data:`fedfm.runtime.settings.RUN_CONFIG_DEFAULTS`
plus the protocol's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from flwr.serverapp import Grid, ServerApp

from fedfm.flower.apps import log_info
from fedfm.flower.apps import make_server_app as make_app
from fedfm.flower.transport import FlowerTransport, wait_for_nodes
from fedfm.runtime import (
    ProtocolFactory,
    RunResult,
    run_protocol,
    server_settings,
    split_run_config,
)
from fedfm.runtime.transport import ConfigValue


def run_on_grid(
    grid: Grid,
    build_protocol: ProtocolFactory,
    run_config: Mapping[str, ConfigValue],
    *,
    log: Callable[[str], None] = log_info,
) -> RunResult:
    """Run the protocol the run config describes with the nodes of ``grid``."""
    _, protocol_config = split_run_config(run_config)
    protocol = build_protocol(protocol_config)
    settings = server_settings(run_config, protocol)
    nodes = wait_for_nodes(
        grid,
        settings.num_nodes,
        minimum=settings.num_nodes,
        deadline_seconds=settings.connect_timeout,
        log=log,
    )
    result = run_protocol(
        protocol,
        FlowerTransport(grid, keep_warm=settings.keep_warm),
        nodes,
        timeout=settings.timeout,
        log=log,
    )
    if settings.results_file is not None:
        result.save(settings.results_file)
        log(f"[fedfm] {protocol.name}: wrote {settings.results_file}")
    return result


def make_server_app(build_protocol: ProtocolFactory) -> ServerApp:
    """A ServerApp relaying the protocol ``build_protocol`` makes from the run config."""
    return make_app(lambda grid, run_config: run_on_grid(grid, build_protocol, run_config))
