"""``fedfm bench-round``: one double-blind round in one process and on Flower's Deployment Engine.

The same run config (the distilled student in ``--workdir``, ``--clients`` clients holding an iid
partition, one batch of ``--batch-size`` each, one round, evaluation included) runs

(a) in this process (:func:`~fedfm.protocols.double_blind.runner.run_in_process`), with the
    requested backend and with ``simulate`` for the reference loss and accuracy, and
(b) on a local Deployment Engine as the deployment tests start it
    (``simulations/deploy/local_federation.py``: a TLS SuperLink and authenticated SuperNodes on
    127.0.0.1), each SuperNode started with ``--isolation process`` beside a warm ClientApp
    executor (``fedfm executor``) and the data owner's long-lived site process (``fedfm site``),
    the server pipelined (run config ``pipelined``) and keeping each SuperNode awake with a hold
    after each request (``keep-warm``); with ``--compare-clientapp`` also without the holds, and
    with Flower's per-message ClientApp process (``flwr-clientapp`` forwarding to the site
    process, and without site processes), in lockstep.

Both use the server's draws keyed by the same secret file, so they see the same batches and
permutations. The Deployment Engine needs the repository's ``simulations/deploy`` (run from a
checkout); ``--skip-deployment`` runs (a) alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import fedfm
from fedfm.errors import ConfigError
from fedfm.experiments.results import write_results

DEPLOY = Path(fedfm.__file__).resolve().parents[1] / "simulations" / "deploy"
SERVER_SECRET_ENV = "FEDFM_SERVER_SECRET_FILE"  # fedfm_strategies.double_blind reads it
WARM = "deployment, site processes, warm executors"
DEPLOYED = f"{WARM}, keep-warm"  # the mode the summary reports
_ANSWERED = re.compile(r"\[site\] run (\d+): answered (\S+) \(round (\d+)\) in ([0-9.]+) s")


def _deploy_module(name: str) -> ModuleType:
    path = DEPLOY / f"{name}.py"
    if not path.exists():
        raise ConfigError(
            f"bench-round's Deployment Engine part needs {path} (a repository checkout); "
            "run it from the repository or pass --skip-deployment"
        )
    if str(DEPLOY) not in sys.path:
        sys.path.insert(0, str(DEPLOY))  # local_federation imports its sibling `certificates`
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path} cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_config(
    workdir: Path,
    checkpoint: Path,
    *,
    backend: str,
    clients: int,
    batch_size: int,
    timeout: float,
    max_samples: int | None,
    rounds: int = 1,
) -> dict[str, Any]:
    """The run config of the benchmarked rounds (both parts)."""
    config: dict[str, Any] = {
        "num-clients": clients,
        "rounds": rounds,
        "batches-per-round": 1,
        "batch-size": batch_size,
        "backend": backend,
        "partition": "iid",
        "workdir": str(workdir.resolve()),
        "timeout": timeout,
        "secagg-timeout": timeout,
        "connect-timeout": 120.0,
        "checkpoint-dir": str(checkpoint),
    }
    if max_samples is not None:
        config["max-samples"] = max_samples
    return config


def in_process_round(
    config: Mapping[str, Any], secret: Path, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The run's rounds in this process; each round's record and the run's wall time."""
    from fedfm.crypto.randomness import SecretStream
    from fedfm.data import DataSplits
    from fedfm.distillation.pipeline import load_student
    from fedfm.protocols.double_blind.policy import DataOwnerPolicy
    from fedfm.protocols.double_blind.runner import run_in_process
    from fedfm.protocols.double_blind.settings import app_settings

    settings = app_settings(config)
    splits, _ = settings.student.load_data()
    if not isinstance(splits, DataSplits):
        raise ConfigError(
            "bench-round times the image path (the distilled ViT on images); this run config "
            "names a text task"
        )
    student = load_student(Path(str(config["workdir"])) / "student.pt")
    started = time.perf_counter()
    history, _ = run_in_process(
        student,
        splits,
        settings.protocol,
        settings.federation,
        policy=DataOwnerPolicy(allow_plaintext=True),
        randomness=SecretStream.from_file(secret),
        log=log,
        device="cpu",
    )
    wall = time.perf_counter() - started
    return [{"wall_seconds": wall, **asdict(record)} for record in history]


def _site_seconds(log_text: str, server_round: int | None = None) -> tuple[float, int]:
    """Seconds a site spent answering and how many messages (of one round), from its log."""
    found = [
        float(match.group(4))
        for match in _ANSWERED.finditer(log_text)
        if server_round is None or int(match.group(3)) == server_round
    ]
    return sum(found), len(found)


def deployment_round(
    config: Mapping[str, Any],
    secret: Path,
    workspace: Path,
    *,
    sites: bool,
    executors: bool = False,
    clients: int,
    node_policy: Mapping[str, Any],
    seconds: float,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """The run's rounds on a local Deployment Engine; each round's record and the sites' share,
    and the run's wall time."""
    certificates = _deploy_module("certificates")
    local_federation = _deploy_module("local_federation")
    os.environ[SERVER_SECRET_ENV] = str(secret)  # the SuperLink's environment: the same draws
    credentials = certificates.make_credentials(workspace / "credentials", nodes=clients)
    federation = local_federation.LocalFederation(workspace / "federation", credentials)
    try:
        log(
            f"[bench-round] starting a SuperLink and {clients} SuperNodes "
            f"(sites={sites}, executors={executors})"
        )
        federation.start_superlink()
        federation.register_all(clients)
        federation.start_supernodes(
            clients, node_config=dict(node_policy), sites=sites, executors=executors
        )
        federation.wait_for_nodes(clients)
        started = time.perf_counter()
        run_id = federation.submit(config)
        # each poll starts a `flwr ls` process (seconds of CPU on 2 cores): rarely, the round's
        # own time comes from the server's record, not from this wait
        status = federation.wait_for_run(run_id, seconds=seconds, poll=15.0)
        wall = time.perf_counter() - started
        if status != "finished:completed":
            raise ConfigError(
                f"the deployment run ended {status}:\n{federation.run_log(run_id)[-3000:]}"
            )
        state = json.loads((Path(str(config["checkpoint-dir"])) / "state.json").read_text())
        site_logs = [site.log() for site in federation.sites.values()]
    finally:
        federation.close()
    records = []
    for record in state["history"]:
        answered = [_site_seconds(text, int(record["round"])) for text in site_logs]
        records.append(
            {
                "wall_seconds": wall,
                **record,
                "site_seconds": [round(total, 3) for total, _ in answered],
                "site_messages": [count for _, count in answered],
            }
        )
    return records


def _row(mode: str, backend: str, record: Mapping[str, Any]) -> dict[str, Any]:
    trips = int(record["round_trips"])
    sites = record.get("site_seconds") or []
    transport = float(record.get("transport_seconds", float("nan")))
    slowest_site = max(sites) if sites else float("nan")
    return {
        "mode": mode,
        "backend": backend,
        "round": int(record.get("round", 1)),
        "round_seconds": float(record["seconds"]),
        "run_wall_seconds": float(record["wall_seconds"]),
        "round_trips": trips,
        "median_round_trip_seconds": float(record.get("median_round_trip_seconds", float("nan"))),
        "mean_round_trip_seconds": transport / trips if trips else float("nan"),
        "server_seconds": float(record["seconds"]) - transport,
        "transport_seconds": transport,
        "slowest_site_seconds": slowest_site,
        "messaging_seconds": transport - slowest_site if sites else float("nan"),
        "train_loss": float(record["train_loss"]),
        "balanced_accuracy": float(record["balanced_accuracy"]),
        "clients_trained": int(record["clients_trained"]),
        "clients_evaluated": int(record["clients_evaluated"]),
    }


COLUMNS = [
    ("mode", "mode"),
    ("backend", "backend"),
    ("round", "round"),
    ("round_seconds", "round s"),
    ("round_trips", "round trips"),
    ("median_round_trip_seconds", "median s / round trip"),
    ("server_seconds", "server s"),
    ("transport_seconds", "round trips s"),
    ("slowest_site_seconds", "slowest site s"),
    ("messaging_seconds", "Flower messaging s"),
    ("train_loss", "train loss"),
    ("balanced_accuracy", "bal. acc."),
]


def run_round_benchmark(
    workdir: Path,
    *,
    backend: str = "ckks-8192",
    clients: int = 3,
    batch_size: int = 16,
    rounds: int = 2,
    max_samples: int | None = None,
    deployment: bool = True,
    compare_clientapp: bool = False,
    timeout: float = 1800.0,
    deployment_seconds: float = 7200.0,
    results_dir: Path = Path("results"),
    name: str = "deployment",
    command: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure ``rounds`` rounds (a) in process and (b) on the Deployment Engine; write the
    results. In round 1 the held-out sets ride along the training batches under encryption (a
    larger selection and set); every evaluation runs on the outputs the clients kept
    (``docs/double_blind.md``), so both rounds are reported."""
    from fedfm.crypto.randomness import write_secret_file

    if rounds < 1:
        raise ConfigError(f"--rounds must be at least 1, got {rounds}")
    if not (workdir / "student.pt").exists():
        raise ConfigError(f"no distilled student in {workdir}: run `fedfm distill` first")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fedfm-bench-round-") as scratch:
        root = Path(scratch)
        secret = root / "server.secret"
        write_secret_file(secret)

        def config_for(chosen: str, checkpoint: str) -> dict[str, Any]:
            return run_config(
                workdir,
                root / checkpoint,
                backend=chosen,
                clients=clients,
                batch_size=batch_size,
                timeout=timeout,
                max_samples=max_samples,
                rounds=rounds,
            )

        log("[bench-round] (a) in process, simulate (the reference)")
        reference = in_process_round(config_for("simulate", "simulate"), secret, log)
        rows += [_row("in process", "simulate", record) for record in reference]
        if backend != "simulate":
            log(f"[bench-round] (a) in process, {backend}")
            records = in_process_round(config_for(backend, "a"), secret, log)
            rows += [_row("in process", backend, record) for record in records]
        if deployment:
            policy = {"allow-plaintext": True} if backend == "simulate" else {}
            # (mode, site processes, warm executors, keep-warm holds)
            modes = [(DEPLOYED, True, True, True)]
            if compare_clientapp:
                modes += [
                    (f"{WARM}, no keep-warm", True, True, False),
                    ("deployment, site processes, ClientApp per message", True, False, False),
                    ("deployment, ClientApp per message", False, False, False),
                ]
            for index, (mode, sites, executors, keep_warm) in enumerate(modes):
                log(f"[bench-round] (b) {mode}, {backend}")
                # with warm executors, the recommended deployment: each site's next request
                # goes out as soon as its reply is answered (run config `pipelined`), a hold
                # after each request keeps its SuperNode awake (`keep-warm`)
                changes = {"pipelined": executors, "keep-warm": keep_warm}
                records = deployment_round(
                    {**config_for(backend, f"b{index}"), **changes},
                    secret,
                    root / f"deploy-{index}",
                    sites=sites,
                    executors=executors,
                    clients=clients,
                    node_policy=policy,
                    seconds=deployment_seconds,
                    log=log,
                )
                rows += [_row(mode, backend, record) for record in records]

    def found(mode: str, server_round: int) -> dict[str, Any] | None:
        matches = [
            row
            for row in rows
            if (row["mode"], row["backend"], row["round"]) == (mode, backend, server_round)
        ]
        return matches[0] if matches else None

    in_process = found("in process", 1)
    deployed = found(DEPLOYED, 1)
    later = found("in process", rounds) if rounds > 1 else None
    later_deployed = found(DEPLOYED, rounds) if rounds > 1 else None
    summary: dict[str, Any] = {
        "backend": backend,
        "clients": clients,
        "batch_size": batch_size,
        "rounds": rounds,
        "encrypted_round_seconds_in_process": in_process["round_seconds"] if in_process else None,
        "encrypted_round_seconds_deployment": deployed["round_seconds"] if deployed else None,
        "deployment_overhead": deployed["round_seconds"] / in_process["round_seconds"]
        if deployed and in_process
        else None,
        "seconds_per_round_trip": deployed["median_round_trip_seconds"] if deployed else None,
        "round_trips_per_round": (in_process or rows[0])["round_trips"],
        # a later round: the evaluation runs on the clients' kept outputs
        "later_round_seconds_in_process": later["round_seconds"] if later else None,
        "later_round_seconds_deployment": later_deployed["round_seconds"]
        if later_deployed
        else None,
        "later_round_trips_per_round": (later or {}).get("round_trips"),
        "reference_simulate": {
            "train_loss": rows[0]["train_loss"],
            "balanced_accuracy": rows[0]["balanced_accuracy"],
        },
    }
    if in_process and backend != "simulate":
        summary["train_loss_difference_vs_simulate"] = abs(
            in_process["train_loss"] - rows[0]["train_loss"]
        )
    description = (
        f"Double-blind rounds of the distilled student in {workdir} (digits unless its run "
        f"says otherwise): {clients} clients (iid), 1 batch of {batch_size} each per round, "
        f"{rounds} rounds, each evaluated, secure aggregation on; backend `{backend}`. In round 1 "
        "each client's held-out set rides along its training batch in one set of ciphertexts "
        "(the frozen blocks evaluated on both under encryption) and the client keeps its "
        "outputs; every round's evaluation is then one round trip on the kept outputs. "
        "(a) every party in this process; "
        "(b) a local Deployment Engine as the deployment tests start it: a TLS SuperLink and "
        f"{clients} authenticated SuperNodes on 127.0.0.1, all on this machine's 2 cores, each "
        "SuperNode with `--isolation process`, a warm ClientApp executor (`fedfm executor`) and "
        "the data owner's site process (`fedfm site`), the server sending each site its next "
        "request as soon as its reply is answered (run config `pipelined = true`; in process and "
        "in the per-message modes, every round trip waits for all sites) and following each "
        "request with a hold message that keeps the SuperNode busy until about when its next "
        "request is due (run config `keep-warm = true`); if compared, also warm executors "
        "without the holds, Flower's per-message "
        "ClientApp process (`flwr-clientapp`, started by the SuperNode) forwarding to the site "
        "processes, and without site processes. server s = round s - time inside round trips; "
        "slowest site s = the busiest site's own answering time (from its log); Flower messaging "
        "s = round trips s - slowest site s: what the messages' way through SuperLink, SuperNode "
        "and the ClientApp executor or process costs. The server's draws are keyed by one "
        "secret file in all modes, so every mode sees the same batches."
    )
    write_results(
        results_dir,
        name,
        title="Encrypted double-blind rounds: in process vs Flower's Deployment Engine",
        description=description,
        rows=rows,
        columns=COLUMNS,
        extra={"summary": summary},
        command=command,
    )
    return summary
