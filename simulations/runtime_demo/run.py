"""Run the masked-sum Flower App with ``flwr run`` in a local simulation, then clean up.

Usage (from the repository root, with fedfm installed in ``.venv``)::

    .venv/bin/python simulations/runtime_demo/run.py [--length N] [--seed S] [--workspace DIR]
        [flwr run options]

It prepares a workspace (a temporary folder unless ``--workspace``): a fresh identity key per
simulated node (``identities/node-<partition-id>.key``), the pins (each role's identity
fingerprint), alice's and bob's private vectors (``inputs/<role>.npz``, seeded), and a private
``FLWR_HOME``; then starts a simulation SuperLink and runs the app on three SuperNodes (alice on
partition 0, bob on 1, carol on 2) the way ``simulations/double_blind/run.py`` does, whose helpers
it uses: free port, no runtime dependency installation, private Ray folder, clean shutdown, and
the run's status from ``flwr ls`` (``flwr run --stream`` exits 0 even when the run failed). The
ServerApp writes ``result.json``; the exit status is 0 only if the run completed and alice
published the sum of the two vectors.

In simulation every node reads its key from one folder of this machine: the demo shows the
message flow, not a separation of machines (for that, see "Deployment" in docs/runtime.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

APP = Path(__file__).resolve().parent
ROOT = APP.parents[1]
ROLES = ("alice", "bob", "carol")  # on partitions 0, 1, 2


def _double_blind_launcher():
    """``simulations/double_blind/run.py``, loaded under its own name (both files are run.py)."""
    spec = importlib.util.spec_from_file_location(
        "fedfm_double_blind_run", ROOT / "simulations" / "double_blind" / "run.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _double_blind_launcher()


def prepare(workspace: Path, *, length: int, seed: int) -> tuple[dict[str, object], str]:
    """Identities, pins and inputs (alice's and bob's vectors) for the three nodes in
    ``workspace``; the run config and the simulated nodes' own node config."""
    rng = np.random.default_rng(seed)
    inputs = {role: {"x": rng.integers(-(2**40), 2**40, size=length)} for role in ROLES[:2]}
    return launcher.provision_runtime_nodes(workspace, list(ROLES), inputs)


def expected_sum(workspace: Path) -> list[int]:
    """What alice must publish: the sum of the two vectors in the workspace."""
    vectors = [np.load(workspace / "inputs" / f"{role}.npz")["x"] for role in ROLES[:2]]
    return (vectors[0] + vectors[1]).tolist()


def run(workspace: Path, config: dict[str, object], node_config: str, flwr_args: list[str]) -> str:
    """Start a SuperLink, run the app with ``config`` (run config) and ``node_config`` (every
    simulated node's own), stop the SuperLink; the run's status."""
    home = workspace / "flwr-home"
    home.mkdir()
    overrides = ["--run-config", launcher.config_pairs(config), *flwr_args]
    return launcher.run_app(APP, len(ROLES), home, overrides, node_config=node_config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8, help="length of the vectors (8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the vectors (0)")
    parser.add_argument("--workspace", type=Path, help="an empty or new folder to keep")
    args, flwr_args = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedfm-runtime-") as temporary:
        workspace = (args.workspace or Path(temporary)).resolve()
        workspace.mkdir(parents=True, exist_ok=True)
        config, node_config = prepare(workspace, length=args.length, seed=args.seed)
        status = run(workspace, config, node_config, flwr_args)
        print(f"[fedfm] flwr run: {status}; SuperLink stopped")
        if status != "finished:completed":
            return 1
        published = json.loads((workspace / "result.json").read_text())["outputs"]["alice"]["sum"]
        correct = published["values"] == expected_sum(workspace)
        print(
            f"[fedfm] masked-sum: alice published {published['values']}: "
            f"{'the sum of the two vectors' if correct else 'NOT the sum of the two vectors'}"
        )
        return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
