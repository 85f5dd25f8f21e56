"""The paper's tables (spec ``001`` §4, App. D, F): methods x federations x seeds, and costs.

Tables 1-3 are data (``fedfm/experiments/paper.toml``): the methods
(:data:`fedfm.experiments.baselines.METHODS`), the federations (clients, partition, Dirichlet
alpha, batch size, and which student: distilled on ``D_aux`` or on out-of-distribution photo crops),
the seeds, the rounds and the learning-rate schedule; Table 2 also draws Figure 3
(:func:`plot_figure3`). Table 4 (:func:`run_efficiency_table`) times one training step per method.
:func:`run_table` runs every *cell* (one method on one federation with one seed) through
:func:`fedfm.experiments.baselines.run_adaptation`, keeps each finished cell as a JSON file in the
work folder (a re-run skips those: an interrupted table resumes cell by cell), then writes
``results/paper_<table>.{json,md}`` with the mean and standard deviation over the seeds.

**Metric.** Balanced accuracy (the paper's) on the held-out *test set* (359 digits by default),
computed after the last round in plaintext with the final global model: for ours and linear
probing the student's blocks on the test images and the aggregated side adapter and head (what
the server holds after secure aggregation), for full fine-tuning the averaged model. The
protocol's own per-round metric (over the clients' held-out data, evaluated under encryption)
needs each client to hold a batch of held-out samples, which many-client federations on a small
pool do not; the test set is the same for every cell.

The centralized setting is one client holding the whole pool, with secure aggregation off (it
needs two clients at least). A client with fewer training samples than a batch sits out training,
as in the protocol; each cell records how many clients trained per round.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedfm.data import DataSplits, ImageDataset
from fedfm.errors import ConfigError
from fedfm.experiments.baselines import (
    DEFAULT_FINETUNE_LR,
    FineTuneConfig,
    check_method,
    finetune_model,
    run_adaptation,
    run_full_finetune,
)
from fedfm.experiments.results import json_safe, write_results
from fedfm.experiments.sweep import median_latency, saved_tensor_bytes
from fedfm.models.device import reset_peak_memory, resolve_device, to_numpy
from fedfm.models.fhe_vit import FheViT
from fedfm.protocols.double_blind.adapter import SideAdapterHead
from fedfm.protocols.double_blind.config import (
    DEFAULT_MIN_BATCH_SIZE,
    DoubleBlindConfig,
    revealed_blocks,
)
from fedfm.protocols.double_blind.driver import load_state
from fedfm.protocols.double_blind.runner import Federation, server_model_on
from fedfm.protocols.double_blind.server import balanced_accuracy

METHODS_IN_TABLE_ORDER = ("linear-probe", "full-finetune", "ours")  # the paper's row order
# Packaged with the library (importlib.resources), so a non-editable install finds it too.
DEFAULT_CONFIG = "paper.toml"
# The paper's adapters tap every block's output; fedfm's default reveals only the last (see
# docs/double_blind.md, "Tap sets"): the tables reproduce the paper's setting.
PAPER_REVEAL = "all"


@dataclass(frozen=True)
class Setting:
    """One federation of a table: ``clients`` clients, ``partition`` ``iid`` or ``dirichlet``,
    samples per batch (and per permutation) ``batch_size``."""

    label: str
    clients: int
    partition: str
    alpha: float = 1.0
    batch_size: int = 16  # the paper's Table 3 uses 8 (below App. C's minimum of 16)
    distill_data: str = (
        "aux"  # the student distilled on this (fedfm.distillation.pipeline.DISTILL_DATA)
    )

    def federation(self, seed: int) -> Federation:
        return Federation(
            num_clients=self.clients, scheme=self.partition, alpha=self.alpha, seed=seed
        )


@dataclass(frozen=True)
class TableSpec:
    """One table: every method on every setting with every seed."""

    name: str
    title: str
    methods: tuple[str, ...]
    settings: tuple[Setting, ...]
    seeds: tuple[int, ...]
    rounds: int
    lr_decay: bool
    figure_setting: str = ""  # draw Figure 3 for this setting ("": no figure)
    # learning rate per method where the table sets one (else :func:`default_lr`)
    lr: Mapping[str, float] = field(default_factory=dict, hash=False)  # a dict: not hashable
    # the rates of data owners that hide their texts' lengths, where the table sets them
    # (config key ``lr_hidden_lengths``; chosen with all-real key masks)
    lr_hidden_lengths: Mapping[str, float] = field(default_factory=dict, hash=False)
    # full fine-tuning's gradients clipped to this total norm before each step, where the table
    # sets one (config key ``finetune_max_grad_norm``; the adapters never clip)
    finetune_max_grad_norm: float | None = None

    def lr_of(self, method: str) -> float:
        """The learning rate ``method``'s cells train with."""
        return self.lr.get(method, default_lr(method))

    def max_grad_norm_of(self, method: str) -> float | None:
        """The total gradient norm ``method``'s steps are clipped to (``None``: not clipped)."""
        return self.finetune_max_grad_norm if method == "full-finetune" else None

    def hiding_lengths(self) -> TableSpec:
        """This table as data owners that hide their texts' lengths run it: its
        ``lr_hidden_lengths`` over its ``lr``."""
        return replace(self, lr={**self.lr, **self.lr_hidden_lengths}, lr_hidden_lengths={})


def default_lr(method: str) -> float:
    """A method's learning rate when its table sets none: the protocol's for ours and linear
    probing, :data:`DEFAULT_FINETUNE_LR` for full fine-tuning."""
    return DEFAULT_FINETUNE_LR if method == "full-finetune" else DoubleBlindConfig().lr


def load_table(
    name: str,
    path: Path | None = None,
    *,
    seeds: Sequence[int] | None = None,
    rounds: int | None = None,
) -> TableSpec:
    """Table ``name`` of the TOML file ``path`` (default :data:`DEFAULT_CONFIG`; its
    ``[defaults]`` fill what a table omits)."""
    source = resources.files("fedfm.experiments") / DEFAULT_CONFIG if path is None else path
    try:
        data = tomllib.loads(source.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no experiment config at {source}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{source} is not valid TOML: {error}") from None
    tables = {key: value for key, value in data.items() if key != "defaults"}
    if name not in tables:
        raise ConfigError(f"{source} has no table {name!r}; it has {sorted(tables)}")
    values = {**data.get("defaults", {}), **tables[name]}
    try:
        settings = tuple(Setting(**entry) for entry in values["settings"])
        spec = TableSpec(
            name=name,
            title=str(values["title"]),
            methods=tuple(values["methods"]),
            settings=settings,
            seeds=tuple(int(s) for s in (seeds if seeds is not None else values["seeds"])),
            rounds=int(rounds if rounds is not None else values["rounds"]),
            lr_decay=bool(values["lr_decay"]),
            figure_setting=str(values.get("figure3", "")),
            lr={str(method): float(rate) for method, rate in values.get("lr", {}).items()},
            lr_hidden_lengths={
                str(method): float(rate)
                for method, rate in values.get("lr_hidden_lengths", {}).items()
            },
            finetune_max_grad_norm=(
                float(values["finetune_max_grad_norm"])
                if "finetune_max_grad_norm" in values
                else None
            ),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ConfigError(f"table {name!r} in {source}: missing or bad key ({error})") from None
    for method in spec.methods:
        check_method(method)
    for method, rate in [*spec.lr.items(), *spec.lr_hidden_lengths.items()]:
        check_method(method)
        if not rate > 0:
            raise ConfigError(f"table {name!r}: the learning rate of {method} must be > 0: {rate}")
    if spec.finetune_max_grad_norm is not None and not spec.finetune_max_grad_norm > 0:
        raise ConfigError(
            f"table {name!r}: finetune_max_grad_norm must be > 0 (omit it to not clip): "
            f"{spec.finetune_max_grad_norm}"
        )
    if "full-finetune" in spec.lr_hidden_lengths:
        raise ConfigError(
            f"table {name!r}: lr_hidden_lengths sets full-finetune, which has no server to hide "
            "lengths from (it applies to ours and linear probing)"
        )
    if spec.figure_setting and spec.figure_setting not in {s.label for s in settings}:
        raise ConfigError(
            f"table {name!r}: figure3 names no setting of the table: {spec.figure_setting!r}"
        )
    if not spec.seeds or spec.rounds < 1:
        raise ConfigError(f"table {name!r} needs at least one seed and one round")
    return spec


def cell_file(workdir: Path, method: str, setting: Setting, seed: int) -> Path:
    """Where a finished cell is kept."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", setting.label).strip("-")
    return workdir / f"{method}__{slug}__seed{seed}.json"


def _block_outputs(student: FheViT, images: torch.Tensor, blocks: list[int]) -> list[torch.Tensor]:
    outputs, hidden = [], student.embed(images)
    for index in range(student.num_blocks):
        hidden = student.block(index, hidden)
        if index + 1 in blocks:
            outputs.append(hidden)
    return outputs


def prediction_balanced_accuracy(
    labels: np.ndarray, predictions: np.ndarray, classes: int
) -> float:
    """The paper's metric (mean per-class recall) of ``predictions`` against ``labels``."""
    confusion = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(confusion, (labels, predictions), 1)
    return balanced_accuracy(confusion)


def adapter_test_accuracy(
    student: FheViT,
    arrays: dict[str, np.ndarray],
    config: DoubleBlindConfig,
    test: ImageDataset,
) -> float:
    """Balanced accuracy of the student with the global side adapter and head ``arrays``."""
    blocks = revealed_blocks(config.reveal, student.num_blocks)
    adapter = SideAdapterHead(
        num_blocks=len(blocks),
        dim=student.vit.embed_dim,
        num_classes=test.num_classes,
        rank=config.rank,
        alpha=config.alpha,
    )
    adapter.set_arrays(arrays)
    device = next(student.parameters()).device  # the adapter runs beside the student
    adapter.to(device)
    with torch.no_grad():
        outputs = _block_outputs(student, test.images.to(device), blocks)
        order = torch.arange(len(test.images), device=device)  # no permutation: in place
        logits = adapter(outputs, order, order.repeat(len(blocks), 1))
    return prediction_balanced_accuracy(
        test.labels.numpy(), to_numpy(logits.argmax(1)), test.num_classes
    )


def run_cell(
    method: str,
    setting: Setting,
    seed: int,
    spec: TableSpec,
    student: FheViT,
    splits: DataSplits,
    scratch: Path,
    *,
    log: Callable[[str], None],
    device: torch.device | None = None,
) -> dict[str, Any]:
    """One method on one federation with one seed; the record kept in the cell's file.
    Plaintext torch runs on ``device`` (default: the CPU)."""
    device = device if device is not None else torch.device("cpu")
    config = DoubleBlindConfig(
        rounds=spec.rounds,
        batch_size=setting.batch_size,
        min_batch_size=min(setting.batch_size, DEFAULT_MIN_BATCH_SIZE),
        # full fine-tuning's rate is FineTuneConfig's (it reads no adapter rate)
        lr=spec.lr_of("ours" if method == "full-finetune" else method),
        lr_decay=spec.lr_decay,
        secure_aggregation=setting.clients >= 2,
        reveal=PAPER_REVEAL,
    )
    federation = setting.federation(seed)
    started = time.perf_counter()
    if method == "full-finetune":
        history, model = run_full_finetune(
            student,
            splits,
            config,
            federation,
            finetune=FineTuneConfig(lr=spec.lr_of(method)),
            seed=seed,
            log=log,
            device=device,
        )
        with torch.no_grad():
            model = model.eval().to(device)
            predictions = to_numpy(model(splits.test.images.to(device)).argmax(1))
        test_accuracy = prediction_balanced_accuracy(
            splits.test.labels.numpy(), predictions, splits.test.num_classes
        )
        parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    else:
        result = run_adaptation(
            method,
            student,
            splits,
            config,
            federation,
            seed=seed,
            checkpoint_dir=scratch,
            log=log,
            device=device,
        )
        history, parameters = result.history, result.trainable_parameters
        if method == "linear-probe":
            config = replace(config, rank=0)
        identity = {"config": config.to_config(), "federation": asdict(federation)}
        state = load_state(scratch, identity)
        if state is None:
            raise ConfigError(f"the run of {method} left no final state in {scratch}")
        with server_model_on(student, "simulate", device):
            test_accuracy = adapter_test_accuracy(student, state.global_arrays, config, splits.test)
    return {
        "method": method,
        "setting": asdict(setting),
        "seed": seed,
        "rounds": spec.rounds,
        "lr_decay": spec.lr_decay,
        "lr": spec.lr_of(method),
        "test_balanced_accuracy": test_accuracy,
        "trainable_parameters": parameters,
        "clients_trained": [record.clients_trained for record in history],
        "clients_evaluated": [record.clients_evaluated for record in history],
        "held_out_balanced_accuracy": [record.balanced_accuracy for record in history],
        "seconds": time.perf_counter() - started,
    }


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(spec: TableSpec, cells: dict[tuple[str, str, int], dict[str, Any]]) -> list[dict]:
    """One row per method and setting: mean and standard deviation over the seeds."""
    rows = []
    for method in spec.methods:
        for setting in spec.settings:
            done = [cells[(method, setting.label, s)] for s in spec.seeds]
            mean, std = _mean_std([c["test_balanced_accuracy"] for c in done])
            trained = [n for c in done for n in c["clients_trained"]]
            rows.append(
                {
                    "method": method,
                    "setting": setting.label,
                    "clients": setting.clients,
                    "alpha": setting.alpha if setting.partition == "dirichlet" else None,
                    "seeds": len(done),
                    "balanced_accuracy_mean": mean,
                    "balanced_accuracy_std": std,
                    "balanced_accuracy": f"{100 * mean:.2f} ± {100 * std:.2f}",
                    "trainable_parameters": done[0]["trainable_parameters"],
                    "clients_trained_per_round": statistics.fmean(trained),
                }
            )
    return rows


def write_atomically(path: Path, payload: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False))
    os.replace(temporary, path)


def kept_cell(path: Path, spec: TableSpec, setting: Setting) -> dict[str, Any] | None:
    """The finished cell at ``path`` if it was run with these settings (else it runs again)."""
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    method = str(record.get("method"))
    # cells written before tables set learning rates ran with the method's default
    same = (
        record.get("setting"),
        record.get("rounds"),
        record.get("lr_decay"),
        record.get("lr", default_lr(method)),
        record.get("max_grad_norm"),
    ) == (
        asdict(setting),
        spec.rounds,
        spec.lr_decay,
        spec.lr_of(method),
        spec.max_grad_norm_of(method),
    )
    return record if same else None


def run_table(
    spec: TableSpec,
    students: Mapping[str, FheViT],
    splits: DataSplits,
    *,
    workdir: Path,
    results_dir: Path,
    command: str | None = None,
    log: Callable[[str], None] = print,
    device: str | torch.device | None = "auto",
) -> list[dict[str, Any]]:
    """Every cell of ``spec`` (finished ones read back from ``workdir``); the summary rows.

    ``students`` maps each setting's ``distill_data`` to the student distilled on it; plaintext
    torch runs on ``device`` (the results record it, with peak accelerator memory on a GPU).
    """
    if spec.finetune_max_grad_norm is not None:
        raise ConfigError(
            f"table {spec.name!r} sets finetune_max_grad_norm, which only the text tables' full "
            "fine-tuning applies (fedfm paper-text); the ViT tables' full fine-tuning does not "
            "clip: remove the key"
        )
    target = resolve_device(device)
    reset_peak_memory(target)
    missing = sorted({s.distill_data for s in spec.settings} - set(students))
    if missing:
        raise ConfigError(f"table {spec.name!r} needs students distilled on {missing}")
    folder = workdir / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    plan = [(m, s, seed) for s in spec.settings for m in spec.methods for seed in spec.seeds]
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    for number, (method, setting, seed) in enumerate(plan, start=1):
        path = cell_file(folder, method, setting, seed)
        where = (
            f"[fedfm] {spec.name} cell {number}/{len(plan)}: {method}, {setting.label}, seed {seed}"
        )
        kept = kept_cell(path, spec, setting)
        if kept is not None:
            cells[(method, setting.label, seed)] = kept
            log(f"{where}: done before, read from {path}")
            continue
        scratch = folder / "scratch"
        shutil.rmtree(scratch, ignore_errors=True)  # an interrupted cell starts over
        record = run_cell(
            method,
            setting,
            seed,
            spec,
            students[setting.distill_data],
            splits,
            scratch,
            log=lambda _line: None,
            device=target,
        )
        write_atomically(path, record)
        cells[(method, setting.label, seed)] = record
        log(
            f"{where}: test balanced accuracy {record['test_balanced_accuracy']:.4f} "
            f"({record['seconds']:.0f} s)"
        )
    rows = summarize(spec, cells)
    write_results(
        results_dir,
        f"paper_{spec.name}",
        title=spec.title,
        description=(
            f"Balanced accuracy (%) on the {len(splits.test.images)}-image test set after "
            f"{spec.rounds} rounds, mean ± std over seeds {list(spec.seeds)}; learning-rate "
            f"decay x0.1 at 50% and 80% of the rounds: {spec.lr_decay}; backend simulate for "
            "ours and linear probing (same polynomials and messages as CKKS, no encryption); "
            "full fine-tuning is plaintext FedAvg of the whole model. Clients trained per round: "
            "mean over rounds and seeds (a client needs one batch of training samples; batch "
            f"sizes {sorted({s.batch_size for s in spec.settings})})."
        ),
        rows=rows,
        columns=[
            ("method", "method"),
            ("setting", "setting"),
            ("balanced_accuracy", "bal. acc. (%)"),
            ("trainable_parameters", "trainable params"),
            ("clients_trained_per_round", "clients trained / round"),
        ],
        extra={"cells": list(cells.values()), "spec": asdict(spec)},
        command=command,
        device=target,
    )
    if spec.figure_setting:
        path = plot_figure3(spec, rows, list(cells.values()), spec.figure_setting, results_dir)
        log(f"[fedfm] wrote {path} (Figure 3, setting {spec.figure_setting})")
    return rows


def plot_figure3(
    spec: TableSpec,
    rows: list[dict[str, Any]],
    cells: list[dict[str, Any]],
    setting: str,
    results_dir: Path,
) -> Path:
    """Figure 3 from a finished table: accuracy against trainable parameters (log x) and the
    per-round balanced accuracy on the clients' held-out data, both for the setting ``setting``;
    written as ``results/paper_figure3.png``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    chosen = [row for row in rows if row["setting"] == setting]
    if not chosen:
        raise ConfigError(f"table {spec.name!r} has no setting {setting!r}")
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for row in chosen:
        left.errorbar(
            row["trainable_parameters"],
            100 * row["balanced_accuracy_mean"],
            yerr=100 * row["balanced_accuracy_std"],
            fmt="o",
            capsize=4,
            label=row["method"],
        )
        curves = [
            c["held_out_balanced_accuracy"]
            for c in cells
            if c["method"] == row["method"] and c["setting"]["label"] == setting
        ]
        mean = 100 * np.nanmean(np.asarray(curves, dtype=float), axis=0)
        right.plot(range(1, len(mean) + 1), mean, label=row["method"])
    left.set_xscale("log")
    left.set_xlabel("trainable parameters")
    left.set_ylabel("test balanced accuracy (%)")
    left.set_title(f"accuracy vs trainable parameters ({setting})")
    right.set_xlabel("round")
    right.set_ylabel("held-out balanced accuracy (%)")
    right.set_title(f"accuracy per round, mean of {len(spec.seeds)} seeds")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / "paper_figure3.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _training_step(
    method: str, student: FheViT, images: torch.Tensor, labels: torch.Tensor, classes: int
) -> tuple[Callable[[], None], int]:
    """One client training step of ``method`` on a batch (forward and backward), and the
    method's trainable parameters. Ours and linear probing run the student's blocks without
    gradients (the server's encrypted part) and train the side adapter and head on their outputs."""
    device = images.device  # the student is there too
    if method == "full-finetune":
        model = finetune_model(student, classes, seed=0).train().to(device)
        parameters = [p for p in model.parameters() if p.requires_grad]

        def finetune_step() -> None:
            F.cross_entropy(model(images), labels).backward()
            model.zero_grad(set_to_none=True)

        return finetune_step, sum(p.numel() for p in parameters)
    config = (
        replace(DoubleBlindConfig(reveal=PAPER_REVEAL), rank=0)
        if method == "linear-probe"
        else DoubleBlindConfig(reveal=PAPER_REVEAL)
    )
    blocks = revealed_blocks(config.reveal, student.num_blocks)
    adapter = SideAdapterHead(
        num_blocks=len(blocks),
        dim=student.vit.embed_dim,
        num_classes=classes,
        rank=config.rank,
        alpha=config.alpha,
    ).to(device)
    order = torch.arange(len(images), device=device)

    def adapter_step() -> None:
        with torch.no_grad():
            outputs = _block_outputs(student, images, blocks)
        logits = adapter(outputs, order, order.repeat(len(blocks), 1))
        F.cross_entropy(logits, labels).backward()
        adapter.zero_grad(set_to_none=True)

    return adapter_step, sum(p.numel() for p in adapter.parameters())


def run_efficiency_table(
    student: FheViT,
    splits: DataSplits,
    *,
    methods: Sequence[str] = METHODS_IN_TABLE_ORDER,
    batch_size: int = 16,
    repeats: int = 20,
    results_dir: Path,
    command: str | None = None,
    device: str | torch.device | None = "auto",
) -> list[dict[str, Any]]:
    """Table 4 (App. F): trainable parameters, latency per sample of a training step (forward
    and backward), and the activation memory autograd keeps for that step, per method; ratios
    to linear probing measured in the same run. The steps run on ``device``."""
    target = resolve_device(device)
    reset_peak_memory(target)
    images = splits.pool.images[:batch_size].to(target)
    labels = splits.pool.labels[:batch_size].long().to(target)
    rows: list[dict[str, Any]] = []
    with torch.random.fork_rng(), server_model_on(student, "simulate", target):
        torch.manual_seed(0)
        for method in methods:
            step, parameters = _training_step(
                method, student, images, labels, splits.pool.num_classes
            )
            seconds = median_latency(step, repeats=repeats, device=target)
            rows.append(
                {
                    "method": method,
                    "trainable_parameters": parameters,
                    "ms_per_sample": 1000 * seconds / batch_size,
                    "activation_mib": saved_tensor_bytes(step) / 2**20,
                }
            )
    base = next((r for r in rows if r["method"] == "linear-probe"), rows[0])
    for row in rows:
        row["parameters_x"] = row["trainable_parameters"] / base["trainable_parameters"]
        row["latency_x"] = row["ms_per_sample"] / base["ms_per_sample"]
        row["activation_x"] = row["activation_mib"] / base["activation_mib"]
    write_results(
        results_dir,
        "paper_table4",
        title="Table 4: trainable parameters, latency and memory per method",
        description=(
            f"One client training step on a batch of {batch_size} pool images at "
            f"{tuple(images.shape[1:])} with the distilled student ({student.num_blocks} blocks, "
            f"width {student.vit.embed_dim}), plaintext torch on "
            + (
                f"CPU with {torch.get_num_threads()} thread(s)"
                if target.type == "cpu"
                else f"{target} ({torch.cuda.get_device_name(target)})"
            )
            + f": latency is the median of {repeats} steps "
            "(forward and backward) divided by the batch; ours and linear probing run the "
            "student's blocks without gradients, as the server does under encryption, and train "
            "the adapter and head. Memory: the bytes autograd keeps for the step's backward "
            "pass (deterministic; the paper reports GPU memory of a whole run). Ratios are to "
            "linear probing in the same run."
        ),
        rows=rows,
        columns=[
            ("method", "method"),
            ("trainable_parameters", "trainable params"),
            ("parameters_x", "x LP"),
            ("ms_per_sample", "ms / sample"),
            ("latency_x", "x LP"),
            ("activation_mib", "activation memory (MiB)"),
            ("activation_x", "x LP"),
        ],
        command=command,
        device=target,
    )
    return rows
