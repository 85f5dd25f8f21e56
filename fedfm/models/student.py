"""The distilled FHE-friendly student as an artefact: where it is, what data it is for, loading it.

The model owner makes the student offline (``fedfm distill``, :mod:`fedfm.distillation`); every
protocol and app only loads it. :class:`StudentSource` names a student's work directory and the
dataset settings it was distilled for; :meth:`StudentSource.load_student` refuses, naming the
command that makes one, when the directory holds none, and refuses a directory whose
``report.json`` says its student was made for another dataset or on other data.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedfm.approx.specs import ApproxConfig
from fedfm.data import DataSplits, load_splits
from fedfm.errors import CheckpointError, ConfigError
from fedfm.models.foundation import (
    DEFAULT_MODEL,
    ModelSpec,
    check_model_name,
    load_state_strict,
    native_image_size,
    read_checkpoint,
    save_checkpoint,
)

if TYPE_CHECKING:  # built in load_student: timm stays out of processes that only read data
    from fedfm.models.fhe_vit import FheViT

STUDENT_FORMAT = "fedfm-student/2"
# /1 students had their division bounds calibrated on 128 of D_aux's images, too few for the
# encrypted path: unseen inputs past a bound diverge under CKKS (docs/ckks.md).
RETIRED_STUDENT_FORMATS = {
    "fedfm-student/1": (
        "its division bounds were calibrated on part of D_aux, and inputs past them diverge "
        "under CKKS; distil it again (`fedfm distill --restart` with its --workdir) to calibrate "
        "them on all of D_aux"
    )
}
STUDENT_FILE = "student.pt"
REPORT_FILE = "report.json"


@dataclass(frozen=True)
class ApproxSettings:
    """Plain approximation settings (command-line shaped); ``None`` keeps a function exact."""

    exp_degree: int | None = 6
    inverse_iterations: int | None = 7
    inv_sqrt_iterations: int | None = 5
    gelu: bool = True

    def build(self) -> ApproxConfig:
        return ApproxConfig.build(**asdict(self))


@dataclass(frozen=True)
class StudentSource:
    """A distilled student's work directory and the data settings it was distilled for.

    ``distill_data`` is what the student was distilled on (``aux`` or ``sample-photos``, see
    :data:`fedfm.distillation.pipeline.DISTILL_DATA`); the data settings give the splits at the
    model's input size (``image_size`` ``None``: the model's native size).
    """

    dataset: str = "digits"
    data_root: str | None = None
    model: str = DEFAULT_MODEL
    image_size: int | None = None
    max_samples: int | None = None
    seed: int = 0
    workdir: Path = Path("runs/distill")
    distill_data: str = "aux"

    def load_data(self) -> tuple[DataSplits, int]:
        """The dataset splits at the model's input size, and that size."""
        check_model_name(self.model)
        image_size = (
            self.image_size if self.image_size is not None else native_image_size(self.model)
        )
        splits = load_splits(
            self.dataset,
            image_size=image_size,
            root=self.data_root,
            seed=self.seed,
            max_samples=self.max_samples,
        )
        return splits, image_size

    @property
    def student_path(self) -> Path:
        return Path(self.workdir) / STUDENT_FILE

    def distill_command(self) -> str:
        """The ``fedfm distill`` command that makes this student."""
        words = ["fedfm", "distill", "--workdir", str(self.workdir), "--dataset", self.dataset]
        if self.data_root:
            words += ["--data-root", self.data_root]
        if self.model != DEFAULT_MODEL:
            words += ["--model", self.model]
        if self.image_size is not None:
            words += ["--image-size", str(self.image_size)]
        if self.max_samples is not None:
            words += ["--max-samples", str(self.max_samples)]
        if self.seed:
            words += ["--seed", str(self.seed)]
        if self.distill_data != "aux":
            words += ["--distill-data", self.distill_data]
        return shlex.join(words)

    def check_report(self) -> None:
        """Refuse a work directory whose report names another dataset or distillation data (a
        student saved without a report, e.g. by hand, is taken as it is)."""
        report_path = Path(self.workdir) / REPORT_FILE
        if not report_path.exists():
            return
        report = json.loads(report_path.read_text())
        made = (report.get("dataset"), report.get("distill_data", "aux"))
        wanted = (self.dataset, self.distill_data)
        if made != wanted:
            raise ConfigError(
                f"the student in {self.workdir} was distilled for dataset {made[0]!r} on "
                f"{made[1]!r} data, this run asks for {wanted[0]!r} on {wanted[1]!r}: give it "
                "its own --workdir (or remove that folder)"
            )

    def load_student(self) -> FheViT:
        """The student of this work directory.

        Raises
        ------
        ConfigError
            If there is none (the message names the command that makes it), or its report says
            it was made for another dataset or on other data.
        """
        if not self.student_path.exists():
            raise ConfigError(
                f"no distilled student at {self.student_path}: the model owner makes it offline "
                f"first, with `{self.distill_command()}`"
            )
        self.check_report()
        return load_student(self.student_path)


def save_student(path: Path, student: FheViT, spec: ModelSpec, settings: ApproxSettings) -> None:
    """Write the student with what is needed to rebuild it (architecture + approximations)."""
    save_checkpoint(
        path,
        {
            "format": STUDENT_FORMAT,
            "model": asdict(spec),
            "approx": asdict(settings),
            "state_dict": student.state_dict(),
        },
    )


def load_student(path: str | Path) -> FheViT:
    """Rebuild a distilled student from ``student.pt`` (weights and calibrated bounds)."""
    payload = read_checkpoint(path, expected_format=STUDENT_FORMAT, retired=RETIRED_STUDENT_FORMATS)
    try:
        spec = ModelSpec(**payload["model"])
        approx = ApproxSettings(**payload["approx"]).build()
    except (KeyError, TypeError) as error:
        raise CheckpointError(
            f"student checkpoint {path} has no valid model description"
        ) from error
    from fedfm.models.fhe_vit import to_fhe_friendly

    student = to_fhe_friendly(spec.build(), approx)
    load_state_strict(student, payload["state_dict"], source=f"student checkpoint {path}")
    return student.eval()
