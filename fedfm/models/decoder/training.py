"""Training the embedded decoder: tokenizer, packed blocks, AdamW, resumable, then the report.

:func:`train_decoder` is what ``fedfm train-llm`` runs. It is resumable: the tokenizer is saved
once trained, and the model, optimiser, schedule and step every ``checkpoint_every`` steps (and
at each evaluation), so an interrupted run loses at most that many steps and the same command
continues it; the batch order is a function of the seed, the epoch and the step, so a resumed
run computes the same weights as an uninterrupted one. ``restart=True`` discards both the saved
state and a finished decoder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from fedfm.errors import CheckpointError, ConfigError
from fedfm.models.checkpoints import load_state_strict, read_checkpoint, save_checkpoint
from fedfm.models.decoder.artefact import (
    REPORT_FILE,
    DecoderSource,
    quiet_transformers,
    read_report,
)
from fedfm.models.decoder.config import DECODER_FORMAT, STATE_FORMAT, DecoderTraining
from fedfm.models.decoder.model import (
    build_decoder,
    describe,
    document_ids,
    greedy_generate,
    mean_loss,
    token_blocks,
    unigram_perplexity,
)
from fedfm.models.decoder.tokenizer import train_bpe
from fedfm.models.device import device_report, reset_peak_memory

SAMPLE_PROMPTS = ("Return the", "This module provides", "Raise ValueError if")
SAMPLE_TOKENS = 24
STATE_FILE = "state.pt"
# Evaluations during training read the first blocks of the held-out text only (a sixth of it
# by default); the report's final perplexity reads all of it.
PROGRESS_EVAL_BLOCKS = 96
TOKENIZER_FOLDER = "tokenizer"


def _schedule(training: DecoderTraining) -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine decay to ``min_lr_ratio`` (factor of ``lr`` per step)."""

    def factor(step: int) -> float:
        if step < training.warmup_steps:
            return (step + 1) / training.warmup_steps
        progress = (step - training.warmup_steps) / max(1, training.steps - training.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return training.min_lr_ratio + (1 - training.min_lr_ratio) * cosine

    return factor


def _optimizer(model: torch.nn.Module, training: DecoderTraining) -> torch.optim.AdamW:
    # Weight decay on matrices only (embeddings and projections), not on the RMSNorm gains.
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    gains = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": training.weight_decay},
            {"params": gains, "weight_decay": 0.0},
        ],
        lr=training.lr,
        betas=(0.9, 0.95),
    )


def batch_indices(step: int, *, blocks: int, training: DecoderTraining) -> tuple[int, np.ndarray]:
    """The epoch of ``step`` and the blocks of its batch: a seeded permutation per epoch (a
    function of the step alone, so a resumed run draws the same batches)."""
    per_epoch = blocks // training.batch_size
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([training.seed, epoch]).permutation(blocks)
    return epoch, order[index * training.batch_size : (index + 1) * training.batch_size]


def _tokenizer(
    source: DecoderSource, texts: list[str], log: Callable[[str], None]
) -> PreTrainedTokenizerFast:
    folder = source.work_path / TOKENIZER_FOLDER
    if (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    variant = source.variant
    started = time.perf_counter()
    tokenizer = train_bpe(texts, vocab_size=variant.vocab_size, context=variant.context)
    tokenizer.save_pretrained(str(folder))
    log(
        f"[fedfm] decoder: byte-level BPE of {len(tokenizer)} tokens trained on {len(texts)} "
        f"documents in {time.perf_counter() - started:.1f} s"
    )
    return tokenizer


def _digest(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def train_decoder(
    source: DecoderSource,
    *,
    restart: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    on_step: Callable[[int], None] | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Train (or resume training) the embedded decoder of ``source`` and cache it; return its
    report (also ``report.json`` in the folder). A finished decoder is not retrained: its report
    is returned, unless ``restart``.

    ``on_step(step)`` is called after each optimiser step (1-based), after any checkpoint of that
    step: tests interrupt training from it. The model trains on ``device`` (default: the CPU;
    not part of the cache key) and is saved from the CPU.

    Raises
    ------
    ConfigError
        If the text gives fewer blocks than one batch.
    CheckpointError
        If a saved state belongs to other settings or is unreadable.
    """
    training, variant = source.training, source.variant
    if restart:
        for folder in (source.path, source.work_path):
            if folder.exists():
                shutil.rmtree(folder)
                log(f"[fedfm] decoder: discarded {folder}")
    if source.path.exists():
        log(f"[fedfm] decoder: cached at {source.path}")
        return read_report(source.path)

    split = source.documents()
    train_texts = [document.text for document in split.train]
    held_texts = [document.text for document in split.held_out]
    source.work_path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(source, train_texts, log)
    train_blocks = token_blocks(document_ids(tokenizer, train_texts), variant.context)
    held_blocks = token_blocks(document_ids(tokenizer, held_texts), variant.context)
    if len(train_blocks) < training.batch_size:
        raise ConfigError(
            f"the training text gives {len(train_blocks)} blocks of {variant.context} tokens, "
            f"fewer than one batch of {training.batch_size}"
        )
    per_epoch = len(train_blocks) // training.batch_size
    log(
        f"[fedfm] decoder {source.name}: {len(split.train)} training documents "
        f"({train_blocks.numel()} tokens, {len(train_blocks)} blocks of {variant.context}, "
        f"{per_epoch} steps per epoch), {len(split.held_out)} held-out documents "
        f"({held_blocks.numel()} tokens) from {len(split.held_out_modules())} held-out modules"
    )

    # transformers initialises weights from torch's global generator: seed it inside a fork so
    # the caller's generator is left as it was
    with torch.random.fork_rng():
        torch.manual_seed(training.seed)
        model = build_decoder(variant, attn_implementation="sdpa")  # fastest on CPU; same maths
    device = device if device is not None else torch.device("cpu")
    model.to(device)  # type: ignore[arg-type]  # transformers wraps to() for dtype checks
    reset_peak_memory(device)
    optimizer = _optimizer(model, training)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(training))
    identity = source.identity()
    state_path = source.work_path / STATE_FILE
    step, elapsed, cpu, history = 0, 0.0, 0.0, []
    if state_path.exists():
        state = read_checkpoint(state_path, expected_format=STATE_FORMAT)
        if state.get("identity") != json.loads(json.dumps(identity)):
            raise CheckpointError(
                f"{state_path} belongs to a decoder with other settings; pass --restart to "
                "discard it"
            )
        load_state_strict(model, state["model"], source=f"decoder state {state_path}")
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, elapsed, cpu = state["step"], state["elapsed"], state["cpu"]
        history = list(state["history"])
        log(f"[fedfm] decoder: resuming from {state_path} after step {step}/{training.steps}")
    else:
        log(f"[fedfm] decoder: training {training.steps} steps (cached to {source.path})")

    def checkpoint() -> None:
        save_checkpoint(
            state_path,
            {
                "format": STATE_FORMAT,
                "identity": identity,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "step": step,
                "elapsed": elapsed,
                "cpu": cpu,
                "history": history,
            },
        )

    bar = tqdm(
        total=training.steps, initial=step, desc=f"decoder {source.name}", unit="step",
        disable=not progress,
    )  # fmt: skip
    running, seen = 0.0, 0
    load_before = os.getloadavg()[0]
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        while step < training.steps:
            epoch, index = batch_indices(step, blocks=len(train_blocks), training=training)
            batch = train_blocks[torch.from_numpy(index)].to(device)
            model.train()
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.clip_norm)
            optimizer.step()
            schedule.step()
            step += 1
            running, seen = running + loss.item(), seen + 1
            bar.update(1)
            bar.set_postfix(loss=f"{running / seen:.3f}", epoch=epoch + 1)
            now, cpu_now = time.perf_counter(), time.process_time()
            elapsed, started = elapsed + now - started, now
            cpu, cpu_started = cpu + cpu_now - cpu_started, cpu_now
            if step % training.eval_every == 0 or step == training.steps:
                held_loss = mean_loss(model, held_blocks[:PROGRESS_EVAL_BLOCKS])
                history.append(
                    {
                        "step": step,
                        "epoch": round(step / per_epoch, 3),
                        "train_loss": running / seen,
                        "held_out_loss_first_blocks": held_loss,
                        "held_out_perplexity_first_blocks": math.exp(held_loss),
                        "seconds": round(elapsed, 2),
                        "cpu_seconds": round(cpu, 2),
                    }
                )
                log(
                    f"[fedfm] decoder step {step}/{training.steps} "
                    f"(epoch {step / per_epoch:.2f}): train loss {running / seen:.3f}, "
                    f"held-out perplexity {math.exp(held_loss):.2f} (first blocks), "
                    f"{elapsed:.0f} s"
                )
                running, seen = 0.0, 0
                # evaluation time is not training time
                started, cpu_started = time.perf_counter(), time.process_time()
            if step % training.checkpoint_every == 0 or step % training.eval_every == 0:
                checkpoint()
            if on_step is not None:
                on_step(step)
    finally:
        bar.close()

    model.eval()
    held_loss = mean_loss(model, held_blocks)
    held_bytes = sum(len(text.encode()) for text in held_texts)
    held_tokens = sum(len(ids) for ids in document_ids(tokenizer, held_texts))
    samples = []
    for prompt in SAMPLE_PROMPTS:
        room = variant.context - len(tokenizer(prompt)["input_ids"])
        continuation = greedy_generate(
            model, tokenizer, prompt, max_new_tokens=min(SAMPLE_TOKENS, room)
        )
        completion = tokenizer.decode(continuation, skip_special_tokens=True)
        samples.append({"prompt": prompt, "completion": completion})
    report: dict[str, Any] = {
        "format": DECODER_FORMAT,
        "name": source.name,
        "command": source.train_command(),
        "model": describe(model),
        "variant": asdict(variant),
        "training": asdict(training),
        "text": {
            **source.text_identity(),
            "train_documents": len(split.train),
            "held_out_documents": len(split.held_out),
            "held_out_modules": len(split.held_out_modules()),
            "train_tokens": int(train_blocks.numel()),
            "held_out_tokens": int(held_blocks.numel()),
            "train_sha256": _digest(train_texts),
            "held_out_sha256": _digest(held_texts),
            "held_out_bytes_per_token": held_bytes / held_tokens,
        },
        "held_out_loss": held_loss,
        "held_out_perplexity": math.exp(held_loss),
        # nats per token -> bits per UTF-8 byte, comparable across tokenizers (<s>, </s> counted
        # as tokens, not bytes)
        "held_out_bits_per_byte": held_loss / math.log(2) * held_tokens / held_bytes,
        "unigram_perplexity": unigram_perplexity(train_blocks, held_blocks, variant.vocab_size),
        "history": history,
        "samples": samples,
        # wall time of the training steps (not the evaluations) and the CPU time of this process
        # in them (all its threads): on a shared machine, CPU time is the work, wall time is
        # what other processes left of it (the load averages say how busy it was)
        "training_seconds": elapsed,
        "training_cpu_seconds": cpu,
        "environment": {
            "load_average_1min": [load_before, os.getloadavg()[0]],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(),
            **device_report(device),
        },
    }
    model.cpu()  # the cached decoder loads anywhere
    saving = source.path.with_name(source.path.name + ".saving")
    if saving.exists():
        shutil.rmtree(saving)
    with quiet_transformers():
        model.save_pretrained(str(saving))
        tokenizer.save_pretrained(str(saving))
    (saving / REPORT_FILE).write_text(json.dumps(report, indent=2, allow_nan=False))
    saving.replace(source.path)
    shutil.rmtree(source.work_path)
    log(
        f"[fedfm] decoder: held-out perplexity {report['held_out_perplexity']:.2f} "
        f"(unigram baseline {report['unigram_perplexity']:.2f}) after {elapsed:.0f} s of "
        f"training; cached at {source.path}"
    )
    return report
