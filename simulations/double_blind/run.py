"""Run the double-blind Flower App with ``flwr run`` in a local simulation, then clean up.

Usage (from the repository root, with fedfm installed in ``.venv``)::

    .venv/bin/python simulations/double_blind/run.py [--supernodes K] [flwr run options]

What it does, because Flower 1.41 needs it done:

* a temporary ``FLWR_HOME`` (unless ``--flwr-home``) whose ``config.toml`` defines the SuperLink
  connection ``fedfm-local`` (so nothing is read from or written to ``~/.flwr``);
* its own simulation SuperLink on a free local port, started from the repository root, with
  ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (otherwise Flower tries ``uv sync`` with the
  app's dependencies), telemetry and update checks off, Ray's files in a private temporary
  folder; at the end it is stopped and the processes it started (SuperExec, simulation, Ray)
  are given 30 s to follow, then ended;
* ``flwr run simulations/double_blind fedfm-local --stream`` with ``K`` simulated SuperNodes
  (``--federation-config num-supernodes=K``; K clients in the run config too) and the paths
  ``workdir`` made absolute (the student ``fedfm distill`` wrote there; without one the script stops
  before starting Flower, naming the command); further arguments go to ``flwr run`` as they are,
  e.g. ``--run-config "rounds=2 strategy='fedadam'"``;
* the simulated data owners' own settings (their privacy policy:
  :mod:`fedfm.protocols.double_blind.policy`) from ``--node-config`` (default
  ``allow-plaintext=true``: the default backend ``simulate`` sends images in plaintext, which a
  data owner must accept explicitly), passed as ``$FEDFM_NODE_CONFIG`` to the processes that run
  the ClientApps; never through the run config, which the server hands out;
* the data owners' SecAgg identities: a fresh identity key per simulated SuperNode and the pins
  of all of them in a fresh folder ``data-owners-*`` under ``FLWR_HOME``
  (``create_simulation_identities``), named to the ClientApps by the node config key
  ``secagg-identity-dir`` (in ``$FEDFM_NODE_CONFIG``; the run config comes from the server and
  is never read for identities). ``--secagg-semi-honest`` sets ``secagg-mode=semi-honest``
  instead (the data owners then trust the server to relay their keys faithfully);
* the server's randomness keyed by ``--server-secret-file`` (``$FEDFM_SERVER_SECRET_FILE`` of the
  ServerApp; default: a fresh key from the OS) for reproducible runs;
* each virtual client's resources (Ray's share of CPUs and of a GPU per ClientApp) from the app's
  ``[tool.fedfm.simulation]`` table (``client-resources-num-cpus``, ``client-resources-num-gpus``;
  Flower's own defaults, 2 and 0.0) or ``--num-cpus`` / ``--num-gpus`` (fractional: 0.2 puts
  five clients on one GPU), passed as ``flwr run --federation-config
  "num-supernodes=K client-resources-num-cpus=C client-resources-num-gpus=G"``; a GPU share
  without a GPU that torch sees stops here, in one line (Ray would wait for it forever);
* the exit status is 0 only if Flower reports the run ``finished:completed``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

APP = Path(__file__).resolve().parent
ROOT = APP.parents[1]
CONNECTION = "fedfm-local"
BIN = Path(sys.executable).parent
# read by fedfm.flower.apps.node_config and strategies/double_blind.py (not imported here: this
# script starts Flower and must stay light)
NODE_CONFIG_ENV = "FEDFM_NODE_CONFIG"
SERVER_SECRET_ENV = "FEDFM_SERVER_SECRET_FILE"


class ClientResources:
    """Ray's reservation per virtual client (a ClientApp): whole CPUs and a fraction of a GPU.

    Flower runs as many ClientApps at once as the reservations fit: with one GPU and
    ``num_gpus=0.2``, five; each of them sees the GPU (``--device auto`` picks it) and shares its
    memory with the other four (Ray divides scheduling, not memory).

    (A plain class, not a dataclass: the other apps' run.py load this file without registering
    it in ``sys.modules``, which ``dataclasses`` needs.)
    """

    def __init__(self, num_cpus: int = 2, num_gpus: float = 0.0) -> None:
        if not isinstance(num_cpus, int) or num_cpus < 1:
            raise ValueError(f"client-resources-num-cpus must be an integer >= 1: {num_cpus}")
        if not num_gpus >= 0.0:
            raise ValueError(f"client-resources-num-gpus must be >= 0: {num_gpus}")
        self.num_cpus, self.num_gpus = num_cpus, float(num_gpus)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClientResources) and (self.num_cpus, self.num_gpus) == (
            other.num_cpus,
            other.num_gpus,
        )

    def __hash__(self) -> int:
        return hash((self.num_cpus, self.num_gpus))

    def __repr__(self) -> str:
        return f"ClientResources(num_cpus={self.num_cpus}, num_gpus={self.num_gpus})"

    @classmethod
    def of_app(
        cls, app: Path, *, num_cpus: int | None = None, num_gpus: float | None = None
    ) -> ClientResources:
        """The app's ``[tool.fedfm.simulation]`` settings, overridden by the given values."""
        table = (
            tomllib.loads((app / "pyproject.toml").read_text())
            .get("tool", {})
            .get("fedfm", {})
            .get("simulation", {})
        )
        defaults = cls()
        return cls(
            num_cpus=int(
                num_cpus
                if num_cpus is not None
                else table.get("client-resources-num-cpus", defaults.num_cpus)
            ),
            num_gpus=float(
                num_gpus
                if num_gpus is not None
                else table.get("client-resources-num-gpus", defaults.num_gpus)
            ),
        )

    def federation_config(self, supernodes: int) -> str:
        """``flwr run --federation-config``'s value for ``supernodes`` simulated nodes."""
        return (
            f"num-supernodes={supernodes} client-resources-num-cpus={self.num_cpus} "
            f"client-resources-num-gpus={self.num_gpus}"
        )

    def check_gpu(self) -> None:
        """Refuse a GPU share when torch sees no GPU (imports torch only then)."""
        if self.num_gpus > 0:
            from fedfm.models.device import resolve_device

            resolve_device("cuda")


def add_resource_arguments(parser: argparse.ArgumentParser) -> None:
    """``--num-cpus`` and ``--num-gpus``: each virtual client's reservation (default: the app's
    ``[tool.fedfm.simulation]``)."""
    parser.add_argument(
        "--num-cpus", type=int, default=None, help="CPUs per virtual client (app TOML: 2)"
    )
    parser.add_argument(
        "--num-gpus",
        type=float,
        default=None,
        help="GPU fraction per virtual client, e.g. 0.2 for 5 clients on one GPU (app TOML: 0)",
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _environment(home: Path, ray_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(home),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        RAY_TMPDIR=str(ray_dir),
    )
    return env


def _wait_until_healthy(port: int, superlink: subprocess.Popen, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if superlink.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with status {superlink.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"flower-superlink did not answer on port {port} within {seconds:.0f} s")


def _processes_of(home: Path) -> list[int]:
    """Live processes of this run: they inherited ``FLWR_HOME=home`` (Linux; none elsewhere)."""
    marker = f"FLWR_HOME={home}\0".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def _wait_for_exit(home: Path, seconds: float = 30.0) -> None:
    """Give the SuperLink's children time to follow it; end the ones that do not, by pid.

    The SuperLink gives its SuperExec one second to stop and otherwise leaves it to notice the
    SuperLink is gone, which takes a few seconds more (Flower 1.41).
    """
    deadline = time.monotonic() + seconds
    while (pids := _processes_of(home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue


def _run_status(env: dict[str, str], seconds: float = 30.0) -> str:
    """The status Flower reports for the only run on this SuperLink, once it has finished."""
    deadline = time.monotonic() + seconds
    status = "unknown"
    while time.monotonic() < deadline:
        listing = subprocess.run(
            [str(BIN / "flwr"), "ls", CONNECTION, "--format", "json"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        try:
            runs = json.loads(listing.stdout).get("runs", [])
        except ValueError:
            runs = []
        status = runs[0]["status"] if runs else "unknown"
        if status.startswith("finished"):
            break
        time.sleep(1)
    return status


def data_owners_node_config(home: Path, supernodes: int, *, semi_honest: bool) -> str:
    """The data owners' side of the simulation: their identities, as node config pairs."""
    from fedfm.protocols.double_blind.identities import (
        SECAGG_IDENTITY_DIR,
        SECAGG_MODE,
        SEMI_HONEST,
        create_simulation_identities,
    )

    if semi_honest:
        return f"{SECAGG_MODE}={SEMI_HONEST!r}"
    folder = Path(tempfile.mkdtemp(prefix="data-owners-", dir=home))  # only we can read it
    create_simulation_identities(folder, supernodes)
    return f"{SECAGG_IDENTITY_DIR}={str(folder)!r}"


def run(
    supernodes: int,
    home: Path,
    flwr_args: list[str],
    *,
    node_config: str = "",
    semi_honest: bool = False,
    resources: ClientResources | None = None,
) -> int:
    """Start a SuperLink, run the double-blind app, stop the SuperLink; 0 if the run completed."""
    workdir = ROOT / "runs" / "distill"
    student = workdir / "student.pt"
    if not any("workdir" in argument for argument in flwr_args) and not student.exists():
        # the ServerApp would refuse too, after starting a SuperLink: say it now
        print(f"[fedfm] no distilled student at {student}: run `fedfm distill` first")
        return 2
    defaults = f"num-clients={supernodes} workdir='{workdir}'"
    owners = data_owners_node_config(home, supernodes, semi_honest=semi_honest)
    node_config = f"{node_config} {owners}".strip()
    print(f"[fedfm] simulated data owners' node config: {node_config}")
    status = run_app(
        APP,
        supernodes,
        home,
        ["--run-config", defaults, *flwr_args],
        node_config=node_config,
        resources=resources,
    )
    print(f"[fedfm] flwr run: {status}; SuperLink stopped")
    return 0 if status == "finished:completed" else 1


def config_pairs(values: dict[str, object]) -> str:
    """``key="value" ...``: Flower's ``--run-config`` / ``--node-config`` syntax."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in values.items())


def provision_runtime_nodes(
    workspace: Path, roles: list[str], inputs: dict[str, dict[str, Any]]
) -> tuple[dict[str, object], str]:
    """The simulated sites of a runtime protocol, in ``workspace``: an identity per role (the
    node of partition k plays ``roles[k]``), every node pinning every identity, each role's
    inputs as ``inputs/<role>.npz``. Returns the run config (where the result goes) and the node
    config every simulated node reads (role partitions, identity folder, pins, inputs folder):
    nothing a node trusts comes from the run config."""
    import numpy as np

    from fedfm.runtime import create_identity_file, format_pins
    from fedfm.runtime.settings import identity_file

    identities, folder = workspace / "identities", workspace / "inputs"
    identities.mkdir(parents=True)
    folder.mkdir()
    pins = {
        role: create_identity_file(identity_file(identities, partition))
        for partition, role in enumerate(roles)
    }
    for role, arrays in inputs.items():
        np.savez(folder / f"{role}.npz", **arrays)
    node_config = {
        "role-partitions": ",".join(f"{role}={k}" for k, role in enumerate(roles)),
        "identity-dir": str(identities),
        "pins": format_pins(pins),
        "inputs-dir": str(folder),
    }
    return {"results-file": str(workspace / "result.json")}, config_pairs(node_config)


def flwr_run_command(
    app: Path, supernodes: int, resources: ClientResources, flwr_args: list[str]
) -> list[str]:
    """The ``flwr run`` command line: the app, the connection, the federation config (nodes and
    each virtual client's resources), then ``flwr_args``."""
    return [
        str(BIN / "flwr"),
        "run",
        str(app),
        CONNECTION,
        "--stream",
        "--federation-config",
        resources.federation_config(supernodes),
        *flwr_args,
    ]


def run_app(
    app: Path,
    supernodes: int,
    home: Path,
    flwr_args: list[str],
    *,
    node_config: str = "",
    resources: ClientResources | None = None,
) -> str:
    """Run the Flower App in ``app`` on a private simulation SuperLink; the run's final status.

    ``flwr_args`` go to ``flwr run`` after the app, the connection and the federation config;
    ``node_config`` (``key=value`` pairs) is every simulated node's own config, handed to the
    processes that run the ClientApps as ``$FEDFM_NODE_CONFIG``; ``resources`` each virtual
    client's reservation (default: the app's ``[tool.fedfm.simulation]``).
    """
    resources = resources or ClientResources.of_app(app)
    resources.check_gpu()  # before a SuperLink starts: Ray would wait forever for a GPU
    print(f"[fedfm] simulation: {resources.federation_config(supernodes)}")
    # Ray's own folder: short (its socket paths must stay under 108 bytes) and private (Ray
    # would join a cluster another user started with `ray start` under the shared /tmp/ray)
    with tempfile.TemporaryDirectory(prefix="fedfm-ray-", ignore_cleanup_errors=True) as ray:
        env = _environment(home, Path(ray))
        if node_config:
            env[NODE_CONFIG_ENV] = node_config
        port = _free_port()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        with (home / "superlink.log").open("w") as superlink_log:
            superlink = subprocess.Popen(
                [
                    str(BIN / "flower-superlink"),
                    "--insecure",
                    "--simulation",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                env=env,
                cwd=ROOT,
                stdout=superlink_log,
                stderr=subprocess.STDOUT,
            )
            try:
                _wait_until_healthy(port, superlink)
                command = flwr_run_command(app, supernodes, resources, flwr_args)
                exit_code = subprocess.run(command, env=env, cwd=ROOT, check=False).returncode
                return _run_status(env) if exit_code == 0 else f"flwr run exited with {exit_code}"
            finally:
                superlink.terminate()
                try:
                    superlink.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    superlink.kill()
                    superlink.wait()
                _wait_for_exit(home)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--supernodes", type=int, default=5, help="simulated clients (5)")
    parser.add_argument(
        "--flwr-home", type=Path, help="FLWR_HOME to use (default: a temporary folder)"
    )
    parser.add_argument(
        "--node-config",
        default=os.environ.get(NODE_CONFIG_ENV, "allow-plaintext=true"),
        help="the simulated data owners' own settings, key=value pairs "
        "(default: $FEDFM_NODE_CONFIG or allow-plaintext=true)",
    )
    parser.add_argument(
        "--server-secret-file",
        type=Path,
        help="key the server's draws with this secret file (reproducible runs)",
    )
    parser.add_argument(
        "--secagg-semi-honest",
        action="store_true",
        help="the data owners take SecAgg keys as the server relays them (no identities)",
    )
    add_resource_arguments(parser)
    args, flwr_args = parser.parse_known_args(argv)
    if args.server_secret_file is not None:
        os.environ[SERVER_SECRET_ENV] = str(args.server_secret_file.resolve())
    from fedfm.errors import FedfmError

    try:
        resources = ClientResources.of_app(APP, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
        resources.check_gpu()
    except (ValueError, FedfmError) as error:
        print(f"run.py: error: {error}", file=sys.stderr)
        return 2
    own = {
        "node_config": args.node_config,
        "semi_honest": args.secagg_semi_honest,
        "resources": resources,
    }
    if args.flwr_home is not None:
        args.flwr_home.mkdir(parents=True, exist_ok=True)
        return run(args.supernodes, args.flwr_home.resolve(), flwr_args, **own)
    with tempfile.TemporaryDirectory(prefix="fedfm-flwr-") as home:
        return run(args.supernodes, Path(home), flwr_args, **own)


if __name__ == "__main__":
    sys.exit(main())
