"""Run the HELIX Flower App with ``flwr run`` in a local simulation, then check what it did.

Usage (from the repository root, with fedfm installed in ``.venv``)::

    .venv/bin/python simulations/helix/run.py [--clients K] [--synthetic] [--seed S]
        [--public-size N] [--queries Q] [--workspace DIR] [flwr run options]

It prepares a workspace (a temporary folder unless ``--workspace``): the parties' inputs
(``inputs/<role>.npz``), a fresh identity key per simulated node, the pins, and a private
``FLWR_HOME``; then runs the app on ``1 + K`` SuperNodes (the provider on partition 0, client
``i`` on ``i + 1``) with the helpers of ``simulations/double_blind/run.py``. The inputs are, by
default, real: standard-library docstrings embedded by the packaged MiniLM (provider) and by an
LSA encoder each client fits on its own corpus (every client uses a different number of
dimensions: independent models), the provider's head a logistic regression on its training set.
``--synthetic`` uses small random embeddings instead (seconds, for tests).

Every client's operator gets a 32-byte ``report_key`` in its inputs: the client publishes its
``W*``, ``b*`` and logits sealed under it, so the ServerApp's ``result.json`` carries them
unreadable to the relay. This script opens them and compares them with the plaintext ridge
solution and plaintext logits; the exit status is 0 only if the run completed and every
client's results agree (relative error at most 1e-3).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from fedfm.protocols.helix import PROVIDER, client_role, fit_alignment, open_report

APP = Path(__file__).resolve().parent
ROOT = APP.parents[1]
TOLERANCE = 1e-3
RIDGE = 0.1


def _double_blind_launcher():
    """``simulations/double_blind/run.py``, loaded under its own name (both files are run.py)."""
    spec = importlib.util.spec_from_file_location(
        "fedfm_double_blind_run", ROOT / "simulations" / "double_blind" / "run.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _double_blind_launcher()


def synthetic_inputs(clients: int, *, seed: int, public_size: int, queries: int) -> dict:
    """Correlated random embeddings: ``Z_B`` a noisy linear image of ``Z_A`` per client."""
    rng = np.random.default_rng(seed)
    provider_dims, classes = 12, 4
    public = rng.normal(size=(public_size, provider_dims))
    inputs = {
        PROVIDER: {
            "public": public,
            "head_weight": rng.normal(size=(provider_dims, classes)),
            "head_bias": rng.normal(size=classes),
        }
    }
    for index in range(clients):
        mixing = rng.normal(size=(provider_dims, 6 + 2 * index))
        inputs[client_role(index)] = {
            "public": public @ mixing + 0.05 * rng.normal(size=(public_size, mixing.shape[1])),
            "queries": rng.normal(size=(queries, provider_dims)) @ mixing,
        }
    return inputs


def real_inputs(clients: int, *, seed: int, public_size: int, queries: int) -> dict:
    """MiniLM for the provider, one LSA encoder per client (module docstring)."""
    from fedfm.data.stdlib_text import build_splits
    from fedfm.experiments.helix_evaluation import embed_party, train_head

    per_class = -(-queries // 7)
    data = build_splits(
        seed=seed, public_size=public_size, train_per_class=100, queries_per_class=per_class,
        ood_size=1,
    )  # fmt: skip
    provider = embed_party(
        "minilm", data, data.public + data.train.texts, seed=seed, cache_dir=None
    )
    head = train_head(provider.train, data.train.labels, seed=seed)
    inputs = {
        PROVIDER: {"public": provider.public, "head_weight": head.weight, "head_bias": head.bias}
    }
    corpus = data.public + data.queries.texts
    for index in range(clients):
        client = embed_party(f"lsa:{64 + 32 * index}", data, corpus, seed=seed, cache_dir=None)
        inputs[client_role(index)] = {"public": client.public, "queries": client.queries[:queries]}
    return inputs


def check_reports(workspace: Path, clients: int) -> list[tuple[bool, str]]:
    """Open each client's sealed report: per client, whether it is right and a line saying so."""
    outputs = json.loads((workspace / "result.json").read_text())["outputs"]
    provider = np.load(workspace / "inputs" / f"{PROVIDER}.npz")
    lines = []
    for index in range(clients):
        role = client_role(index)
        inputs = np.load(workspace / "inputs" / f"{role}.npz")
        sealed = np.asarray(outputs[role]["report"]["values"], dtype=np.uint8)
        report = open_report(inputs["report_key"].tobytes(), sealed, role)
        mapping = fit_alignment(inputs["public"], provider["public"], RIDGE)
        logits = mapping.apply(inputs["queries"]) @ provider["head_weight"] + provider["head_bias"]
        errors = [
            np.abs(report[name] - value).max() / np.abs(value).max()
            for name, value in (("alignment_weight", mapping.weight), ("logits", logits))
        ]
        good = max(errors) <= TOLERANCE
        lines.append(
            (
                good,
                f"{role}: W* and {len(logits)} logits {'match' if good else 'DO NOT match'} the "
                f"plaintext computation (max relative errors {errors[0]:.1e}, {errors[1]:.1e})",
            )
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=2, help="data owners (2)")
    parser.add_argument("--synthetic", action="store_true", help="random embeddings (fast)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data (0)")
    parser.add_argument("--public-size", type=int, default=512, help="public samples (512)")
    parser.add_argument("--queries", type=int, default=16, help="queries per client (16)")
    parser.add_argument("--workspace", type=Path, help="an empty or new folder to keep")
    launcher.add_resource_arguments(parser)
    args, flwr_args = parser.parse_known_args(argv)
    resources = launcher.ClientResources.of_app(APP, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    build = synthetic_inputs if args.synthetic else real_inputs
    inputs = build(args.clients, seed=args.seed, public_size=args.public_size, queries=args.queries)
    with tempfile.TemporaryDirectory(prefix="fedfm-helix-") as temporary:
        workspace = (args.workspace or Path(temporary)).resolve()
        workspace.mkdir(parents=True, exist_ok=True)
        report_keys = {  # each data owner opens its report with its own key
            role: {"report_key": np.frombuffer(os.urandom(32), np.uint8)}
            for role in inputs
            if role != PROVIDER
        }
        config, node_config = launcher.provision_runtime_nodes(
            workspace,
            list(inputs),
            {role: {**arrays, **report_keys.get(role, {})} for role, arrays in inputs.items()},
        )
        config["clients"] = args.clients
        home = workspace / "flwr-home"
        home.mkdir()
        overrides = ["--run-config", launcher.config_pairs(config), *flwr_args]
        status = launcher.run_app(
            APP, len(inputs), home, overrides, node_config=node_config, resources=resources
        )
        print(f"[fedfm] flwr run: {status}; SuperLink stopped")
        if status != "finished:completed":
            return 1
        checks = check_reports(workspace, args.clients)
        for _, line in checks:
            print(f"[fedfm] helix: {line}")
        return 0 if all(good for good, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
