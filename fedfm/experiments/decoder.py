"""``fedfm train-llm``: train (or find cached) the embedded decoder and write its numbers.

Writes ``results/decoder_<name>.json`` and ``.md`` from the decoder's ``report.json``: training
time, held-out perplexity against the unigram baseline, bits per byte, and greedy samples.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedfm.errors import ConfigError
from fedfm.experiments.results import write_results
from fedfm.models.decoder.artefact import DecoderSource
from fedfm.models.decoder.training import train_decoder
from fedfm.models.device import resolve_device

COLUMNS = (
    ("model", "model"),
    ("parameters", "parameters"),
    ("steps", "steps"),
    ("epochs", "epochs"),
    ("training_seconds", "training s"),
    ("training_cpu_seconds", "training CPU s"),
    ("torch_threads", "threads"),
    ("held_out_perplexity", "held-out perplexity"),
    ("unigram_perplexity", "unigram perplexity"),
    ("held_out_bits_per_byte", "bits/byte"),
)


def run_train_llm(
    source: DecoderSource,
    *,
    restart: bool = False,
    threads: int | None = 1,
    progress: bool = True,
    results_dir: Path | None = Path("results"),
    command: str | None = None,
    log: Callable[[str], None] = print,
    device: str | torch.device | None = "auto",
) -> dict[str, Any]:
    """Train or load ``source``'s decoder, print where it is and its held-out perplexity, and
    (``results_dir`` set) write the results files. ``threads`` fixes torch's intra-op threads
    while training (``None``: unchanged): on a shared 2-core machine one thread is often
    faster than two (see the README). Training runs on ``device``
    (:func:`fedfm.models.device.resolve_device`)."""
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    target = resolve_device(device)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        report = train_decoder(source, restart=restart, progress=progress, log=log, device=target)
    finally:
        torch.set_num_threads(previous)
    log(f"[fedfm] decoder {source.name}: {source.path}")
    log(
        f"[fedfm] held-out perplexity {report['held_out_perplexity']:.2f} "
        f"(unigram baseline {report['unigram_perplexity']:.2f}, "
        f"{report['held_out_bits_per_byte']:.3f} bits per byte)"
    )
    sample = report["samples"][0]
    log(f"[fedfm] greedy: {sample['prompt']!r} -> {sample['completion']!r}")
    if results_dir is not None:
        write_decoder_results(report, results_dir=results_dir, command=command)
    return report


def write_decoder_results(
    report: dict[str, Any], *, results_dir: Path, command: str | None = None
) -> tuple[Path, Path]:
    """``decoder_<name>.json`` and ``.md`` from a decoder's report."""
    training, text = report["training"], report["text"]
    blocks_per_epoch = text["train_tokens"] / report["variant"]["context"]
    row = {
        "model": report["name"],
        "parameters": report["model"]["parameters"],
        "steps": training["steps"],
        "epochs": round(training["steps"] * training["batch_size"] / blocks_per_epoch, 2),
        "training_seconds": report["training_seconds"],
        "training_cpu_seconds": report["training_cpu_seconds"],
        "torch_threads": report["environment"]["torch_threads"],
        "held_out_perplexity": report["held_out_perplexity"],
        "unigram_perplexity": report["unigram_perplexity"],
        "held_out_bits_per_byte": report["held_out_bits_per_byte"],
    }
    variant = report["variant"]
    load = report["environment"]["load_average_1min"]
    # one line each: JSON string syntax shows the completions' line breaks as \n
    samples = "; ".join(
        f"`{s['prompt']}` -> `{json.dumps(s['completion'])[1:-1]}`" for s in report["samples"]
    )
    description = (
        f"transformers `LlamaForCausalLM` ({variant['num_layers']} layers, hidden "
        f"{variant['hidden_size']}, {variant['num_heads']} heads, SwiGLU "
        f"{variant['intermediate_size']}, context {variant['context']}), byte-level BPE of "
        f"{variant['vocab_size']} tokens, trained on {text['train_documents']} standard-library "
        f"docstrings (Python {text['python']}, {text['train_tokens']} tokens); held out: "
        f"{text['held_out_documents']} docstrings of {text['held_out_modules']} whole modules "
        f"({text['held_out_tokens']} tokens, {text['held_out_bytes_per_token']:.2f} bytes per "
        "token). Training seconds (wall) and CPU seconds (this process, all its threads) "
        "exclude the held-out evaluations; the 1-minute load average of the machine was "
        f"{load[0]:.1f} when training started and {load[1]:.1f} when it ended. Unigram: the "
        f"training tokens' frequencies (add-one). Greedy samples: {samples}"
    )
    return write_results(
        results_dir,
        f"decoder_{report['name']}",
        title=f"Embedded decoder {report['name']}: training time and held-out perplexity",
        description=description,
        rows=[row],
        columns=COLUMNS,
        extra={"history": report["history"], "samples": report["samples"], "report": report},
        command=command,
    )


def quick_micro_decoder(folder: Path) -> DecoderSource:
    """The ``llama_fedfm_micro`` decoder trained for 12 steps on ``importlib``'s docstrings
    into ``folder`` (seconds; the red-team suites' small arena), trained only if missing."""
    from dataclasses import replace

    from fedfm.data.stdlib_text import stdlib_root
    from fedfm.models.decoder import DecoderTraining

    source = DecoderSource(
        name="llama_fedfm_micro",
        cache_dir=folder,
        training=replace(
            DecoderTraining(),
            steps=12,
            batch_size=8,
            lr=1e-2,
            warmup_steps=2,
            eval_every=6,
            checkpoint_every=6,
        ),
        text_root=stdlib_root() / "importlib",
    )
    if not source.path.exists():
        train_decoder(source, progress=False, log=lambda _: None)
    return source
