"""Run the CENTAUR Flower App with ``flwr run`` in a local simulation, then check what it did.

Usage (from the repository root, with fedfm installed in ``.venv``)::

    .venv/bin/python simulations/centaur/run.py [--model tiny-bert|minilm|FOLDER]
        [--mode faithful|hardened|full-sharing] [--tokens T] [--cache-dir DIR]
        [--workspace DIR] [flwr run options]

It prepares a workspace (a temporary folder unless ``--workspace``): the model (``tiny-bert``: a
small random BERT classifier built from a config with a public seed, seconds; ``minilm``: the
fine-tuned MiniLM docstring classifier of ``fedfm bench-centaur``; or a local Hugging Face
folder holding a BERT sequence classifier or a Llama causal LM), the developer's offline step
(permutations from the OS CSPRNG, Θ', the calibration), the parties' inputs (``developer.npz``
and ``cloud.npz``: the provisioned files; ``client.npz``: the token ids and a 32-byte
``report_key``), a fresh identity key per simulated node, the pins and a private ``FLWR_HOME``;
then runs the app on three SuperNodes (developer on partition 0, cloud on 1, client on 2) with
the helpers of ``simulations/double_blind/run.py``.

The client publishes its logits (and generated tokens) sealed under its ``report_key``; this
script opens them and compares them with the same protocol run in this process and with
plaintext: the exit status is 0 only if the run completed, the predictions (or greedy tokens)
are identical and the logits agree within 1e-2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.protocols.centaur import centaur, open_report
from fedfm.protocols.centaur.model import extract
from fedfm.protocols.centaur.provisioning import Deployment, calibrate, prepare
from fedfm.runtime import InProcessFederation

APP = Path(__file__).resolve().parent
ROOT = APP.parents[1]
ROLES = ("developer", "cloud", "client")  # partitions 0..2
TOLERANCE = 1e-2


def _double_blind_launcher() -> Any:
    spec = importlib.util.spec_from_file_location(
        "fedfm_double_blind_run", ROOT / "simulations" / "double_blind" / "run.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_bert() -> Any:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)  # a public demo model
    config = BertConfig(
        vocab_size=500,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=4,
        initializer_range=0.2,
    )
    return BertForSequenceClassification(config).eval()


def load_model(name: str, cache: Path) -> Any:
    if name == "tiny-bert":
        return tiny_bert()
    if name == "minilm":
        from fedfm.experiments.centaur_data import minilm_classifier

        return minilm_classifier(cache).model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    except OSError as error:  # nothing is downloaded: a name must be in the local cache
        raise SystemExit(
            f"[fedfm] centaur: no model {name!r} in a folder or the local Hugging Face cache "
            f"(nothing is downloaded; give tiny-bert, minilm or a folder): {error}"
        ) from None
    loader = (
        AutoModelForCausalLM if config.model_type == "llama" else AutoModelForSequenceClassification
    )
    return loader.from_pretrained(name, local_files_only=True).eval()


def build(model_name: str, cache: Path, mode: str) -> tuple[Deployment, np.ndarray]:
    architecture, weights = extract(load_model(model_name, cache))
    rng = np.random.default_rng(0)  # public: the demo input and the calibration text
    public = [rng.integers(3, architecture.vocab, 12) for _ in range(3)]
    plan = prepare(
        architecture, weights, mode=mode, calibration=calibrate(architecture, weights, public)
    )
    return plan, rng.integers(3, architecture.vocab, 10)


launcher = _double_blind_launcher()


def prepare_workspace(workspace: Path, plan: Deployment, ids: np.ndarray, key: bytes) -> str:
    """Identities, pins and inputs in ``workspace``: the developer's file, the file the
    developer provisions the cloud with, the client's tokens and report key; the node config."""
    inputs = {
        "developer": plan.developer.arrays(),
        "cloud": plan.cloud.arrays(),
        "client": {"tokens": ids, "report_key": np.frombuffer(key, np.uint8)},
    }
    _, node_config = launcher.provision_runtime_nodes(workspace, list(ROLES), inputs)
    return node_config


def check(
    workspace: Path, plan: Deployment, ids: np.ndarray, key: bytes, config: dict[str, Any]
) -> tuple[bool, str]:
    outputs = json.loads((workspace / "result.json").read_text())["outputs"]
    report = open_report(key, np.asarray(outputs["client"]["report"]["values"], np.uint8))
    inputs = {
        "developer": plan.developer.arrays(),
        "cloud": plan.cloud.arrays(),
        "client": {"tokens": ids, "report_key": np.frombuffer(key, np.uint8)},
    }
    local = InProcessFederation(centaur(config), inputs).run()
    in_process = open_report(key, local.outputs["client"]["report"])
    diff = float(np.abs(report["logits"] - in_process["logits"]).max())
    architecture = plan.developer.architecture
    if architecture.kind == "llama":
        same = bool(np.array_equal(report["tokens"], in_process["tokens"]))
        what = f"greedy tokens {report['tokens'].tolist()}"
    else:
        same = int(np.argmax(report["logits"][0])) == int(np.argmax(in_process["logits"][0]))
        what = f"predicted class {int(np.argmax(report['logits'][0]))}"
    good = same and diff <= TOLERANCE
    return good, (
        f"{what}: {'identical to' if same else 'DIFFERENT from'} the in-process run, max |delta "
        f"logit| {diff:.2e}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="tiny-bert", help="tiny-bert, minilm or a folder")
    parser.add_argument(
        "--mode", default="faithful", choices=("faithful", "hardened", "full-sharing")
    )
    parser.add_argument("--tokens", type=int, default=2, help="greedy tokens (llama) (2)")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / "runs" / "cache")
    parser.add_argument("--workspace", type=Path, help="an empty or new folder to keep")
    launcher.add_resource_arguments(parser)
    args, flwr_args = parser.parse_known_args(argv)
    resources = launcher.ClientResources.of_app(APP, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    model = str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model
    plan, ids = build(model, args.cache_dir.resolve(), args.mode)
    key = os.urandom(32)
    with tempfile.TemporaryDirectory(prefix="fedfm-centaur-") as temporary:
        workspace = (args.workspace or Path(temporary)).resolve()
        workspace.mkdir(parents=True, exist_ok=True)
        node_config = prepare_workspace(workspace, plan, ids, key)
        config: dict[str, Any] = plan.run_config(**{"max-new-tokens": args.tokens})
        run_config = config | {"results-file": str(workspace / "result.json")}
        home = workspace / "flwr-home"
        home.mkdir()
        # a TOML file: the architecture is a JSON string, which the inline form does not take
        config_file = workspace / "run-config.toml"
        config_file.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in run_config.items()))
        overrides = ["--run-config", str(config_file), *flwr_args]
        status = launcher.run_app(
            APP, len(ROLES), home, overrides, node_config=node_config, resources=resources
        )
        print(f"[fedfm] flwr run: {status}; SuperLink stopped")
        if status != "finished:completed":
            return 1
        good, line = check(workspace, plan, ids, key, config)
        print(f"[fedfm] centaur: {line}")
        return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
