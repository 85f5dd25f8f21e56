"""Run the SLIP Flower App with ``flwr run`` in a local simulation, then check what it did.

Usage (from the repository root, with fedfm installed in ``.venv``)::

    .venv/bin/python simulations/slip/run.py [--model NAME_OR_FOLDER] [--decoder-cache DIR]
        [--tokens T] [--rank K] [--attention single-step|double-step] [--workspace DIR]
        [flwr run options]

It prepares a workspace (a temporary folder unless ``--workspace``): the model owner's offline
step (:func:`fedfm.protocols.slip.provision`: David's weight file ``david.npz``, Charlie's
folder with his ``W_C`` factors and pads for two inferences), Charlie's prompt (the first
``--tokens`` tokens of a held-out docstring), a fresh identity key per simulated node, the pins
and inputs, and a private ``FLWR_HOME``; then runs the app on two SuperNodes (charlie on
partition 0, david on 1) with the helpers of ``simulations/double_blind/run.py``.

Charlie gets a 32-byte ``report_key``: he publishes the last position's logits and his greedy
next token sealed under it, so the ServerApp's ``result.json`` carries them unreadable to the
relay. This script opens them and runs the same protocol in this process from the same files
(its pads are the next unused ones: the ledger refuses the ones the Flower run consumed): exit
status 0 only if the run completed, both runs give the same next token as the undecomposed model
and their logits agree within 1e-9 (exact ring arithmetic) and with the model within 2^-12.
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

APP = Path(__file__).resolve().parent
ROOT = APP.parents[1]
ROLES = ("charlie", "david")  # partitions 0, 1
TOLERANCE = 2.0**-12


def _double_blind_launcher():
    spec = importlib.util.spec_from_file_location(
        "fedfm_double_blind_run", ROOT / "simulations" / "double_blind" / "run.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _double_blind_launcher()


def build_inputs(config: dict, workspace: Path, tokens: int):
    """Provision the parties; each role's inputs; the prompt; the plain model's last logits."""
    import torch

    from fedfm.models.decoder import document_ids
    from fedfm.protocols.slip import provision, settings_from_config
    from fedfm.protocols.slip.protocol import load_model

    settings = settings_from_config(config)
    model = load_model(settings)
    charlie_folder, david_file = provision(model, settings, workspace / "owner", rows=2 * tokens)
    from fedfm.models.decoder import DecoderSource, load_decoder
    from fedfm.models.decoder.config import EMBEDDED_DECODERS

    source = settings.model
    if source in EMBEDDED_DECODERS:
        source = DecoderSource(name=source, cache_dir=Path(settings.decoder_cache))
    _, tokenizer = load_decoder(source, progress=False)
    from fedfm.data.stdlib_text import split_documents

    texts = [d.text for d in split_documents(seed=0).held_out]
    ids = next(i for i in document_ids(tokenizer, texts) if len(i) >= tokens)[:tokens]
    prompt = np.asarray(ids, dtype=np.int64)
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(prompt)[None]).logits[0, -1].double().numpy()
    key = np.frombuffer(os.urandom(32), np.uint8)
    inputs = {
        "charlie": {
            "input_ids": prompt,
            "report_key": key,
            "share": np.frombuffer(str(charlie_folder).encode(), np.uint8),
        },
        "david": {"share": np.frombuffer(str(david_file).encode(), np.uint8)},
    }
    return inputs, expected


def check(workspace: Path, config: dict, inputs: dict, expected: np.ndarray) -> tuple[bool, str]:
    from fedfm.protocols.slip import open_report, slip
    from fedfm.runtime import run_in_process

    result = json.loads((workspace / "result.json").read_text())
    key = inputs["charlie"]["report_key"].tobytes()
    values = result["outputs"]["charlie"]["report"]["values"]
    flower = open_report(key, np.asarray(values, np.uint8))
    local = run_in_process(slip(config), inputs)
    in_process = open_report(key, local.outputs["charlie"]["report"])
    scale = float(np.abs(expected).max())
    error = float(np.abs(flower["logits"] - expected).max()) / scale
    same_runs = float(np.abs(flower["logits"] - in_process["logits"]).max())
    token = int(expected.argmax())
    good = (
        int(flower["next_token"][0]) == int(in_process["next_token"][0]) == token
        and same_runs <= 1e-9
        and error <= TOLERANCE
    )
    return good, (
        f"next token {int(flower['next_token'][0])} (model {token}, in-process "
        f"{int(in_process['next_token'][0])}); flwr vs in-process max |delta logit| "
        f"{same_runs:.2e}; relative error vs the undecomposed model {error:.2e}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_fedfm_tiny", help="embedded name or folder")
    parser.add_argument("--decoder-cache", type=Path, default=ROOT / "runs" / "cache")
    parser.add_argument("--tokens", type=int, default=16, help="prompt tokens (16)")
    parser.add_argument("--rank", type=int, default=8, help="k per split layer (8)")
    parser.add_argument("--attention", default="single-step")
    parser.add_argument("--workspace", type=Path, help="an empty or new folder to keep")
    launcher.add_resource_arguments(parser)
    args, flwr_args = parser.parse_known_args(argv)
    resources = launcher.ClientResources.of_app(APP, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    model = str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model
    config = {
        "model": model,
        "decoder-cache": str(args.decoder_cache.resolve()),
        "rank": args.rank,
        "attention": args.attention,
    }
    with tempfile.TemporaryDirectory(prefix="fedfm-slip-") as temporary:
        workspace = (args.workspace or Path(temporary)).resolve()
        workspace.mkdir(parents=True, exist_ok=True)
        inputs, expected = build_inputs(config, workspace, args.tokens)
        run_config, node_config = launcher.provision_runtime_nodes(workspace, list(ROLES), inputs)
        run_config |= config
        home = workspace / "flwr-home"
        home.mkdir()
        overrides = ["--run-config", launcher.config_pairs(run_config), *flwr_args]
        status = launcher.run_app(
            APP, len(ROLES), home, overrides, node_config=node_config, resources=resources
        )
        print(f"[fedfm] flwr run: {status}; SuperLink stopped")
        if status != "finished:completed":
            return 1
        good, line = check(workspace, config, inputs, expected)
        print(f"[fedfm] slip: {line}")
        return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
