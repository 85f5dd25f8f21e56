"""``fedfm paper-text``: the paper's comparison (spec ``001`` Tables 2-3) on a real pretrained
text encoder: linear probing, ours and full fine-tuning of the FHE-friendly MiniLM on the
docstring task (:mod:`fedfm.data.text_task`), which MiniLM never saw.

The student is the model owner's: the packaged MiniLM with a logistic-regression head fitted on
``D_aux`` (the teacher), made FHE-friendly and distilled on unlabelled standard-library
docstrings (:func:`fedfm.distillation.text.kept_text_student`, distilled once and kept). The data
owners' pool (:data:`TEXT_SPLIT`: 100 texts per family, 700) is split across K clients with
flwr-datasets' partitioners (:func:`fedfm.data.partition.partition`); the metric is balanced
accuracy on the 420 held-out test texts after every round (the global model, plaintext).

Methods, each on the same clients, the same seeded batch draws and the same schedule
(``rounds``, learning-rate decay, batches of ``batch_size``, ``batches_per_round`` per client):

``ours``
    Rank-8 parallel side adapters on every block's output and a head on the mean over real
    tokens, trained with the double-blind protocol's client rule (one SGD step with momentum per
    round on the mean loss of the round's batches, momentum kept by the client, lr 0.05) and
    aggregated as secure aggregation does (the sample-weighted mean of the updates).
``linear_probe``
    The same with rank 0: the head alone on the last block's pooled output.
``full_finetune``
    Plaintext FedAvg of the whole student and a fresh head, one SGD step with momentum per batch
    at the table's rate (default 0.0025, the paper's ratio to the adapters' rate, as
    :mod:`.baselines`; chosen like the others' by :mod:`.text_lr`).

**What runs.** By default ``ours`` and ``linear_probe`` train on the frozen student's block
outputs computed in plaintext: the same numbers the protocol's ``simulate`` backend hands the
client (its permutations only reorder rows, and its update is the plaintext SGD step, as
``test_text_update_equals_plaintext_sgd_step`` checks). No encryption, no messages; the results
say so. ``protocol=True`` runs them through the double-blind protocol itself
(:func:`protocol_adapter`).

**Hidden text lengths.** ``hide_text_lengths=True`` measures what a data owner's node config
``hide-text-lengths`` costs: every data owner uploads all-real key masks, so the blocks attend to
padding as to text and the head pools over every position (:func:`block_features` computes the
block outputs so; through the protocol, every data owner's policy says so). Full fine-tuning is
the data owners' own plaintext training, with no server to hide lengths from: it is refused there.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedfm.data.partition import partition
from fedfm.data.text_task import TextSplits, TokenizedTexts
from fedfm.distillation.text import (
    TEXT_SPLIT,
    TextDistillRun,
    kept_student_path,
    kept_text_student,
    student_run,
    task_splits,
)
from fedfm.errors import ConfigError
from fedfm.experiments.baselines import (
    DEFAULT_FINETUNE_LR,
    trainable_parameters,
    weighted_average,
)
from fedfm.experiments.paper import (
    Setting,
    TableSpec,
    cell_file,
    kept_cell,
    prediction_balanced_accuracy,
    write_atomically,
)
from fedfm.experiments.results import write_results
from fedfm.models.fhe_text import FheTextClassifier, load_text_encoder
from fedfm.protocols.double_blind.adapter import SideAdapterHead
from fedfm.protocols.double_blind.config import DoubleBlindConfig

# The methods' keys in results/text_adaptation.json, in the paper's row order.
TEXT_METHODS: dict[str, str] = {
    "linear-probe": "linear_probe",
    "full-finetune": "full_finetune",
    "ours": "ours",
}
BATCHES_PER_ROUND = 4
ENCODE_CHUNK = 64
# How a table's learning rates are chosen (fedfm.experiments.text_lr), named in its results.
LR_SELECTION_COMMAND = "fedfm paper-text --select-lr"
# A cell's record names the weights of the student it adapted (``weights_digest``).
STUDENT_WEIGHTS_KEY = "student_weights"


@dataclass(frozen=True)
class TextFeatures:
    """The frozen student's block outputs on some texts: ``blocks`` ``(N, L, T, D)``, the key
    mask ``(N, T)`` and the labels ``(N,)``."""

    blocks: torch.Tensor
    key_mask: torch.Tensor
    labels: torch.Tensor

    def rows(self, index: np.ndarray) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        selector = torch.from_numpy(index)
        chosen = self.blocks[selector]
        return list(chosen.unbind(1)), self.key_mask[selector], self.labels[selector]

    def subset(self, index: np.ndarray) -> TextFeatures:
        """The texts at ``index`` only."""
        selector = torch.from_numpy(index)
        return TextFeatures(self.blocks[selector], self.key_mask[selector], self.labels[selector])


def uploaded_key_mask(
    student: FheTextClassifier, input_ids: torch.Tensor, *, hide_text_lengths: bool = False
) -> torch.Tensor:
    """The key mask a data owner uploads for ``input_ids``: the texts' own (``True`` at real
    tokens), or all real when it hides its texts' lengths (node config ``hide-text-lengths``)."""
    key_mask = student.key_mask(input_ids)
    return torch.ones_like(key_mask) if hide_text_lengths else key_mask


@torch.no_grad()
def block_features(
    student: FheTextClassifier, texts: TokenizedTexts, *, hide_text_lengths: bool = False
) -> TextFeatures:
    """Every block's output of the frozen ``student`` on ``texts`` (what the server's blocks
    compute for a data owner; padding positions hold values no pooled output reads), with the
    key mask the data owner uploads (:func:`uploaded_key_mask`: with ``hide_text_lengths`` the
    blocks attend to padding and the head pools over every position)."""
    student.eval()
    outputs = []
    for chunk in texts.input_ids.split(ENCODE_CHUNK):
        key_mask = uploaded_key_mask(student, chunk, hide_text_lengths=hide_text_lengths)
        hidden = student.embed(chunk)
        per_block = []
        for index in range(student.num_blocks):
            hidden = student.block(index, hidden, key_mask)
            per_block.append(hidden)
        outputs.append(torch.stack(per_block, dim=1))
    key_mask = uploaded_key_mask(student, texts.input_ids, hide_text_lengths=hide_text_lengths)
    return TextFeatures(torch.cat(outputs), key_mask, texts.labels.clone())


@dataclass
class _History:
    """A cell's per-round test balanced accuracy, training loss and clients trained."""

    evaluated_on: str = "test"  # what the progress lines call the evaluation texts
    accuracy: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)

    def add(self, accuracy: float, loss: float, trained: int) -> None:
        self.accuracy.append(accuracy)
        self.loss.append(loss)
        self.trained.append(trained)

    def line(self, server_round: int, rounds: int) -> str:
        return (
            f"[fedfm]   round {server_round}/{rounds}: train loss {self.loss[-1]:.4f}, "
            f"{self.evaluated_on} balanced accuracy {self.accuracy[-1]:.4f}"
        )

    def record(self, model: nn.Module) -> dict[str, Any]:
        return {
            "test_balanced_accuracy": self.accuracy[-1],
            "test_balanced_accuracy_per_round": self.accuracy,
            "train_loss_per_round": self.loss,
            "clients_trained": self.trained,
            "trainable_parameters": trainable_parameters(model),
        }


def round_draws(
    rng: np.random.Generator, parts: Sequence[np.ndarray], batch_size: int, batches: int
) -> list[tuple[int, list[np.ndarray]]]:
    """One round's batches per client (pool indices, drawn without replacement as the
    protocol's server draws); clients with fewer texts than a batch sit out."""
    draws = []
    for client, part in enumerate(parts):
        if len(part) < batch_size:
            continue
        count = min(batches, len(part) // batch_size)
        chosen = part[rng.choice(len(part), size=count * batch_size, replace=False)]
        draws.append((client, np.split(chosen, count)))
    return draws


def _momentum_step(
    parameters: list[nn.Parameter], velocities: list[torch.Tensor], lr: float, momentum: float
) -> None:
    with torch.no_grad():
        for parameter, velocity in zip(parameters, velocities, strict=True):
            if parameter.grad is None:
                continue
            velocity.mul_(momentum).add_(parameter.grad)
            parameter.sub_(lr * velocity)


def train_adapter(
    pool: TextFeatures,
    test: TextFeatures,
    parts: Sequence[np.ndarray],
    config: DoubleBlindConfig,
    *,
    num_classes: int,
    seed: int,
    log: Callable[[str], None],
    evaluated_on: str = "test",
) -> dict[str, Any]:
    """``ours`` (``config.rank`` > 0) or linear probing (rank 0) with the protocol's client rule;
    the per-round balanced accuracy on ``test`` (progress lines call it ``evaluated_on``) and
    the final one."""
    num_blocks, dim = pool.blocks.shape[1], pool.blocks.shape[3]
    torch.manual_seed(seed)
    model = SideAdapterHead(
        num_blocks=num_blocks if config.rank else 1,
        dim=dim,
        num_classes=num_classes,
        rank=config.rank,
        alpha=config.alpha,
        pooling="mean",
    )
    taps = list(range(num_blocks)) if config.rank else [num_blocks - 1]
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    velocities: dict[int, list[torch.Tensor]] = {}
    rng = np.random.default_rng(seed)
    history = _History(evaluated_on)

    def logits_of(features: TextFeatures, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, key_mask, labels = features.rows(index)
        order = torch.arange(len(index))
        taken = [blocks[t] for t in taps]
        return model(taken, order, order.repeat(len(taken), 1), key_mask), labels

    for server_round in range(1, config.rounds + 1):
        states, weights, round_losses = [], [], []
        for client, batches in round_draws(rng, parts, config.batch_size, config.batches_per_round):
            model.load_state_dict(global_state)
            model.zero_grad()
            loss = torch.stack(
                [F.cross_entropy(*logits_of(pool, batch)) for batch in batches]
            ).mean()
            loss.backward()
            params = list(model.parameters())
            buffers = velocities.setdefault(client, [torch.zeros_like(p) for p in params])
            _momentum_step(
                params, buffers, config.lr * config.lr_factor(server_round), config.momentum
            )
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            weights.append(sum(len(b) for b in batches))
            round_losses.append(float(loss.detach()))
        if not states:
            raise ConfigError(f"no client holds {config.batch_size} texts (one batch)")
        global_state = weighted_average(states, weights)
        model.load_state_dict(global_state)
        with torch.no_grad():
            logits, labels = logits_of(test, np.arange(len(test.labels)))
        history.add(
            prediction_balanced_accuracy(labels.numpy(), logits.argmax(1).numpy(), num_classes),
            float(np.average(round_losses, weights=weights)),
            len(states),
        )
        log(history.line(server_round, config.rounds))
    return history.record(model)


def protocol_adapter(
    student: FheTextClassifier,
    splits: TextSplits,
    parts: Sequence[np.ndarray],
    config: DoubleBlindConfig,
    *,
    seed: int,
    log: Callable[[str], None],
    hide_text_lengths: bool = False,
) -> dict[str, Any]:
    """``ours`` or linear probing through the double-blind protocol itself: every client a
    :class:`~fedfm.protocols.double_blind.runner.run_clients_in_process` data owner (messages,
    permutations, the ``simulate`` backend, secure aggregation), the server's draws from a
    research stream of ``seed``.

    Each client holds its partition of the pool for training and an equal share of the test
    texts as its held-out set, so the protocol's own evaluation (the clients' confusion matrices
    summed) is the global model on the whole test split, as :func:`train_adapter` measures it.
    Ours reveals every block's output (its adapters tap all six), linear probing only the last.
    ``hide_text_lengths``: every data owner's policy uploads all-real key masks.
    """
    from fedfm.crypto.randomness import ResearchStream
    from fedfm.protocols.double_blind.policy import DataOwnerPolicy
    from fedfm.protocols.double_blind.runner import run_clients_in_process
    from fedfm.protocols.double_blind.text import TextClientData

    config = replace(config, backend="simulate", reveal="all" if config.rank else "last")
    holders = [part for part in parts if len(part)]
    shares = np.array_split(np.random.default_rng(seed).permutation(len(splits.test)), len(holders))
    pad = student.pad_token_id

    def texts(
        source: TokenizedTexts, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = source.input_ids.numpy()[rows]
        return ids, ids != pad, source.labels.numpy()[rows]

    datasets = []
    for part, share in zip(holders, shares, strict=True):
        train_ids, train_mask, train_labels = texts(splits.pool, part)
        test_ids, test_mask, test_labels = texts(splits.test, share)
        datasets.append(
            TextClientData(
                train_ids,
                train_mask,
                train_labels,
                test_ids,
                test_mask,
                test_labels,
                num_classes=len(splits.classes),
            )
        )
    records, _ = run_clients_in_process(
        student,
        datasets,
        config,
        num_classes=len(splits.classes),
        identity={"config": config.to_config(), "seed": seed},
        # the experimenter plays every data owner: plaintext (simulate) by its own choice
        policy=DataOwnerPolicy(allow_plaintext=True, hide_text_lengths=hide_text_lengths),
        randomness=ResearchStream(seed),
        log=log,
        device="cpu",
    )
    history = _History()
    for record in records:
        history.add(record.balanced_accuracy, record.train_loss, record.clients_trained)
    adapter = SideAdapterHead(
        num_blocks=student.num_blocks if config.rank else 1,
        dim=student.hidden_size,
        num_classes=len(splits.classes),
        rank=config.rank,
        alpha=config.alpha,
        pooling="mean",
    )
    return {
        **history.record(adapter),
        "runner": "protocol",
        "backend": config.backend,
        "secure_aggregation": config.secure_aggregation,
        "reveal": config.reveal,
        "hide_text_lengths": hide_text_lengths,
        "failures": [failure for record in records for failure in record.failures],
    }


def _by_length(
    batches: list[np.ndarray], lengths: np.ndarray, order: np.random.Generator
) -> list[np.ndarray]:
    """The round's drawn texts regrouped into batches of the same sizes by token count, the
    batches in a random order (length bucketing: a batch is computed at its longest text's
    length; the round's texts and number of steps are the same)."""
    chosen = np.concatenate(batches)
    ordered = chosen[np.argsort(lengths[chosen], kind="stable")]
    grouped = np.split(ordered, np.cumsum([len(b) for b in batches])[:-1])
    return [grouped[i] for i in order.permutation(len(grouped))]


@torch.no_grad()
def _predict(model: FheTextClassifier, texts: TokenizedTexts) -> np.ndarray:
    """Predicted classes, computed in chunks of texts of similar length (the model trims the
    all-padding columns of a chunk; padding never changes a text's output)."""
    model.eval()
    order = torch.argsort(model.key_mask(texts.input_ids).sum(dim=1))
    predicted = torch.empty(len(order), dtype=torch.long)
    for chunk in order.split(ENCODE_CHUNK):
        predicted[chunk] = model(model.trimmed(texts.input_ids[chunk])).argmax(1)
    return predicted.numpy()


def finetune_text(
    student: FheTextClassifier,
    pool: TokenizedTexts,
    test: TokenizedTexts,
    parts: Sequence[np.ndarray],
    config: DoubleBlindConfig,
    *,
    seed: int,
    lr: float = DEFAULT_FINETUNE_LR,
    momentum: float = 0.9,
    max_grad_norm: float | None = None,
    log: Callable[[str], None],
    evaluated_on: str = "test",
) -> dict[str, Any]:
    """Plaintext FedAvg of a copy of ``student`` with a fresh (seeded) head: one SGD step with
    momentum per batch, on the texts :func:`train_adapter` draws for the same seed (each client's
    round regrouped by length, :func:`_by_length`).

    ``max_grad_norm``: each batch's gradient is clipped to this total norm before its step (the
    record's ``clipped_steps`` counts the steps it changed); ``None`` does not clip."""
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ConfigError(f"max_grad_norm must be > 0 (None: not clipped), not {max_grad_norm}")
    model = copy.deepcopy(student)
    torch.manual_seed(seed)
    model.classifier = nn.Linear(student.hidden_size, pool.num_classes)
    lengths = model.key_mask(pool.input_ids).sum(dim=1).numpy()
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    velocities: dict[int, list[torch.Tensor]] = {}
    rng = np.random.default_rng(seed)
    history = _History(evaluated_on)
    trained_names = [name for name, _ in model.named_parameters()]
    norms: list[float] = []  # every step's gradient norm, before clipping
    clipped = 0
    for server_round in range(1, config.rounds + 1):
        states, weights, round_losses = [], [], []
        for client, batches in round_draws(rng, parts, config.batch_size, config.batches_per_round):
            model.load_state_dict(global_state)
            model.train()
            params = [p for p in model.parameters() if p.requires_grad]
            buffers = velocities.setdefault(client, [torch.zeros_like(p) for p in params])
            # the batch order from its own stream: the draws stay those of the other methods
            shuffle = np.random.default_rng((seed, server_round, client))
            for batch in _by_length(batches, lengths, shuffle):
                selector = torch.from_numpy(batch)
                input_ids = model.trimmed(pool.input_ids[selector])
                loss = F.cross_entropy(model(input_ids), pool.labels[selector])
                model.zero_grad()
                loss.backward()
                # the norm before clipping (an infinite bound scales by exactly 1: no clipping)
                norm = float(nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf))
                norms.append(norm)
                clipped += int(max_grad_norm is not None and norm > max_grad_norm)
                _momentum_step(params, buffers, lr * config.lr_factor(server_round), momentum)
                round_losses.append(float(loss.detach()))
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            weights.append(sum(len(b) for b in batches))
        if not states:
            raise ConfigError(f"no client holds {config.batch_size} texts (one batch)")
        global_state = weighted_average(states, weights)
        model.load_state_dict(global_state)
        history.add(
            prediction_balanced_accuracy(
                test.labels.numpy(), _predict(model, test), test.num_classes
            ),
            float(np.mean(round_losses)),
            len(states),
        )
        log(history.line(server_round, config.rounds))
        # the weights only: a buffer may hold NaN by design (an approximation not calibrated)
        if not all(torch.isfinite(global_state[name]).all() for name in trained_names):
            # NaN or inf weights never train back: the later rounds are not run (None in the
            # per-round lists), and the cell's accuracy is the diverged model's
            log(
                f"[fedfm]   diverged in round {server_round}: the aggregated weights are not "
                f"finite; rounds {server_round + 1}-{config.rounds} are not run"
            )
            return _stopped({**history.record(model), **_step_norms(norms, clipped)}, config.rounds)
    return {**history.record(model), **_step_norms(norms, clipped)}


def _step_norms(norms: list[float], clipped: int) -> dict[str, Any]:
    """What a cell records of its steps' gradient norms (before clipping)."""
    finite = [n for n in norms if math.isfinite(n)]
    return {
        "steps": len(norms),
        "clipped_steps": clipped,
        "gradient_norm": {
            "median": statistics.median(finite) if finite else None,
            "p90": float(np.quantile(finite, 0.9)) if finite else None,
            "max": max(finite) if finite else None,
            "not_finite_steps": len(norms) - len(finite),
        },
    }


def _stopped(record: dict[str, Any], rounds: int) -> dict[str, Any]:
    """A cell ``record`` that diverged and stopped: its per-round accuracy and loss padded with
    ``None`` to ``rounds`` (curves stay aligned by round); ``clients_trained`` lists the rounds
    that ran."""
    ran = len(record["train_loss_per_round"])
    missing = [None] * (rounds - ran)
    return {
        **record,
        "test_balanced_accuracy_per_round": record["test_balanced_accuracy_per_round"] + missing,
        "train_loss_per_round": record["train_loss_per_round"] + missing,
        "diverged_at_round": ran,
    }


def distill_run(setting: Setting, model: str = "minilm") -> TextDistillRun:
    """The student a setting adapts: :data:`TEXT_SPLIT`, distilled on ``setting.distill_data``."""
    return student_run(model, setting.distill_data)


def text_splits(run: TextDistillRun) -> TextSplits:
    """The tokenized task the student of ``run`` was distilled beside (same split and seed)."""
    _, tokenizer = load_text_encoder(run.model)
    return task_splits(run, tokenizer)


def table_config(spec: TableSpec, setting: Setting, method: str) -> DoubleBlindConfig:
    """The protocol's settings of one cell (linear probing: rank 0)."""
    config = DoubleBlindConfig(
        rounds=spec.rounds,
        batch_size=setting.batch_size,
        batches_per_round=BATCHES_PER_ROUND,
        # full fine-tuning's rate is passed to finetune_text (it reads no adapter rate)
        lr=spec.lr_of("ours" if method == "full-finetune" else method),
        lr_decay=spec.lr_decay,
    )
    return replace(config, rank=0) if method == "linear-probe" else config


def client_parts(pool: TokenizedTexts, setting: Setting, seed: int) -> list[np.ndarray]:
    """The pool's indices per client of ``setting`` for ``seed`` (flwr-datasets' partitioners)."""
    return partition(
        pool,
        num_partitions=setting.clients,
        scheme=setting.partition,
        alpha=setting.alpha,
        seed=seed,
    )


def run_text_cell(
    method: str,
    setting: Setting,
    seed: int,
    spec: TableSpec,
    student: FheTextClassifier,
    splits: TextSplits,
    features: tuple[TextFeatures, TextFeatures] | None,
    *,
    log: Callable[[str], None],
    protocol: bool = False,
    hide_text_lengths: bool = False,
) -> dict[str, Any]:
    """One method on one federation with one seed; the record kept in the cell's file.

    ``protocol``: ours and linear probing run the double-blind protocol
    (:func:`protocol_adapter`) instead of its client rule on cached block outputs (which
    ``features`` holds, computed with the masks ``hide_text_lengths`` says)."""
    if hide_text_lengths and method == "full-finetune":
        raise ConfigError(
            "hide-text-lengths is a data owner's choice towards the model owner's server; "
            "full fine-tuning has no server evaluating blocks: run it without hidden lengths"
        )
    started = time.perf_counter()
    parts = client_parts(splits.pool, setting, seed)
    config = table_config(spec, setting, method)
    if method == "full-finetune":
        result = finetune_text(
            student,
            splits.pool,
            splits.test,
            parts,
            config,
            seed=seed,
            lr=spec.lr_of(method),
            max_grad_norm=spec.max_grad_norm_of(method),
            log=log,
        )
    elif protocol:
        result = protocol_adapter(
            student,
            splits,
            parts,
            config,
            seed=seed,
            log=log,
            hide_text_lengths=hide_text_lengths,
        )
    else:
        if features is None:
            raise ConfigError(f"{method} needs the student's block outputs")
        pool, test = features
        result = train_adapter(
            pool, test, parts, config, num_classes=len(splits.classes), seed=seed, log=log
        )
    return {
        "method": method,
        "setting": asdict(setting),
        "seed": seed,
        "rounds": spec.rounds,
        "lr_decay": spec.lr_decay,
        "lr": spec.lr_of(method),
        "max_grad_norm": spec.max_grad_norm_of(method),
        "partition_sizes": [len(part) for part in parts],
        "hide_text_lengths": hide_text_lengths,
        **result,
        "seconds": time.perf_counter() - started,
    }


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize_text(
    spec: TableSpec, cells: dict[tuple[str, str, int], dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The table's rows (method x setting) and, per setting, each method's summary under its
    JSON key (:data:`TEXT_METHODS`) with whether ours beat linear probing by more than the sum
    of their standard deviations (over the same seeds, two at least). A method without finished
    cells in a setting is left out; ``seeds`` says which seeds an entry averages."""
    rows, by_setting = [], {}
    for setting in spec.settings:
        summary: dict[str, Any] = {}
        for method in spec.methods:
            seeds = [seed for seed in spec.seeds if (method, setting.label, seed) in cells]
            if not seeds:
                continue
            done = [cells[(method, setting.label, seed)] for seed in seeds]
            mean, std = _mean_std([c["test_balanced_accuracy"] for c in done])
            entry = {
                "seeds": seeds,
                "balanced_accuracy_mean": mean,
                "balanced_accuracy_std": std,
                "balanced_accuracy_per_seed": [c["test_balanced_accuracy"] for c in done],
                "trainable_parameters": done[0]["trainable_parameters"],
                "lr": spec.lr_of(method),
                "clients_trained_per_round": statistics.fmean(
                    n for c in done for n in c["clients_trained"]
                ),
                "diverged_seeds": [c["seed"] for c in done if "diverged_at_round" in c],
            }
            if spec.max_grad_norm_of(method) is not None:
                # a kept cell ran with this bound (kept_cell), so it counted its steps
                entry["max_grad_norm"] = spec.max_grad_norm_of(method)
                entry["gradient_norm_median_per_seed"] = [
                    c["gradient_norm"]["median"] for c in done
                ]
                entry["clipped_steps_fraction"] = sum(c["clipped_steps"] for c in done) / sum(
                    c["steps"] for c in done
                )
            summary[TEXT_METHODS[method]] = entry
            rows.append(
                {
                    "method": method,
                    "setting": setting.label,
                    "balanced_accuracy": f"{100 * mean:.2f} ± {100 * std:.2f}",
                    "gradient_clipped": _clipped_cell(entry),
                    **entry,
                }
            )
        ours, probe = summary.get("ours"), summary.get("linear_probe")
        if ours and probe and ours["seeds"] == probe["seeds"] and len(ours["seeds"]) > 1:
            margin = ours["balanced_accuracy_mean"] - probe["balanced_accuracy_mean"]
            summary["ours_minus_linear_probe"] = margin
            summary["ours_beats_linear_probe"] = bool(
                margin > ours["balanced_accuracy_std"] + probe["balanced_accuracy_std"]
            )
        by_setting[setting.label] = summary
    return rows, by_setting


def _clipped_cell(entry: dict[str, Any]) -> str:
    """A table row's gradient clipping, as the Markdown shows it."""
    if "max_grad_norm" not in entry:
        return "-"
    return f"norm {entry['max_grad_norm']:g}: {100 * entry['clipped_steps_fraction']:.0f}% of steps"


def lengths_shown_comparison(
    spec: TableSpec,
    hidden: dict[str, dict[str, Any]],
    shown_folder: Path,
    *,
    student_dir: Path,
    model: str,
    weights: Mapping[str, str | None] | None = None,
) -> dict[str, dict[str, Any]]:
    """What hiding text lengths cost: per setting and method of the hidden-lengths table
    (``hidden``, :func:`summarize_text`'s summaries), the same method with the texts' own key
    masks from the finished cells in ``shown_folder`` (same student, settings and seeds), and
    the difference in points (shown - hidden). Entries without such cells are left out.

    ``weights``: the hidden-lengths cells' student weights per distillation source
    (``None``: not recorded); a shown cell counts only if it names the same."""
    weights = weights or {}
    cells = {}
    for setting in spec.settings:
        student_file = kept_student_path(distill_run(setting, model), student_dir).name
        for method in spec.methods:
            for seed in spec.seeds:
                kept = kept_cell(cell_file(shown_folder, method, setting, seed), spec, setting)
                if (
                    kept is not None
                    and kept.get("student") == student_file
                    and kept.get(STUDENT_WEIGHTS_KEY) == weights.get(setting.distill_data)
                    and not kept.get("hide_text_lengths", False)
                ):
                    cells[(method, setting.label, seed)] = kept
    _, shown = summarize_text(spec, cells)
    comparison: dict[str, dict[str, Any]] = {}
    for label, summary in hidden.items():
        for key in ("linear_probe", "ours"):
            with_masks, without = shown.get(label, {}).get(key), summary.get(key)
            if not with_masks or not without or with_masks["seeds"] != without["seeds"]:
                continue
            comparison.setdefault(label, {})[key] = {
                "seeds": without["seeds"],
                "lengths_shown_mean": with_masks["balanced_accuracy_mean"],
                "lengths_shown_std": with_masks["balanced_accuracy_std"],
                "lengths_hidden_mean": without["balanced_accuracy_mean"],
                "lengths_hidden_std": without["balanced_accuracy_std"],
                "cost_points": 100
                * (with_masks["balanced_accuracy_mean"] - without["balanced_accuracy_mean"]),
            }
    return comparison


def plot_text_curves(
    spec: TableSpec,
    cells: list[dict[str, Any]],
    results_dir: Path,
    name: str = "text_adaptation",
) -> Path:
    """Test balanced accuracy per round, mean over the seeds, one panel per setting:
    ``results/<name>.png``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, len(spec.settings), figsize=(4 * len(spec.settings), 3.6), squeeze=False
    )
    for axis, setting in zip(axes[0], spec.settings, strict=True):
        for number, method in enumerate(spec.methods):
            curves = [
                c["test_balanced_accuracy_per_round"]
                for c in cells
                if c["method"] == method and c["setting"]["label"] == setting.label
            ]
            if not curves:  # not run yet
                continue
            mean = 100 * np.mean(np.asarray(curves, dtype=float), axis=0)
            label = f"{method} ({len(curves)} seed{'s' if len(curves) > 1 else ''})"
            # one colour per method in every panel, whichever methods a panel lacks
            axis.plot(range(1, len(mean) + 1), mean, label=label, color=f"C{number}")
        axis.set_title(setting.label)
        axis.set_xlabel("round")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("test balanced accuracy (%)")
    for axis in axes[0]:
        axis.legend(fontsize="small")
    figure.tight_layout()
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def table_suffix(spec: TableSpec) -> str:
    """What a results file's name adds for a table: nothing for the config's ``text`` table,
    ``_<table>`` (without a ``text_`` prefix) for another."""
    return "" if spec.name == "text" else "_" + spec.name.removeprefix("text_")


def results_name(spec: TableSpec, *, protocol: bool, hide_text_lengths: bool) -> str:
    """The results files' name: ``text_adaptation`` for the config's ``text`` table,
    ``text_adaptation_<table>`` for another (its name without a ``text_`` prefix), then
    ``_protocol`` and ``_hidden_lengths`` as the run says."""
    name = "text_adaptation" + table_suffix(spec)
    return (
        name + ("_protocol" if protocol else "") + ("_hidden_lengths" if hide_text_lengths else "")
    )


def check_same_student(cells: Sequence[dict[str, Any]], digest: str, folder: Path) -> None:
    """Refuse to add cells of the student whose weights are ``digest`` to finished ``cells``
    of another student (:class:`ConfigError`).

    Kept students are named by their distillation settings; distilled again in another
    environment (library versions, code), the same settings can give other weights. Cells made
    before cells named their weights cannot show which student they adapted."""
    others = [cell for cell in cells if cell.get(STUDENT_WEIGHTS_KEY) != digest]
    if not others:
        return
    found = sorted({str(cell.get(STUDENT_WEIGHTS_KEY, "not recorded")) for cell in others})
    raise ConfigError(
        f"{len(others)} finished cells in {folder} adapted a student with the same settings "
        f"and other weights (weights {', '.join(found)}; the student here: {digest}): it was "
        "distilled again, in another environment or before cells named their weights. Running "
        "the missing cells would mix two students in one table. Move those cells (or that "
        "folder) away to run the table with this student, or summarise them alone with "
        "--kept-only."
    )


def _cell_title(number: int, total: int, method: str, setting: Setting, seed: int) -> str:
    return f"[fedfm] text cell {number}/{total}: {method}, {setting.label}, seed {seed}"


def run_text_table(
    spec: TableSpec,
    *,
    student_dir: Path,
    workdir: Path,
    results_dir: Path,
    model: str = "minilm",
    command: str | None = None,
    progress: bool = True,
    run_missing: bool = True,
    protocol: bool = False,
    hide_text_lengths: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """Every cell of ``spec`` (finished ones read back from ``workdir``), then
    ``results/text_adaptation.{json,md,png}``; returns the per-setting summaries.

    ``run_missing=False`` runs nothing: the results summarise the finished cells (each entry
    names its seeds; the JSON lists the missing cells), a table of a long run so far.

    ``protocol=True`` runs ours and linear probing through the double-blind protocol
    (:func:`protocol_adapter`; cells in ``<workdir>/<table>-protocol``, results
    ``text_adaptation_protocol.*``); full fine-tuning is the same plaintext FedAvg either way.

    ``hide_text_lengths=True`` runs ours and linear probing as data owners that hide their
    texts' lengths (all-real key masks; cells in ``<folder>-hidden-lengths``, results
    ``<name>_hidden_lengths.*``); full fine-tuning is refused there (it has no server).
    Another table than ``text`` writes ``text_adaptation_<table>.*`` (:func:`results_name`)."""
    for method in spec.methods:
        if method not in TEXT_METHODS:
            raise ConfigError(f"unknown method {method!r}; choose from {list(TEXT_METHODS)}")
    if hide_text_lengths and "full-finetune" in spec.methods:
        raise ConfigError(
            "hide-text-lengths applies to ours and linear probing (the data owners' key masks "
            "towards the server); run it with methods linear-probe and ours"
        )
    suffix = "-hidden-lengths" if hide_text_lengths else ""
    # data owners that hide lengths train at the table's rates for them (chosen so); the cells
    # they are compared with ran at the table's own
    shown_spec = spec
    if hide_text_lengths:
        spec = spec.hiding_lengths()
    folder = workdir / ((f"{spec.name}-protocol" if protocol else spec.name) + suffix)
    folder.mkdir(parents=True, exist_ok=True)
    name = results_name(spec, protocol=protocol, hide_text_lengths=hide_text_lengths)
    students: dict[str, tuple[FheTextClassifier, dict[str, Any], TextSplits]] = {}
    features: dict[str, tuple[TextFeatures, TextFeatures]] = {}
    plan = [(m, s, seed) for s in spec.settings for m in spec.methods for seed in spec.seeds]
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    missing: list[dict[str, Any]] = []
    quiet: Callable[[str], None] = log if progress else (lambda _line: None)
    to_run: list[tuple[int, str, Setting, int]] = []
    for number, (method, setting, seed) in enumerate(plan, start=1):
        path = cell_file(folder, method, setting, seed)
        # a cell counts only for the student it adapted (another model or split runs again)
        student_file = kept_student_path(distill_run(setting, model), student_dir).name
        kept = kept_cell(path, spec, setting)
        if (
            kept is not None
            and kept.get("student") == student_file
            and kept.get("hide_text_lengths", False) == hide_text_lengths
        ):
            cells[(method, setting.label, seed)] = kept
            title = _cell_title(number, len(plan), method, setting, seed)
            log(f"{title}: done before, read from {path}")
        elif run_missing:
            to_run.append((number, method, setting, seed))
        else:
            missing.append({"method": method, "setting": setting.label, "seed": seed})
    # every student first, so finished cells of another student stop the run before it starts
    for source in sorted({setting.distill_data for _, _, setting, _ in to_run}):
        run = distill_run(next(s for _, _, s, _ in to_run if s.distill_data == source), model)
        student, report = kept_text_student(run, student_dir, progress=progress, log=log)
        students[source] = (student, report, text_splits(run))
        check_same_student(
            [cell for cell in cells.values() if cell["setting"]["distill_data"] == source],
            report["weights_digest"],
            folder,
        )
    for number, method, setting, seed in to_run:
        path = cell_file(folder, method, setting, seed)
        where = _cell_title(number, len(plan), method, setting, seed)
        source = setting.distill_data
        student, report, splits = students[source]
        if method != "full-finetune" and not protocol and source not in features:
            started = time.perf_counter()
            features[source] = (
                block_features(student, splits.pool, hide_text_lengths=hide_text_lengths),
                block_features(student, splits.test, hide_text_lengths=hide_text_lengths),
            )
            log(
                f"[fedfm] the student's block outputs on {len(splits.pool)} pool and "
                f"{len(splits.test)} test texts ({time.perf_counter() - started:.0f} s)"
            )
        log(f"{where} ...")
        record = run_text_cell(
            method,
            setting,
            seed,
            spec,
            student,
            splits,
            features.get(source),
            log=quiet,
            protocol=protocol,
            hide_text_lengths=hide_text_lengths,
        )
        record["student"] = kept_student_path(distill_run(setting, model), student_dir).name
        record[STUDENT_WEIGHTS_KEY] = report["weights_digest"]
        write_atomically(path, record)
        cells[(method, setting.label, seed)] = record
        log(
            f"{where}: test balanced accuracy {record['test_balanced_accuracy']:.4f} "
            f"({record['seconds']:.0f} s)"
        )
    if not cells:
        raise ConfigError(f"no finished cells of table {spec.name!r} in {folder}")
    if missing:
        log(f"[fedfm] {len(missing)} of {len(plan)} cells not run yet: the table shows the rest")
    rows, by_setting = summarize_text(spec, cells)
    columns = [
        ("method", "method"),
        ("setting", "setting"),
        ("balanced_accuracy", "bal. acc. (%)"),
        ("seeds", "seeds"),
        ("trainable_parameters", "trainable params"),
        ("lr", "lr"),
        ("clients_trained_per_round", "clients trained / round"),
    ]
    if any(spec.max_grad_norm_of(method) is not None for method in spec.methods):
        columns.append(("gradient_clipped", "gradient clipped"))
    comparison: dict[str, dict[str, Any]] = {}
    if hide_text_lengths:
        shown_folder = folder.with_name(folder.name.removesuffix(suffix))
        comparison = lengths_shown_comparison(
            shown_spec,
            by_setting,
            shown_folder,
            student_dir=student_dir,
            model=model,
            weights={
                cell["setting"]["distill_data"]: cell.get(STUDENT_WEIGHTS_KEY)
                for cell in cells.values()
            },
        )
        for row in rows:
            entry = comparison.get(row["setting"], {}).get(TEXT_METHODS[row["method"]])
            row["lengths_shown"] = (
                f"{100 * entry['lengths_shown_mean']:.2f} ± {100 * entry['lengths_shown_std']:.2f}"
                if entry
                else "not run"
            )
            row["cost_points"] = f"{entry['cost_points']:+.2f}" if entry else "-"
        columns[3:3] = [
            ("lengths_shown", "with lengths shown (%)"),
            ("cost_points", "cost (points)"),
        ]
    reports = {
        source: _student_summary(report) for source, (_, report, _) in students.items()
    } or _reports_of_kept(spec, student_dir, model)
    beaten = [s for s in by_setting.values() if s.get("ours_beats_linear_probe")]
    runner = (
        "Ours and linear probing: the double-blind protocol in one process (messages, "
        "permutations, the simulate backend, secure aggregation; each client holds out an "
        "equal share of the test texts, so the protocol's own evaluation is the test split)"
        if protocol
        else (
            "Ours and linear probing: the protocol's client rule on the frozen student's block "
            "outputs in plaintext (no encryption, no messages; `fedfm paper-text --protocol` "
            "runs the protocol itself)"
        )
    )
    selected_by = LR_SELECTION_COMMAND
    if hide_text_lengths and shown_spec.lr_hidden_lengths:
        selected_by += " --hide-text-lengths"
    if hide_text_lengths:
        runner += (
            "; every data owner hides its texts' lengths (node config hide-text-lengths: "
            "all-real key masks, so the blocks attend to padding and the head pools over all "
            f"{'/'.join(sorted({str(distill_run(s, model).max_tokens) for s in spec.settings}))}"
            " positions). 'with lengths shown': the same methods, seeds and student with the "
            "texts' own masks (learning rates "
            + ", ".join(f"{m} {shown_spec.lr_of(m):g}" for m in spec.methods)
            + f"), from the finished cells in {shown_folder} (cost = shown - hidden)"
        )
    write_results(
        results_dir,
        name,
        title=spec.title
        + (" (through the protocol)" if protocol else "")
        + (" with hidden text lengths" if hide_text_lengths else ""),
        description=(
            f"Balanced accuracy (%) on the held-out test texts after {spec.rounds} rounds, mean ± "
            f"std over seeds {list(spec.seeds)} (partition, batch draws and initialisation). "
            f"Model: the FHE-friendly distilled {model} (students: "
            + "; ".join(
                f"{source}: teacher {r['teacher_balanced_accuracy']:.4f}, student "
                f"{r['student_balanced_accuracy']:.4f} balanced accuracy"
                for source, r in reports.items()
            )
            + f"). Pool {TEXT_SPLIT['pool_per_class']} texts per family, batches of "
            f"{sorted({s.batch_size for s in spec.settings})}, {BATCHES_PER_ROUND} per client and "
            f"round, learning-rate decay x0.1 at 50% and 80%: {spec.lr_decay}; learning rates "
            + ", ".join(f"{method} {spec.lr_of(method):g}" for method in spec.methods)
            + (
                f" (set by the table, chosen on held-out pool texts: {selected_by})"
                if spec.lr
                else " (the defaults)"
            )
            + f". {runner}; "
            + (
                "full fine-tuning: plaintext FedAvg of the whole student"
                + (
                    f", each step's gradient clipped to total norm {clip:g} (the JSON's "
                    "clipped_steps_fraction: the share of steps clipping changed). "
                    if (clip := spec.max_grad_norm_of("full-finetune")) is not None
                    else ". "
                )
                if "full-finetune" in spec.methods
                else "full fine-tuning: not run in this table. "
            )
            + "Ours beats "
            f"linear probing by more than the sum of the standard deviations in {len(beaten)} of "
            f"{len(by_setting)} settings."
            + (
                f" Not run yet: {len(missing)} of {len(plan)} cells (see missing_cells)."
                if missing
                else ""
            )
        ),
        rows=rows,
        columns=columns,
        extra={
            "backend": (
                "simulate (the double-blind protocol's messages, plaintext values)"
                if protocol
                else "plaintext (torch; the protocol's training rule, no encryption)"
            ),
            "hide_text_lengths": hide_text_lengths,
            **({"lengths_shown_comparison": comparison} if hide_text_lengths else {}),
            "missing_cells": missing,
            "settings": by_setting,
            "students": reports,
            "split": TEXT_SPLIT,
            "cells": list(cells.values()),
            "spec": asdict(spec),
        },
        command=command,
    )
    path = plot_text_curves(spec, list(cells.values()), results_dir, name)
    log(f"[fedfm] wrote {results_dir / (name + '.json')}, .md and {path}")
    return by_setting


def _student_summary(report: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "teacher_accuracy",
        "teacher_balanced_accuracy",
        "student_accuracy",
        "student_balanced_accuracy",
        "exact_student_accuracy",
        "accuracy_gap_points",
        "split_sizes",
        "approximations",
        "distill_data",
        "weights_digest",
    )
    return {key: report[key] for key in keys if key in report}


def _reports_of_kept(spec: TableSpec, student_dir: Path, model: str) -> dict[str, Any]:
    """The students' reports when every cell was read back (no student was loaded)."""
    reports = {}
    for setting in spec.settings:
        path = kept_student_path(distill_run(setting, model), student_dir)
        if path.exists():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            reports[setting.distill_data] = _student_summary(json.loads(saved["report"]))
    return reports
