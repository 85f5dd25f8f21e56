"""Cost of one encrypted block of the FHE-friendly MiniLM under CKKS, and a 6-block forward pass.

The text sibling of :mod:`fedfm.experiments.bench_ckks`, with the same columns: the data owner
embeds held-out docstrings of the text task (:func:`fedfm.distillation.text.task_splits`) with
the kept student's token embedding (:func:`~fedfm.distillation.text.kept_text_student`: the one
``fedfm paper-text`` adapts), encrypts the hidden states, and the server evaluates a block
(:mod:`fedfm.crypto.ckks_text`) with the texts' key mask in plaintext; every refresh is answered
in process by the data owner. The forward pass runs every block with the data owner decrypting
and re-encrypting between blocks (as the protocol does) and compares the head's predictions.

Sequence length: the student's configured 64 tokens (``max_tokens``), the length it was
distilled and adapted at. On the task's test split the median docstring has 35 tokens and a
third fill all 64, so a shorter evaluation would truncate the texts the accuracy table reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.approx.modules import clamped_count, reset_clamped
from fedfm.crypto import get_backend
from fedfm.crypto.backend import ModelGeometry, drive
from fedfm.crypto.ckks import CkksBackend
from fedfm.distillation.text import kept_text_student, task_splits
from fedfm.errors import ConfigError
from fedfm.experiments.bench_ckks import (
    BLOCK_COLUMNS,
    block_summary,
    flood_slot_std,
    measure_encrypted_block,
    median_run,
    repeats_sentence,
    setting_sentence,
    table_rows,
)
from fedfm.experiments.results import write_results
from fedfm.experiments.text_adaptation import student_run
from fedfm.models.fhe_text import FheTextClassifier, load_text_encoder

DEFAULT_BACKEND = "ckks-8192"


def text_geometry(model: FheTextClassifier) -> ModelGeometry:
    """The packing geometry of ``model``'s hidden states: its configured tokens per text."""
    return ModelGeometry(tokens=model.max_tokens, patch_size=1)


def padded(model: FheTextClassifier, input_ids: torch.Tensor) -> torch.Tensor:
    """``input_ids`` right-padded to the model's ``max_tokens`` (the encrypted layout's)."""
    width = input_ids.shape[1]
    if width > model.max_tokens:
        raise ConfigError(f"texts of {width} tokens exceed the model's {model.max_tokens}")
    pad = torch.full((len(input_ids), model.max_tokens - width), model.pad_token_id)
    return torch.cat([input_ids, pad.to(input_ids.dtype)], dim=1)


def measure_text_block(
    model: FheTextClassifier,
    backend: CkksBackend,
    input_ids: torch.Tensor,
    *,
    block: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One encrypted block on the texts ``input_ids`` (padded to ``max_tokens``); a result row
    with the columns of :data:`~fedfm.experiments.bench_ckks.BLOCK_COLUMNS`."""
    input_ids = padded(model, input_ids)
    key_mask = model.key_mask(input_ids)
    with torch.no_grad():
        hidden = model.embed(input_ids)
        for index in range(block):
            hidden = model.block(index, hidden, key_mask)
        reset_clamped(model)
        started = time.perf_counter()
        expected = model.block(block, hidden, key_mask)
        simulate_seconds = time.perf_counter() - started
        clamped = clamped_count(model)
    keys = key_mask.numpy()
    row = measure_encrypted_block(
        backend,
        text_geometry(model),
        hidden.numpy(),
        expected.numpy(),
        lambda evaluator, batch: evaluator.evaluate_text_block(model, block, batch, keys),
        simulate_seconds=simulate_seconds,
        reference_clamped=clamped,
        log=log,
    )
    row["real_tokens_per_text"] = float(keys.sum(axis=1).mean())
    return row


def measure_text_forward(
    model: FheTextClassifier,
    backend: CkksBackend,
    input_ids: torch.Tensor,
    *,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Every block under CKKS, the data owner decrypting and re-encrypting between blocks;
    per-block errors and the head's predictions (on the decrypted last block) against
    plaintext."""
    input_ids = padded(model, input_ids)
    key_mask = model.key_mask(input_ids)
    keys = key_mask.numpy()
    geometry = text_geometry(model)
    owner = backend.create_key_owner(geometry=geometry)
    evaluator = backend.create_evaluator(owner.public_context(), geometry)

    def refresh(items: list[Any]) -> list[Any]:
        return evaluator.refreshed(owner.refresh(evaluator.refresh_payload(items)))

    started = time.perf_counter()
    errors: list[float] = []
    with torch.no_grad():
        expected = model.embed(input_ids)
        batch = evaluator.load(owner.encrypt(expected.numpy()).to_payload())
        for index in range(model.num_blocks):
            expected = model.block(index, expected, key_mask)
            output = drive(evaluator.evaluate_text_block(model, index, batch, keys), refresh)
            hidden = owner.decrypt(evaluator.release(output))  # as the protocol sends it
            errors.append(float(np.abs(hidden - expected.numpy()).max() / expected.abs().max()))
            log(f"[fedfm] bench-ckks-text forward: block {index + 1} error/range {errors[-1]:.1e}")
            batch = evaluator.load(owner.encrypt(hidden).to_payload())
        seconds = time.perf_counter() - started
        encrypted = model.head(torch.from_numpy(hidden), key_mask).argmax(dim=1)
        plain = model.head(expected, key_mask).argmax(dim=1)
    return {
        "batch_size": len(input_ids),
        "seconds": seconds,
        "seconds_per_sample": seconds / len(input_ids),
        "block_error_over_range": errors,
        "predictions_agree": int((encrypted == plain).sum()),
        "samples": len(input_ids),
        "real_tokens_per_text": float(keys.sum(axis=1).mean()),
    }


def _result_name(model: str, backend_name: str) -> str:
    slug = "minilm" if model == "minilm" else Path(model).name.replace("/", "-").lower()
    return f"ckks_block_{slug}" + ("" if backend_name == DEFAULT_BACKEND else f"_{backend_name}")


def run_text_ckks_benchmark(
    *,
    model: str = "minilm",
    backend_name: str = DEFAULT_BACKEND,
    batch_sizes: Sequence[int] = (64,),
    block: int = 0,
    forward_batch: int = 8,
    repeats: int = 1,
    student_dir: Path = Path("runs/text"),
    results_dir: Path = Path("results"),
    log: Callable[[str], None] = print,
    command: str | None = None,
) -> list[dict[str, Any]]:
    """Measure one block of the kept text student per batch size (and, unless
    ``forward_batch`` is 0, a forward pass of every block); write
    ``results/ckks_block_<model>.{json,md}``."""
    backend = get_backend(backend_name)
    if not isinstance(backend, CkksBackend):
        raise ConfigError(f"bench-ckks-text measures a CKKS backend, not {backend_name!r}")
    if not batch_sizes or min(batch_sizes) < 1 or forward_batch < 0 or repeats < 1:
        raise ConfigError(
            f"batch sizes and repeats must be >= 1 and the forward batch >= 0, got "
            f"{list(batch_sizes)}, {repeats} and {forward_batch}"
        )
    run = student_run(model)  # the student `fedfm paper-text` adapts
    student, report = kept_text_student(run, student_dir, log=log)
    student.eval()
    if not 0 <= block < student.num_blocks:
        raise ConfigError(f"block must be in 1..{student.num_blocks}, got {block + 1}")
    _, tokenizer = load_text_encoder(model)
    test = task_splits(run, tokenizer).test
    if max(*batch_sizes, forward_batch) > len(test.input_ids):
        raise ConfigError(f"batch sizes up to {len(test.input_ids)} (the test split)")
    torch.set_num_threads(1)  # the plaintext reference on one core, like SEAL here
    rows = [
        median_run(
            partial(measure_text_block, student, backend, test.input_ids[:n], block=block, log=log),
            repeats,
        )
        for n in batch_sizes
    ]
    forward = (
        measure_text_forward(student, backend, test.input_ids[:forward_batch], log=log)
        if forward_batch
        else None
    )
    _, summary = block_summary(backend, rows, blocks=student.num_blocks, repeats=repeats)
    params = backend.params
    config = student.encoder.config
    geometry = text_geometry(student)
    write_results(
        results_dir,
        _result_name(model, backend_name),
        title="One encrypted block of the FHE-friendly MiniLM under CKKS (TenSEAL) vs simulate",
        description=(
            f"Block {block + 1} of the kept text student ({student.num_blocks} blocks, width "
            f"{config.hidden_size}, {config.num_attention_heads} heads, {geometry.tokens} "
            f"tokens per text, key mask for the padding; teacher {report['teacher_accuracy']:.3f}"
            f", student {report['student_accuracy']:.3f} accuracy on the task) on the "
            f"first held-out docstrings of the text task; {setting_sentence(backend_name, backend)}"
            ". "
            + repeats_sentence(repeats)
            + f"A forward pass is {student.num_blocks} such blocks"
            + (
                f"; measured on {forward['samples']} texts: {forward['predictions_agree']} head "
                "predictions agree with the plaintext model, per-block max error / range "
                + ", ".join(f"{e:.1e}" for e in forward["block_error_over_range"])
                + f" ({forward['seconds']:.0f} s)."
                if forward
                else "."
            )
        ),
        rows=table_rows(rows),
        columns=BLOCK_COLUMNS,
        extra={
            "backend": backend_name,
            "model": model,
            "block": block + 1,
            "tokens": geometry.tokens,
            "width": config.hidden_size,
            "heads": config.num_attention_heads,
            "student": {
                "teacher_accuracy": report["teacher_accuracy"],
                "student_accuracy": report["student_accuracy"],
            },
            **summary,
            "flood_slot_std": flood_slot_std(params),
            "forward_pass": forward,
        },
        command=command,
    )
    return rows
