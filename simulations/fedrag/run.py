"""Run the FedRAG Flower App with ``flwr run`` in a local simulation, then check what it did.

Usage (from the repository root, with fedfm installed in ``.venv``)::

    .venv/bin/python simulations/fedrag/run.py [--stage generate|rag] [--tokens T]
        [--decoder NAME_OR_FOLDER] [--decoder-cache DIR] [--query N] [--workspace DIR]
        [flwr run options]

It prepares a workspace (a temporary folder unless ``--workspace``): the parties' inputs
(``inputs/<role>.npz``) from the docstring task of :mod:`fedfm.experiments.fedrag_data` (stage
``generate``: the gold document at owner_0 and a distractor at owner_1 as token ids; stage
``rag``: each owner's documents and MiniLM index, the coordinator's query, its embedding and
the re-ranker's relevance head), a fresh identity key per simulated node, the pins, and a private
``FLWR_HOME``; then runs the app on four SuperNodes (coordinator on partition 0, owner_0 on 1,
owner_1 on 2, the compute node on 3) with the helpers of ``simulations/double_blind/run.py``.

The coordinator gets a 32-byte ``report_key``: it publishes its generated tokens and logits
sealed under it, so the ServerApp's ``result.json`` carries them unreadable to the relay. This
script opens them and, in stage ``generate``, compares them with plaintext centralized RAG; the
exit status is 0 only if the run completed and (``generate``) the tokens are identical and the
logits within 1e-4.
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

from fedfm.protocols.fedrag import open_report

APP = Path(__file__).resolve().parent
ROOT = APP.parents[1]
ROLES = ("coordinator", "owner_0", "owner_1", "compute")  # partitions 0..3
TOLERANCE = 1e-4


def _double_blind_launcher():
    spec = importlib.util.spec_from_file_location(
        "fedfm_double_blind_run", ROOT / "simulations" / "double_blind" / "run.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _double_blind_launcher()


def _source(decoder: str, cache: Path):
    from fedfm.protocols.fedrag.protocol import decoder_source, settings_from_config

    return decoder_source(settings_from_config({"decoder": decoder, "decoder-cache": str(cache)}))


def build_inputs(stage: str, decoder: str, cache: Path, query: int, tokens: int):
    """Each role's inputs, and the segments of the plaintext reference (stage generate)."""
    from fedfm.experiments.fedrag_bench import document_budget, task_cases
    from fedfm.experiments.fedrag_data import build_data
    from fedfm.protocols.fedrag.decoder import runner_for

    runner, _ = runner_for(_source(decoder, cache))
    data = build_data(questions=query + 1)
    key = np.frombuffer(os.urandom(32), np.uint8)
    if stage == "generate":
        budget = document_budget(runner, tokens)
        case = task_cases(runner, data, document_tokens=budget, count=query + 1)[query]
        inputs = {
            "coordinator": {"query": case.query, "report_key": key},
            "owner_0": {"segment": case.owner_0},
            "owner_1": {"segment": case.owner_1},
        }
        return inputs, case.segments()
    from fedfm.experiments.fedrag_data import embed, train_relevance_head
    from fedfm.protocols.fedrag.rag import join_documents

    weight, bias, _ = train_relevance_head()
    question = data.questions[query]
    inputs = {
        "coordinator": {
            "query_text": np.frombuffer(question.query.encode(), np.uint8),
            "query_embedding": embed([question.query])[0],
            "reranker_weight": weight,
            "reranker_bias": bias,
            "report_key": key,
        }
    }
    for number, documents in enumerate(data.owners):
        texts = [d.text for d in documents]
        inputs[f"owner_{number}"] = {"documents": join_documents(texts), "index": embed(texts)}
    return inputs, None


def check(workspace: Path, segments, decoder: str, cache: Path, tokens: int) -> tuple[bool, str]:
    from fedfm.protocols.fedrag.decoder import runner_for
    from fedfm.protocols.fedrag.reference import plaintext_generate

    outputs = json.loads((workspace / "result.json").read_text())["outputs"]
    key = np.load(workspace / "inputs" / "coordinator.npz")["report_key"].tobytes()
    report = open_report(key, np.asarray(outputs["coordinator"]["report"]["values"], np.uint8))
    runner, tokenizer = runner_for(_source(decoder, cache))
    text = tokenizer.decode(report["tokens"])
    if segments is None:
        chosen = list(zip(report["selected_owner"], report["selected_document"], strict=True))
        return True, f"rag: selected (owner, document) {chosen}, generated {text!r}"
    expected, logits = plaintext_generate(runner, segments, tokens)
    same = bool(np.array_equal(report["tokens"], expected))
    diff = float(np.abs(report["logits"] - logits).max())
    good = same and diff <= TOLERANCE
    return good, (
        f"generated {text!r}: tokens {'identical to' if same else 'DIFFERENT from'} plaintext "
        f"RAG, max |delta logit| {diff:.2e}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=("generate", "rag"), default="generate")
    parser.add_argument("--tokens", type=int, default=8, help="tokens to generate (8)")
    parser.add_argument("--decoder", default="llama_fedfm_tiny", help="embedded name or folder")
    parser.add_argument("--decoder-cache", type=Path, default=ROOT / "runs" / "cache")
    parser.add_argument("--query", type=int, default=0, help="which task question (0)")
    parser.add_argument("--workspace", type=Path, help="an empty or new folder to keep")
    launcher.add_resource_arguments(parser)
    args, flwr_args = parser.parse_known_args(argv)
    resources = launcher.ClientResources.of_app(APP, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    cache = args.decoder_cache.resolve()
    decoder = str(Path(args.decoder).resolve()) if Path(args.decoder).is_dir() else args.decoder
    inputs, segments = build_inputs(args.stage, decoder, cache, args.query, args.tokens)
    with tempfile.TemporaryDirectory(prefix="fedfm-fedrag-") as temporary:
        workspace = (args.workspace or Path(temporary)).resolve()
        workspace.mkdir(parents=True, exist_ok=True)
        config, node_config = launcher.provision_runtime_nodes(workspace, list(ROLES), inputs)
        config |= {
            "stage": args.stage,
            "max-new-tokens": args.tokens,
            "decoder": decoder,
            "decoder-cache": str(cache),
        }
        home = workspace / "flwr-home"
        home.mkdir()
        overrides = ["--run-config", launcher.config_pairs(config), *flwr_args]
        status = launcher.run_app(
            APP, len(ROLES), home, overrides, node_config=node_config, resources=resources
        )
        print(f"[fedfm] flwr run: {status}; SuperLink stopped")
        if status != "finished:completed":
            return 1
        good, line = check(workspace, segments, decoder, cache, args.tokens)
        print(f"[fedfm] fedrag: {line}")
        return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
