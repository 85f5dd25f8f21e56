"""The distilled FHE-friendly student as an artefact: where it is, what data it is for, loading it.

The model owner makes the student offline (``fedfm distill``, :mod:`fedfm.distillation`); every
protocol and app only loads it. :class:`StudentSource` names a student's work directory and the
dataset settings it was distilled for; :meth:`StudentSource.load_student` refuses, naming the
command that makes one, when the directory holds none, and refuses a directory whose
``report.json`` says its student was made for another dataset or on other data.
"""

from __future__ import annotations

import functools
import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedfm.approx.specs import ApproxConfig
from fedfm.data import DataSplits, load_splits
from fedfm.data.text_task import MAX_TOKENS, TEXT_SPLIT, TextSplits, adaptation_task
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
    from fedfm.models.fhe_text import FheTextClassifier
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


KEPT_TEXT_STUDENTS = "text-student-*.pt"
"""The file names of kept text students (:func:`fedfm.distillation.text.kept_student_path`)."""


def read_text_student(
    path: Path, *, model: str, approx: ApproxConfig, max_tokens: int
) -> tuple[FheTextClassifier, dict[str, Any]]:
    """A kept text student (its weights and calibrated buffers on the encoder ``model`` rebuilt
    with ``approx``) and its distillation report; :class:`ConfigError` for a file that is not
    one or does not fit, never a half-loaded model."""
    from fedfm.models.fhe_text import load_text_encoder, to_fhe_text

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        report: dict[str, Any] = json.loads(saved["report"])
    except Exception as error:  # torch.load fails in many ways on a damaged file
        raise ConfigError(f"{path} is not a kept text student ({error}); remove it") from None
    encoder, tokenizer = load_text_encoder(model)
    student = to_fhe_text(
        encoder,
        approx,
        num_classes=len(report["classes"]),
        pad_token_id=int(tokenizer.pad_token_id),
        max_tokens=max_tokens,
    )
    try:
        student.load_state_dict(saved["state"])
    except RuntimeError as error:
        raise ConfigError(f"{path} does not hold this run's student ({error}); remove it") from None
    return student.eval(), report


@dataclass(frozen=True)
class TextStudentSource:
    """The double-blind apps' text model and data (run config ``dataset = "docstrings"``).

    The student is the one ``fedfm paper-text`` adapts: distilled on unlabelled docstrings beside
    the split :data:`~fedfm.data.text_task.TEXT_SPLIT` (seed 0, 64 tokens) and kept in
    ``workdir``; the model owner makes it offline (:meth:`keep_command`). The data owners'
    texts are that task's pool, tokenized with the model's tokenizer.
    """

    model: str = "minilm"
    workdir: Path = Path("runs/text")

    def load_data(self) -> tuple[TextSplits, int]:
        """The tokenized task and its tokens per text."""
        return adaptation_task(_text_tokenizer(self.model)), MAX_TOKENS

    def pad_token_id(self) -> int:
        """The tokenizer's padding id (a data owner's key masks are the other tokens)."""
        return int(_text_tokenizer(self.model).pad_token_id)

    def keep_command(self) -> str:
        """The command that distils this student into :attr:`workdir`."""
        words = ["fedfm", "distill-text", "--keep-student", str(self.workdir)]
        return shlex.join(words + (["--model", self.model] if self.model != "minilm" else []))

    @property
    def student_path(self) -> Path:
        """The kept student of this model and split in :attr:`workdir`.

        Raises :class:`ConfigError` naming :meth:`keep_command` when there is none."""
        return self._kept()[0]

    def load_student(self) -> FheTextClassifier:
        """The kept student (:attr:`student_path`), rebuilt with its report's approximations."""
        path, report = self._kept()
        approx = ApproxConfig.build(**report["settings"]["approx"])
        student, _ = read_text_student(path, model=self.model, approx=approx, max_tokens=MAX_TOKENS)
        return student

    def _kept(self) -> tuple[Path, dict[str, Any]]:
        for path in sorted(Path(self.workdir).glob(KEPT_TEXT_STUDENTS)):
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True)
                report: dict[str, Any] = json.loads(saved["report"])
            except Exception:  # another file of that name: not this student
                continue
            settings = report.get("settings", {})
            if (
                report.get("model") == self.model
                and all(settings.get(key) == value for key, value in TEXT_SPLIT.items())
                and (settings.get("max_tokens"), settings.get("seed")) == (MAX_TOKENS, 0)
                and settings.get("distill_data") == "stdlib"
            ):
                return path, report
        raise ConfigError(
            f"no kept text student of {self.model!r} in {self.workdir}: the model owner makes "
            f"it offline first, with `{self.keep_command()}`"
        )


@functools.lru_cache(maxsize=2)
def _text_tokenizer(model: str) -> Any:
    """``model``'s tokenizer, checked against the model (loaded once per process: a data
    owner's process asks for the task and for the pad id)."""
    from fedfm.models.fhe_text import load_text_encoder

    return load_text_encoder(model)[1]
