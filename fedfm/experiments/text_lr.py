"""``fedfm paper-text --select-lr``: the learning rates of ours and linear probing on the text
task, chosen on the data owners' held-out pool texts, never on the test texts.

The paper's comparison is only as fair as each method's learning rate: a rate tuned for one
method, or chosen by looking at the test texts, decides the table before it runs. Here every
client holds out :data:`VALIDATION_FRACTION` of its own partition (a federated evaluation set:
what a deployment would set aside on each site), the method trains on the rest with the table's
schedule for every rate of the grid, on seeds apart from the table's, and the rate with the
highest mean balanced accuracy on the held-out pool texts wins (ties: the smaller rate).
``results/text_lr_selection[_<table>].{json,md}`` lists every rate; the table's ``lr`` entry in
``fedfm/experiments/paper.toml`` carries the choice (``tests/experiments/test_text_lr.py``
checks the two agree), and the table's cells record the rate they ran with.

Full fine-tuning is selected the same way, on its own (``methods=("full-finetune",)``): its
cells train the whole student (7 minutes each here with K = 5 on a quiet machine), so its grid
(:data:`FINETUNE_LR_GRID`, around the paper's ratio's 0.0025) is its own and its results go to
``results/text_lr_selection[_<table>]_full_finetune.{json,md}``.

Data owners that hide their texts' lengths (``hide_text_lengths=True``) train on block outputs
computed with all-real key masks, a different problem with its own best rates: selected so, the
choice goes to the table's ``lr_hidden_lengths`` entry and
``results/text_lr_selection[_<table>]_hidden_lengths.{json,md}``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.data.text_task import TextSplits
from fedfm.distillation.text import kept_student_path, kept_text_student
from fedfm.errors import ConfigError
from fedfm.experiments.paper import Setting, TableSpec, cell_file, kept_cell, write_atomically
from fedfm.experiments.results import write_results
from fedfm.experiments.text_adaptation import (
    STUDENT_WEIGHTS_KEY,
    TextFeatures,
    block_features,
    check_same_student,
    client_parts,
    distill_run,
    finetune_text,
    table_config,
    table_suffix,
    text_splits,
    train_adapter,
)

# Rates around the protocol's 0.05, a factor of about 2 apart.
LR_GRID: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2)
# Seeds apart from the tables' (0, 1, 2): other partitions and batch draws than the table's.
SELECTION_SEEDS: tuple[int, ...] = (100, 101)
VALIDATION_FRACTION = 0.2
SELECTABLE_METHODS: tuple[str, ...] = ("linear-probe", "ours")
# Full fine-tuning's rates: from the paper's ratio's 0.0025 up, a factor of 4 apart (SGD with
# momentum on a whole encoder wants far smaller steps than a fresh adapter).
FINETUNE_LR_GRID: tuple[float, ...] = (0.0025, 0.01, 0.04)
FULL_FINETUNE = ("full-finetune",)
HELD_OUT = "held-out pool"  # what the cells' progress lines evaluate on


def default_grid(methods: Sequence[str]) -> tuple[float, ...]:
    """The rates a selection of ``methods`` tries unless told otherwise."""
    return FINETUNE_LR_GRID if tuple(methods) == FULL_FINETUNE else LR_GRID


def validation_split(
    parts: Sequence[np.ndarray], fraction: float, seed: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """Each client's partition split into the texts it trains on and the ``fraction`` it holds
    out (rounded; a client too small to hold one out keeps all); returns the training parts
    and every client's held-out texts together (federated evaluation sums them)."""
    if not 0 < fraction < 1:
        raise ConfigError(f"validation fraction must be in (0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    training, held_out = [], []
    for part in parts:
        shuffled = rng.permutation(part)
        count = round(fraction * len(part))
        held_out.append(shuffled[:count])
        training.append(np.sort(shuffled[count:]))
    validation = np.sort(np.concatenate(held_out)) if held_out else np.array([], dtype=int)
    if len(validation) == 0:
        raise ConfigError("no client holds out a text: the federation's pool is too small")
    return training, validation


def selection_results_name(
    spec: TableSpec,
    methods: Sequence[str] = SELECTABLE_METHODS,
    *,
    hide_text_lengths: bool = False,
) -> str:
    """``text_lr_selection`` for the config's ``text`` table, ``text_lr_selection_<table>``
    for another (its name without a ``text_`` prefix); ``_full_finetune`` after it for full
    fine-tuning's own selection, ``_hidden_lengths`` for data owners that hide lengths."""
    name = "text_lr_selection" + table_suffix(spec)
    if hide_text_lengths:
        name += "_hidden_lengths"
    return name + ("_full_finetune" if tuple(methods) == FULL_FINETUNE else "")


def choose_rates(
    scores: dict[str, dict[float, list[float]]],
) -> dict[str, float]:
    """Per method, the rate with the highest mean score (ties: the smaller rate)."""
    chosen = {}
    for method, by_rate in scores.items():
        ranked = sorted(by_rate, key=lambda rate: (-statistics.fmean(by_rate[rate]), rate))
        chosen[method] = ranked[0]
    return chosen


def select_text_lr(
    spec: TableSpec,
    *,
    student_dir: Path,
    workdir: Path,
    results_dir: Path,
    model: str = "minilm",
    grid: Sequence[float] | None = None,
    seeds: Sequence[int] = SELECTION_SEEDS,
    methods: Sequence[str] = SELECTABLE_METHODS,
    fraction: float = VALIDATION_FRACTION,
    hide_text_lengths: bool = False,
    command: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Every (method, rate, setting, seed) of the grid on held-out pool texts (finished ones
    read back from ``<workdir>/<table>-lr-selection[-hidden-lengths]``), then
    ``results/<selection_results_name>.{json,md}``; returns the chosen rate per method.

    ``grid`` defaults to :func:`default_grid`; full fine-tuning is selected on its own.
    ``hide_text_lengths=True`` selects for data owners that hide their texts' lengths (block
    outputs with all-real key masks; the table's ``lr_hidden_lengths`` entry)."""
    methods = tuple(dict.fromkeys(methods))  # a method named twice runs once
    if not methods:
        raise ConfigError(
            f"learning-rate selection needs a method of {list(SELECTABLE_METHODS)} or "
            f"{list(FULL_FINETUNE)}"
        )
    unknown = sorted(set(methods) - set(SELECTABLE_METHODS) - set(FULL_FINETUNE))
    if unknown:
        raise ConfigError(
            f"learning-rate selection runs {list(SELECTABLE_METHODS)} or "
            f"{list(FULL_FINETUNE)}, not {unknown}"
        )
    if set(FULL_FINETUNE) & set(methods) and tuple(methods) != FULL_FINETUNE:
        raise ConfigError(
            "select full fine-tuning's rate on its own (--methods full-finetune): its cells "
            f"train the whole student (minutes each) on its own grid {list(FINETUNE_LR_GRID)}, "
            f"not with {sorted(set(methods) - set(FULL_FINETUNE))}"
        )
    if hide_text_lengths and set(FULL_FINETUNE) & set(methods):
        raise ConfigError(
            "hidden text lengths apply to ours and linear probing (the data owners' key masks "
            "towards the server); full fine-tuning has no server to hide them from"
        )
    grid = default_grid(methods) if grid is None else grid
    if not grid or any(not rate > 0 for rate in grid):
        raise ConfigError(f"the learning-rate grid needs rates > 0, got {list(grid)}")
    if not seeds:
        raise ConfigError("learning-rate selection needs at least one seed")
    folder = workdir / (
        f"{spec.name}-lr-selection" + ("-hidden-lengths" if hide_text_lengths else "")
    )
    folder.mkdir(parents=True, exist_ok=True)
    plan = [
        (method, rate, setting, seed)
        for setting in spec.settings
        for method in methods
        for rate in grid
        for seed in seeds
    ]
    quiet: Callable[[str], None] = log if progress else (lambda _line: None)
    finetuning = tuple(methods) == FULL_FINETUNE
    loaded: dict[str, tuple[Any, TextSplits, TextFeatures | None, int]] = {}
    cells: list[dict[str, Any]] = []
    to_run: list[tuple[str, float, Setting, int, str]] = []
    for number, (method, rate, setting, seed) in enumerate(plan, start=1):
        cell_spec = replace(spec, lr={method: rate})
        path = cell_file(folder, f"{method}-lr{rate:g}", setting, seed)
        where = (
            f"[fedfm] lr cell {number}/{len(plan)}: {method}, lr {rate:g}, {setting.label}, "
            f"seed {seed}"
        )
        student_file = kept_student_path(distill_run(setting, model), student_dir).name
        kept = kept_cell(path, cell_spec, setting)
        if (
            kept is not None
            and kept.get("student") == student_file
            and kept.get("validation_fraction") == fraction
            and kept.get("hide_text_lengths", False) == hide_text_lengths
        ):
            cells.append(kept)
            log(f"{where}: done before, read from {path}")
        else:
            to_run.append((method, rate, setting, seed, where))
    # every student first, so finished cells of another student stop the run before it starts
    digests: dict[str, str] = {}
    for source in sorted({setting.distill_data for _, _, setting, _, _ in to_run}):
        run = distill_run(next(s for _, _, s, _, _ in to_run if s.distill_data == source), model)
        student, report = kept_text_student(run, student_dir, progress=progress, log=log)
        digests[source] = report["weights_digest"]
        check_same_student(
            [cell for cell in cells if cell["setting"]["distill_data"] == source],
            digests[source],
            folder,
        )
        splits = text_splits(run)
        started = time.perf_counter()
        # full fine-tuning trains the blocks themselves: no frozen block outputs to cache
        features = (
            None
            if finetuning
            else block_features(student, splits.pool, hide_text_lengths=hide_text_lengths)
        )
        loaded[source] = (student, splits, features, len(splits.classes))
        if features is not None:
            log(
                f"[fedfm] the student's block outputs on {len(splits.pool)} pool texts "
                f"({time.perf_counter() - started:.0f} s; the test texts are not read)"
            )
    for method, rate, setting, seed, where in to_run:
        cell_spec = replace(spec, lr={method: rate})
        path = cell_file(folder, f"{method}-lr{rate:g}", setting, seed)
        source = setting.distill_data
        student, splits, pool, num_classes = loaded[source]
        training, validation = validation_split(
            client_parts(splits.pool, setting, seed), fraction, seed
        )
        log(f"{where} ...")
        started = time.perf_counter()
        config = table_config(cell_spec, setting, method)
        if pool is None:  # full fine-tuning, as the table's cells run it
            result = finetune_text(
                student,
                splits.pool,
                splits.pool.subset(validation),
                training,
                config,
                seed=seed,
                lr=rate,
                max_grad_norm=cell_spec.max_grad_norm_of(method),
                log=quiet,
                evaluated_on=HELD_OUT,
            )
        else:
            result = train_adapter(
                pool,
                pool.subset(validation),
                training,
                config,
                num_classes=num_classes,
                seed=seed,
                log=quiet,
                evaluated_on=HELD_OUT,
            )
        record: dict[str, Any] = {
            "method": method,
            "setting": asdict(setting),
            "seed": seed,
            "rounds": spec.rounds,
            "lr_decay": spec.lr_decay,
            "lr": rate,
            "max_grad_norm": cell_spec.max_grad_norm_of(method),
            "validation_fraction": fraction,
            "hide_text_lengths": hide_text_lengths,
            "training_texts": int(sum(len(part) for part in training)),
            "validation_texts": len(validation),
            "validation_balanced_accuracy": result["test_balanced_accuracy"],
            "validation_balanced_accuracy_per_round": result["test_balanced_accuracy_per_round"],
            "train_loss_per_round": result["train_loss_per_round"],
            **{
                k: result[k]
                for k in ("diverged_at_round", "steps", "clipped_steps", "gradient_norm")
                if k in result
            },
            "student": kept_student_path(distill_run(setting, model), student_dir).name,
            STUDENT_WEIGHTS_KEY: digests[source],
            "seconds": time.perf_counter() - started,
        }
        write_atomically(path, record)
        cells.append(record)
        log(f"{where}: validation balanced accuracy {record['validation_balanced_accuracy']:.4f}")
    scores: dict[str, dict[float, list[float]]] = {}
    for cell in cells:
        by_rate = scores.setdefault(cell["method"], {})
        by_rate.setdefault(cell["lr"], []).append(cell["validation_balanced_accuracy"])
    chosen = choose_rates(scores)
    rows = []
    for method in methods:
        for rate in grid:
            values = scores[method][rate]
            mean = statistics.fmean(values)
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            losses = [
                c["train_loss_per_round"] for c in cells if (c["method"], c["lr"]) == (method, rate)
            ]
            rows.append(
                {
                    "method": method,
                    "lr": rate,
                    "validation_balanced_accuracy": f"{100 * mean:.2f} ± {100 * std:.2f}",
                    "validation_balanced_accuracy_mean": mean,
                    "validation_balanced_accuracy_std": std,
                    "cells": len(values),
                    "final_train_loss_mean": statistics.fmean(
                        # a diverged cell's NaN loss is kept in its file as null
                        math.nan if loss[-1] is None else loss[-1]
                        for loss in losses
                    ),
                    "chosen": "yes" if chosen[method] == rate else "",
                }
            )
    name = selection_results_name(spec, methods, hide_text_lengths=hide_text_lengths)
    # the table's whole entry: the rates chosen here over what it sets for the other methods
    key, entry = (
        ("lr_hidden_lengths", {**spec.lr_hidden_lengths, **chosen})
        if hide_text_lengths
        else ("lr", {**spec.lr, **chosen})
    )
    toml_line = f"{key} = {{ " + ", ".join(f'"{m}" = {r:g}' for m, r in entry.items()) + " }"
    trained = (
        f"Plaintext FedAvg of the whole {model} student with a fresh head (full fine-tuning), "
        "as `fedfm paper-text` trains it"
        + (
            f", each step's gradient clipped to total norm {clip:g}"
            if (clip := spec.max_grad_norm_of("full-finetune")) is not None
            else ", its gradient not clipped"
        )
        if finetuning
        else f"The protocol's client rule on the frozen {model} student's block outputs in "
        "plaintext, as `fedfm paper-text` trains"
        + (
            ", every data owner hiding its texts' lengths (all-real key masks, as "
            "`fedfm paper-text --hide-text-lengths` trains)"
            if hide_text_lengths
            else ""
        )
    )
    write_results(
        results_dir,
        name,
        title=f"Learning rates for {spec.title.split(':')[0]}: chosen on held-out pool texts",
        description=(
            f"Balanced accuracy (%) on the texts each client holds out of its own partition "
            f"({fraction:.0%}; never the test texts) after {spec.rounds} rounds of the table's "
            f"schedule on the rest, mean ± std over settings {[s.label for s in spec.settings]} "
            f"and seeds {list(seeds)} (apart from the table's {list(spec.seeds)}). {trained}. "
            f"Chosen: the highest mean (ties: the smaller rate); the table's config entry: "
            f"`{toml_line}`."
            + (
                ""
                if finetuning
                else " Full fine-tuning is selected on its own (`--methods full-finetune`)."
            )
        ),
        rows=rows,
        columns=[
            ("method", "method"),
            ("lr", "lr"),
            ("validation_balanced_accuracy", "held-out pool bal. acc. (%)"),
            ("cells", "cells"),
            ("final_train_loss_mean", "final train loss"),
            ("chosen", "chosen"),
        ],
        extra={
            "backend": "plaintext (torch; the protocol's training rule, no encryption)"
            if not finetuning
            else "plaintext (torch; FedAvg of the whole student, no encryption)",
            "chosen": chosen,
            "config_entry": toml_line,
            "grid": list(grid),
            "seeds": list(seeds),
            "validation_fraction": fraction,
            "hide_text_lengths": hide_text_lengths,
            "table": spec.name,
            "settings": [asdict(s) for s in spec.settings],
            "rounds": spec.rounds,
            "lr_decay": spec.lr_decay,
            "cells": cells,
        },
        command=command,
    )
    table = spec.hiding_lengths() if hide_text_lengths else spec
    log(
        f"[fedfm] chosen: {toml_line} (results/{name}.md); the table {spec.name!r} sets "
        + ", ".join(f"{m} {table.lr_of(m):g}" for m in methods)
    )
    return chosen
