"""The model owner's offline step for text: a BERT-family teacher, its FHE-friendly student.

:func:`run_text_distillation`: tokenize the docstring task (:mod:`fedfm.data.text_task`), train
the teacher's head (a multinomial logistic regression, scikit-learn, on the frozen encoder's
mean-pooled output over ``D_aux``), convert encoder and head into the FHE-friendly student
(:func:`fedfm.models.fhe_text.to_fhe_text`) and distill it in two stages with the ViT's code
(:func:`fedfm.distillation.distill.distill`). Teacher, student and the student with exact
non-linearities are scored on the held-out test texts.

``distill_data``: ``aux`` distills on ``D_aux`` with its labels (in distribution); ``public`` on
as many texts of other standard-library modules, labelled by the teacher (out of distribution);
``stdlib`` on ``distill_texts`` docstrings of every standard-library module outside the test
texts and the data owners' pool (:func:`fedfm.data.text_task.unlabelled_texts`), labelled by the
teacher: distillation needs no labels, so ``D_aux`` can be far larger than the labelled set.

The GELU: a pretrained encoder's GELU inputs reach far outside the paper's Quad domain, and Quad
alone leaves MiniLM at chance. :class:`TextApproxSettings` can choose a least-squares GELU fit
with a per-channel input scale (:class:`fedfm.approx.ChannelScaledGELU`), calibrated once on
the teacher's weights before distillation.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfm.approx.modules import (
    calibrate,
    calibrate_gelu_scales,
    calibrated_modules,
    clamped_count,
    reset_clamped,
)
from fedfm.approx.specs import QUAD_GELU, ApproxConfig
from fedfm.data.stdlib_text import TASK_FAMILIES
from fedfm.data.text_task import TEXT_SPLIT, TextSplits, load_text_task, unlabelled_texts
from fedfm.distillation.distill import DistillConfig, calibration_batches, distill
from fedfm.distillation.text_defaults import TEXT_DISTILL_DEFAULTS as DEFAULTS
from fedfm.distillation.training import Scores, predict, score
from fedfm.errors import ConfigError
from fedfm.models.fhe_text import FheTextClassifier, load_text_encoder, to_fhe_text
from fedfm.models.student import ApproxSettings, read_text_student

DISTILL_DATA = ("aux", "public", "stdlib")
ENCODE_BATCH = 64


@dataclass(frozen=True)
class TextApproxSettings(ApproxSettings):
    """:class:`ApproxSettings` plus the text encoder's GELU choice: ``gelu_degree`` ``None`` is
    the paper's Quad, a degree the least-squares fit on ``[-gelu_radius, gelu_radius]``;
    ``gelu_channel_scale`` adds the per-channel calibrated input scale."""

    gelu_degree: int | None = DEFAULTS.gelu_degree
    gelu_radius: float = DEFAULTS.gelu_radius
    gelu_channel_scale: bool = DEFAULTS.gelu_channel_scale


@dataclass(frozen=True)
class TextDistillRun:
    """Everything that determines one text distillation (defaults: :mod:`.text_defaults`)."""

    model: str = DEFAULTS.model
    max_tokens: int = DEFAULTS.max_tokens
    seed: int = DEFAULTS.seed
    aux_per_class: int = DEFAULTS.aux_per_class
    pool_per_class: int = DEFAULTS.pool_per_class
    test_per_class: int = DEFAULTS.test_per_class
    distill_data: str = DEFAULTS.distill_data
    distill_texts: int = DEFAULTS.distill_texts  # how many texts ``stdlib`` distills on
    head_c: float = DEFAULTS.head_c  # inverse L2 strength of the teacher's logistic regression
    ablation: bool = DEFAULTS.ablation  # also score one approximation at a time (slower)
    approx: TextApproxSettings = field(default_factory=TextApproxSettings)
    distill: DistillConfig = field(
        default_factory=lambda: DistillConfig(
            epochs=DEFAULTS.epochs,
            batch_size=DEFAULTS.batch_size,
            lr_stage1=DEFAULTS.lr_stage1,
            lr_stage2=DEFAULTS.lr_stage2,
            calibration_batches=DEFAULTS.calibration_batches,
        )
    )

    def __post_init__(self) -> None:
        if self.distill_data not in DISTILL_DATA:
            raise ConfigError(
                f"unknown distillation data {self.distill_data!r}; choose one of "
                f"{list(DISTILL_DATA)}"
            )
        if self.distill_texts < 1:
            raise ConfigError(f"distill_texts must be >= 1, got {self.distill_texts}")
        if self.head_c <= 0:
            raise ConfigError(f"head_c must be > 0, got {self.head_c}")


def student_run(model: str = "minilm", distill_data: str = "stdlib") -> TextDistillRun:
    """The distillation run of the adapted students (``fedfm paper-text``, ``fedfm
    bench-ckks-text``, the double-blind apps): :data:`TEXT_SPLIT`, on ``distill_data``."""
    return TextDistillRun(
        model=model,
        distill_data=distill_data,
        ablation=False,
        aux_per_class=TEXT_SPLIT["aux_per_class"],
        pool_per_class=TEXT_SPLIT["pool_per_class"],
        test_per_class=TEXT_SPLIT["test_per_class"],
    )


def task_splits(run: TextDistillRun, tokenizer: Any) -> TextSplits:
    """The tokenized docstring task of ``run`` (its split sizes and seed): the texts its
    teacher, student and any later adaptation of that student see."""
    return load_text_task(
        tokenizer,
        max_tokens=run.max_tokens,
        seed=run.seed,
        aux_per_class=run.aux_per_class,
        pool_per_class=run.pool_per_class,
        test_per_class=run.test_per_class,
        public_size=len(TASK_FAMILIES) * run.aux_per_class,
    )


@torch.no_grad()
def pooled_features(model: FheTextClassifier, input_ids: torch.Tensor) -> np.ndarray:
    """The mean-pooled last block output of every text (the head's input)."""
    model.eval()
    return (
        torch.cat([model.encode(chunk) for chunk in input_ids.split(ENCODE_BATCH)]).double().numpy()
    )


def train_head(
    model: FheTextClassifier, input_ids: torch.Tensor, labels: torch.Tensor, *, c: float
) -> nn.Linear:
    """A linear head fitted on the frozen encoder's pooled output (logistic regression)."""
    from sklearn.linear_model import LogisticRegression

    features = pooled_features(model, input_ids)
    fitted = LogisticRegression(C=c, max_iter=2000).fit(features, labels.numpy())
    head = nn.Linear(features.shape[1], int(labels.max()) + 1)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(fitted.coef_).float())
        head.bias.copy_(torch.from_numpy(fitted.intercept_).float())
    return head


def distillation_texts(
    run: TextDistillRun, splits: TextSplits, teacher: FheTextClassifier, tokenizer: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids the student is distilled on and the labels of stage II."""
    if run.distill_data == "aux":
        return splits.aux.input_ids, splits.aux.labels
    if run.distill_data == "stdlib":
        input_ids = unlabelled_texts(
            tokenizer,
            exclude=splits,
            count=run.distill_texts,
            max_tokens=run.max_tokens,
            seed=run.seed,
        ).input_ids
    else:
        input_ids = splits.public.input_ids[: min(len(splits.public), len(splits.aux))]
    return input_ids, predict(teacher, input_ids, batch_size=ENCODE_BATCH)


# One approximation at a time (the others exact), on the teacher's weights: which one costs what
ABLATION: dict[str, dict[str, Any]] = {
    "exp (Taylor)": {"exp_degree": 6, "inverse_iterations": None, "gelu": False,
                     "inv_sqrt_iterations": None},
    "exp and inverse (Goldschmidt)": {"exp_degree": 6, "inverse_iterations": 7, "gelu": False,
                                      "inv_sqrt_iterations": None},
    "inverse sqrt (Newton)": {"exp_degree": None, "inverse_iterations": None, "gelu": False,
                              "inv_sqrt_iterations": 5},
    "GELU (quadratic)": {"exp_degree": None, "inverse_iterations": None, "gelu": True,
                         "inv_sqrt_iterations": None},
}  # fmt: skip


def polynomial_student(
    teacher: FheTextClassifier, approx: ApproxConfig, calibration: list[torch.Tensor]
) -> FheTextClassifier:
    """The teacher's weights under ``approx``, calibrated on ``calibration``: the GELU scales
    (if any) on the GELU inputs of the otherwise exact model, then the division bounds."""
    if approx.gelu_channel_scale:
        gelu_only = teacher.with_approx(
            ApproxConfig(exp=None, inverse=None, gelu=approx.gelu, inv_sqrt=None,
                         gelu_channel_scale=True)
        )  # fmt: skip
        calibrate_gelu_scales(gelu_only, calibration)
        student = gelu_only.with_approx(approx)  # keeps the scales
    else:
        student = teacher.with_approx(approx)
    calibrate(student, calibration)
    return student


def approximation_ablation(
    teacher: FheTextClassifier,
    splits: TextSplits,
    calibration: list[torch.Tensor],
    approx: ApproxConfig,
) -> dict[str, float]:
    """Test accuracy of the teacher's weights with one approximation at a time (calibrated on
    ``calibration``, not distilled); a fitted GELU (``approx``'s) adds its own row."""
    configs = {name: ApproxConfig.build(**settings) for name, settings in ABLATION.items()}
    if approx.gelu is not None and approx.gelu.name != QUAD_GELU.name:
        scaled = ", channel-scaled" if approx.gelu_channel_scale else ""
        configs[f"GELU ({approx.gelu.name}{scaled})"] = ApproxConfig(
            exp=None, inverse=None, gelu=approx.gelu, inv_sqrt=None,
            gelu_channel_scale=approx.gelu_channel_scale,
        )  # fmt: skip
    return {
        name: _score(polynomial_student(teacher, config, calibration), splits).accuracy
        for name, config in configs.items()
    }


def _score(model: FheTextClassifier, splits: TextSplits) -> Scores:
    return score(model, splits.test.input_ids, splits.test.labels, batch_size=ENCODE_BATCH)


def run_text_distillation(
    run: TextDistillRun, *, progress: bool = False, log: Callable[[str], None] = print
) -> tuple[dict[str, Any], FheTextClassifier]:
    """Run the offline step for text; return the report and the distilled student."""
    started = time.perf_counter()
    load_at_start = list(os.getloadavg())
    approx = run.approx.build()
    encoder, tokenizer = load_text_encoder(run.model)
    splits = task_splits(run, tokenizer)
    log(
        f"[fedfm] docstring task: {len(splits.classes)} families, D_aux={len(splits.aux)} "
        f"pool={len(splits.pool)} test={len(splits.test)} public={len(splits.public)}, "
        f"{run.max_tokens} tokens"
    )
    pad = int(tokenizer.pad_token_id)
    torch.manual_seed(run.seed)
    teacher = to_fhe_text(
        encoder,
        ApproxConfig.exact(),
        num_classes=len(splits.classes),
        pad_token_id=pad,
        max_tokens=run.max_tokens,
    )
    teacher.classifier = train_head(teacher, splits.aux.input_ids, splits.aux.labels, c=run.head_c)
    teacher.eval()
    teacher_seconds = time.perf_counter() - started
    texts, labels = distillation_texts(run, splits, teacher, tokenizer)
    student = polynomial_student(teacher, approx, calibration_batches(texts, run.distill))
    log(f"[fedfm] student {approx.settings()}: distilling on {run.distill_data} ({len(texts)})")
    history = distill(student, teacher, texts, labels, run.distill, progress=progress, log=log)
    distill_seconds = time.perf_counter() - started - teacher_seconds

    teacher_scores = _score(teacher, splits)
    reset_clamped(student)
    student_scores = _score(student, splits)
    test_clamped = clamped_count(student)
    exact_scores = _score(student.with_approx(ApproxConfig.exact()), splits)
    undistilled = polynomial_student(teacher, approx, calibration_batches(texts, run.distill))
    reset_clamped(undistilled)
    undistilled_scores = _score(undistilled, splits)
    ablation = (
        approximation_ablation(teacher, splits, calibration_batches(texts, run.distill), approx)
        if run.ablation
        else {}
    )
    gap = 100 * (teacher_scores.accuracy - student_scores.accuracy)
    config = encoder.config
    report: dict[str, Any] = {
        "backend": "plaintext (torch, no encryption)",
        "model": run.model,
        "architecture": {
            "type": config.model_type,
            "blocks": teacher.num_blocks,
            "width": teacher.hidden_size,
            "heads": int(config.num_attention_heads),
            "max_tokens": run.max_tokens,
        },
        "classes": list(splits.classes),
        "split_sizes": {
            "aux": len(splits.aux),
            "pool": len(splits.pool),
            "test": len(splits.test),
            "distilled_on": len(texts),
        },
        "distill_data": run.distill_data,
        "approximations": approx.describe(),
        "teacher_accuracy": teacher_scores.accuracy,
        "teacher_balanced_accuracy": teacher_scores.balanced_accuracy,
        "student_accuracy": student_scores.accuracy,
        "student_balanced_accuracy": student_scores.balanced_accuracy,
        "exact_student_accuracy": exact_scores.accuracy,
        "undistilled_student_accuracy": undistilled_scores.accuracy,
        "one_approximation_accuracy": ablation,
        "accuracy_gap_points": gap,
        "within_3_points": bool(gap <= 3.0),
        "test_values_clamped": test_clamped,
        "input_bounds": [
            None if torch.isnan(m.input_bound) else float(m.input_bound)
            for m in calibrated_modules(student)
        ],
        "distill_history": history,
        "settings": asdict(run),
        "seconds": {
            "teacher": teacher_seconds,
            "distill": distill_seconds,
            "total": time.perf_counter() - started,
        },
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        # a shared machine: how busy it was tells how far the seconds are from an idle run
        "load_average": {"start": load_at_start, "end": list(os.getloadavg())},
    }
    log(
        f"[fedfm] test accuracy: teacher {teacher_scores.accuracy:.4f}, FHE-friendly student "
        f"{student_scores.accuracy:.4f} (gap {gap:.1f} points), exact-non-linearity student "
        f"{exact_scores.accuracy:.4f}, undistilled polynomial {undistilled_scores.accuracy:.4f}"
    )
    return report, student


def _run_digest(run: TextDistillRun) -> str:
    text = json.dumps(asdict(run), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of ``model``'s weights and buffers (names, dtypes, shapes and values).

    A kept student's file is named by its run's settings; this names the weights themselves.
    The same settings distilled in another environment (library versions, code) can give other
    weights, and results of two such students must not be mixed in one table."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        values = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{values.dtype}:{tuple(values.shape)}".encode())
        digest.update(values.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def kept_student_path(run: TextDistillRun, folder: Path) -> Path:
    """Where :func:`kept_text_student` keeps the student of ``run``."""
    return folder / f"text-student-{_run_digest(run)}.pt"


def kept_text_student(
    run: TextDistillRun, folder: Path, *, progress: bool = False, log: Callable[[str], None] = print
) -> tuple[FheTextClassifier, dict[str, Any]]:
    """The student of ``run`` and its report, distilled once and kept in ``folder``.

    The file is named by a digest of ``run`` (another split, seed or approximation distils
    again); it holds the student's weights and calibrated buffers (GELU channel scales, division
    bounds), so the student is rebuilt from the encoder and loaded. A file that does not match
    the rebuilt model is refused (:class:`ConfigError`), never half loaded. The report's
    ``weights_digest`` (:func:`weights_digest`) names the weights themselves.
    """
    path = kept_student_path(run, folder)
    if path.exists():
        student, report = read_text_student(
            path, model=run.model, approx=run.approx.build(), max_tokens=run.max_tokens
        )
        report["weights_digest"] = weights_digest(student)
        log(f"[fedfm] text student read from {path} (weights {report['weights_digest']})")
        return student.eval(), report
    report, student = run_text_distillation(run, progress=progress, log=log)
    report["weights_digest"] = weights_digest(student)
    folder.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    # the report as JSON text: numpy scalars would not load under weights_only
    torch.save(
        {"state": student.state_dict(), "report": json.dumps(report, default=float)}, temporary
    )
    os.replace(temporary, path)
    log(f"[fedfm] text student kept in {path}")
    return student.eval(), report
