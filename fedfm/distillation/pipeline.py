"""The server's offline step end to end: data, teacher, FHE-friendly student, report.

``fedfm distill`` runs :func:`run_distillation`: load the dataset splits, obtain the teacher
(cached, or pretrained / adapted on ``D_aux``), convert it to the FHE-friendly student, distill in
two stages, evaluate teacher, student and the student with exact non-linearities on the held-out
test set, and write ``student.pt`` and ``report.json`` to the work directory.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedfm.approx.modules import calibrated_modules, clamped_count, reset_clamped
from fedfm.approx.specs import ApproxConfig
from fedfm.data import DataSplits
from fedfm.data.photos import sample_photo_crops
from fedfm.distillation.distill import DistillConfig, distill
from fedfm.distillation.training import PretrainConfig, Scores, pretrain, score
from fedfm.errors import ConfigError
from fedfm.models.device import (
    device_report,
    mixed_precision,
    reset_peak_memory,
    resolve_device,
)
from fedfm.models.fhe_vit import FheViT, to_fhe_friendly
from fedfm.models.foundation import (
    DEFAULT_MODEL,
    ModelSpec,
    obtain_teacher,
)
from fedfm.models.student import (
    ApproxSettings,
    StudentSource,
    load_student,
    save_student,
)


@dataclass(frozen=True)
class DistillRun:
    """Everything that determines one ``fedfm distill`` run."""

    dataset: str = "digits"
    data_root: str | None = None
    model: str = DEFAULT_MODEL
    checkpoint: str | None = None
    image_size: int | None = None
    max_samples: int | None = None
    seed: int = 0
    approx: ApproxSettings = field(default_factory=ApproxSettings)
    teacher: PretrainConfig = field(default_factory=PretrainConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    workdir: Path = Path("runs/distill")
    cache_dir: Path = Path("runs/cache")
    distill_data: str = "aux"  # one of DISTILL_DATA: what the student is distilled on
    # where plaintext torch runs (fedfm.models.device: auto, cpu, cuda, cuda:N) and the opt-in
    # mixed precision of training (off, bf16, fp16; only ever on a GPU). Neither is part of a
    # cache key unless mixed precision is on (it trains other weights).
    device: str = "auto"
    precision: str = "off"

    @property
    def source(self) -> StudentSource:
        """Where this run's student lives and the data it is for (what the protocols load)."""
        return StudentSource(
            dataset=self.dataset,
            data_root=self.data_root,
            model=self.model,
            image_size=self.image_size,
            max_samples=self.max_samples,
            seed=self.seed,
            workdir=Path(self.workdir),
            distill_data=self.distill_data,
        )


# What the student can be distilled on (the teacher is always pretrained on D_aux): ``aux``, the
# in-distribution D_aux with its labels; ``sample-photos``, as many out-of-distribution crops of
# scikit-learn's sample photographs, labelled by the teacher (they carry no labels of the task).
DISTILL_DATA = ("aux", "sample-photos")


def distillation_data(
    run: DistillRun, splits: DataSplits, teacher: torch.nn.Module, image_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The images the student is distilled on, and the labels of stage II's loss."""
    if run.distill_data == "aux":
        return splits.aux.images, splits.aux.labels
    if run.distill_data != "sample-photos":
        raise ConfigError(
            f"unknown distillation data {run.distill_data!r}; choose one of {list(DISTILL_DATA)}"
        )
    images = sample_photo_crops(len(splits.aux), image_size=image_size, seed=run.seed)
    teacher.eval()
    device = next(teacher.parameters()).device
    with torch.no_grad():
        labels = torch.cat(
            [teacher(chunk.to(device)).argmax(1).cpu() for chunk in images.split(256)]
        )
    return images, labels


def load_data(run: DistillRun) -> tuple[DataSplits, int]:
    """The dataset splits at the model's input size, and that size."""
    return run.source.load_data()


def teacher_for(
    run: DistillRun,
    splits: DataSplits,
    image_size: int,
    *,
    progress: bool,
    log: Callable[[str], None],
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The cached teacher for this run's model, data and pretraining settings (built if absent;
    pretrained on ``run.device``, returned on the CPU)."""
    spec = ModelSpec(run.model, splits.aux.num_classes, image_size)
    device = resolve_device(run.device)
    precision = mixed_precision(run.precision, device, log=log)

    def train(model: torch.nn.Module) -> dict[str, Any]:
        return pretrain(
            model,
            splits.aux.images,
            splits.aux.labels,
            run.teacher,
            progress=progress,
            device=device,
            precision=precision,
        )

    # mixed precision trains other weights: its own cache entry (fp32 keys stay as they were)
    precision_key = {"precision": precision.mode} if precision.enabled else {}

    return obtain_teacher(
        spec,
        cache_dir=Path(run.cache_dir),
        train=train,
        checkpoint=run.checkpoint,
        cache_settings={
            "dataset": run.dataset,
            "aux_size": len(splits.aux),
            "seed": run.seed,
            "max_samples": run.max_samples,
            "pretrain": asdict(run.teacher),
            **precision_key,
        },
        log=log,
    )


def obtain_student(
    run: DistillRun, *, progress: bool = True, log: Callable[[str], None] = print
) -> FheViT:
    """The distilled student of ``run``: loaded from its work directory, or distilled now.

    Raises
    ------
    ConfigError
        If the work directory's ``report.json`` says its student was distilled for another
        dataset or on other data than ``run`` asks for.
    """
    path = run.source.student_path
    if not path.exists():
        log(f"[fedfm] no student at {path}: running the distillation first")
        run_distillation(run, progress=progress, log=log)
    else:
        run.source.check_report()
        log(f"[fedfm] server model: FHE-friendly student {path}")
    return load_student(path)


def _scores(model: torch.nn.Module, splits: DataSplits, device: torch.device) -> Scores:
    return score(model.to(device), splits.test.images, splits.test.labels)


def run_distillation(
    run: DistillRun,
    *,
    restart: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the offline step and return the report (also written to ``<workdir>/report.json``)."""
    started = time.perf_counter()
    approx = run.approx.build()  # validates degrees before any data is loaded
    device = resolve_device(run.device)  # and the device: `--device cuda` without a GPU stops here
    precision = mixed_precision(run.precision, device, log=log)
    reset_peak_memory(device)
    log(f"[fedfm] plaintext torch on {device} (mixed precision: {precision.describe()})")
    workdir = Path(run.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    state_path = workdir / "distill-state.pt"
    if restart and state_path.exists():
        state_path.unlink()

    splits, image_size = load_data(run)
    log(
        f"[fedfm] data {run.dataset}: D_aux={len(splits.aux)} pool={len(splits.pool)} "
        f"test={len(splits.test)} at {image_size}x{image_size}"
    )
    torch.manual_seed(run.seed)  # timm initialises weights from the global generator
    teacher_vit, teacher_meta = teacher_for(run, splits, image_size, progress=progress, log=log)
    teacher_vit.eval()
    spec = ModelSpec(run.model, splits.aux.num_classes, image_size)
    teacher = to_fhe_friendly(teacher_vit, ApproxConfig.exact())
    student = to_fhe_friendly(teacher_vit, approx)
    log(f"[fedfm] student: {approx.settings()} (plaintext torch evaluation)")

    images, labels = distillation_data(run, splits, teacher_vit.to(device), image_size)
    log(f"[fedfm] distilling on {run.distill_data}: {len(images)} images")
    history = distill(
        student,
        teacher,
        images,
        labels,
        run.distill,
        state_path=state_path,
        run_settings={
            "data": run.dataset,
            "distill_data": run.distill_data,
            "model": asdict(spec),
            "approx": asdict(run.approx),
            "teacher": teacher_meta.get("pretrain_loss"),
        },
        progress=progress,
        log=log,
        device=device,
        precision=precision,
    )
    save_student(workdir / "student.pt", student, spec, run.approx)

    teacher_scores = _scores(teacher_vit, splits, device)
    reset_clamped(student)
    student_scores = _scores(student, splits, device)
    test_clamped = clamped_count(student)
    exact_scores = _scores(student.with_approx(ApproxConfig.exact()), splits, device)
    report: dict[str, Any] = {
        "command": "fedfm distill",
        "backend": "plaintext (torch, no encryption)",
        "dataset": run.dataset,
        "distill_data": run.distill_data,
        "split_sizes": {"aux": len(splits.aux), "pool": len(splits.pool), "test": len(splits.test)},
        "model": asdict(spec),
        "approximations": approx.describe(),
        "teacher_accuracy": teacher_scores.accuracy,
        "teacher_balanced_accuracy": teacher_scores.balanced_accuracy,
        "student_accuracy": student_scores.accuracy,
        "student_balanced_accuracy": student_scores.balanced_accuracy,
        "exact_student_accuracy": exact_scores.accuracy,
        "exact_student_balanced_accuracy": exact_scores.balanced_accuracy,
        "accuracy_gap_points": 100 * (teacher_scores.accuracy - student_scores.accuracy),
        "test_values_clamped": test_clamped,
        # NaN marks a division left exact (never calibrated); JSON has no NaN
        "input_bounds": [
            None if torch.isnan(m.input_bound) else float(m.input_bound)
            for m in calibrated_modules(student)
        ],
        "teacher_pretrain_loss": teacher_meta.get("pretrain_loss"),
        "distill_history": history,
        "settings": json.loads(json.dumps(asdict(run), default=str)),
        "elapsed_seconds": time.perf_counter() - started,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "precision": precision.describe(),
        **device_report(device),
    }
    (workdir / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False))
    log(
        f"[fedfm] test accuracy: teacher {teacher_scores.accuracy:.4f}, "
        f"FHE-friendly student {student_scores.accuracy:.4f}, "
        f"student with exact non-linearities {exact_scores.accuracy:.4f}"
    )
    log(f"[fedfm] wrote {workdir / 'student.pt'} and {workdir / 'report.json'}")
    return report
