"""Two-stage distillation of a ViT into its FHE-friendly student (spec ``001`` §3.1, App. E).

The same code distills a BERT-family text encoder (:mod:`fedfm.models.fhe_text`): every function
takes a model decomposed into embedding, blocks and head, and an input tensor (images, or
right-padded token ids, where ``images`` is written below).

Stage I (transformer-layer distillation) aligns, with MSE, the embedding output, every block's
un-normalised attention matrix (Eq. 12, averaged over heads) and every block's output hidden state
(Eq. 13); its loss is their sum (Eq. 14). Stage II (prediction-layer distillation) matches the
logits: cross-entropy on the labels plus ``tau**2`` times the KL divergence between the
temperature-softened teacher and student distributions (Eq. 15 with the CE + KL combination of
App. D.2; ``tau = 5``). Each stage takes half the epochs, with Adam at ``1e-4`` then ``1e-5``.

MSE here is the mean over elements (the paper writes squared norms); the scale only changes the
effective learning rate, so the reported losses are per element.

Training runs on the device the caller chooses (:mod:`fedfm.models.device`; data stay on the CPU
and move a batch at a time, so the shuffles do not depend on the device), optionally under mixed
precision; the student is back on the CPU when :func:`distill` returns.

Runs are resumable: after every epoch the student, optimizer, RNG and history are written to
``<workdir>/distill-state.pt``; a new run with the same settings continues from there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fedfm.approx.modules import calibrate, clamped_count, reset_clamped
from fedfm.distillation.training import batches, check_batch_size
from fedfm.errors import CheckpointError, ConfigError
from fedfm.models.device import MixedPrecision
from fedfm.models.intermediates import Intermediates

if TYPE_CHECKING:  # annotations only
    from fedfm.models.fhe_text import FheTextClassifier
    from fedfm.models.fhe_vit import FheViT

    # What distills: a model decomposed into embedding, blocks and head (images or token ids in)
    DistillableModel = FheViT | FheTextClassifier
from fedfm.models.foundation import load_state_strict, read_checkpoint, save_checkpoint

STATE_FORMAT = "fedfm-distill-state/1"


@dataclass(frozen=True)
class DistillConfig:
    """Distillation schedule. Defaults are App. D.2 scaled to a CPU (see README)."""

    epochs: int = 8
    batch_size: int = 16
    lr_stage1: float = 1e-4
    lr_stage2: float = 1e-5
    temperature: float = 5.0
    # None: every batch of D_aux. The division bounds are the largest values calibration sees,
    # and a client's data may exceed them only by the iteration's headroom (2x for Goldschmidt):
    # bounds from 8 batches of 16 let 6 of 719 pool images past it (digits, block 4's softmax),
    # where plaintext clamps and CKKS diverges.
    calibration_batches: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_batch_size(self.batch_size)
        if self.epochs < 2:
            raise ConfigError(f"distillation needs >= 2 epochs (one per stage), got {self.epochs}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if min(self.lr_stage1, self.lr_stage2) <= 0:
            raise ConfigError("learning rates must be > 0")
        if self.calibration_batches is not None and self.calibration_batches < 1:
            raise ConfigError("calibration needs at least one batch")

    @property
    def stage1_epochs(self) -> int:
        return self.epochs // 2


def layer_losses(student: Intermediates, teacher: Intermediates) -> dict[str, torch.Tensor]:
    """Stage I terms: embedding, attention (Eq. 12), hidden-state (Eq. 13) MSE over all blocks."""
    attention = sum(
        (
            F.mse_loss(s, t)
            for s, t in zip(student.attention_logits, teacher.attention_logits, strict=True)
        ),
        start=torch.zeros(()),
    )
    hidden = sum(
        (
            F.mse_loss(s, t)
            for s, t in zip(student.hidden_states, teacher.hidden_states, strict=True)
        ),
        start=torch.zeros(()),
    )
    return {
        "embedding": F.mse_loss(student.embedding, teacher.embedding),
        "attention": attention,
        "hidden": hidden,
    }


def prediction_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
) -> torch.Tensor:
    """Stage II: ``CE(z_S, y) + tau**2 * KL(softmax(z_T / tau) || softmax(z_S / tau))``."""
    soft_teacher = F.log_softmax(teacher_logits / temperature, dim=-1)
    soft_student = F.log_softmax(student_logits / temperature, dim=-1)
    kl = F.kl_div(soft_student, soft_teacher, log_target=True, reduction="batchmean")
    return F.cross_entropy(student_logits, labels) + temperature**2 * kl


def calibration_batches(images: torch.Tensor, config: DistillConfig) -> list[torch.Tensor]:
    """The first ``calibration_batches`` batches of the auxiliary images (all of them if None)."""
    out = []
    for batch_images, _ in batches(images, torch.zeros(len(images)), batch_size=config.batch_size):
        out.append(batch_images)
        if len(out) == config.calibration_batches:
            break
    return out


def run_epoch(
    student: DistillableModel,
    teacher: DistillableModel,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    stage: int,
    optimizer: torch.optim.Optimizer,
    config: DistillConfig,
    generator: torch.Generator,
    progress: bool = False,
    description: str = "",
    precision: MixedPrecision | None = None,
) -> dict[str, float]:
    """One epoch of stage 1 or 2; returns the mean of each loss term over the epoch.

    Batches go to the device of the student's parameters; ``precision`` (default off) wraps the
    forward passes.
    """
    device = next(student.parameters()).device
    precision = precision or MixedPrecision("off", device)
    student.train()
    teacher.eval()
    sums: dict[str, float] = {}
    seen = 0
    steps = -(-len(labels) // config.batch_size)
    for batch_images, batch_labels in tqdm(
        batches(images, labels, batch_size=config.batch_size, generator=generator),
        total=steps,
        desc=description,
        disable=not progress,
        leave=False,
    ):
        batch_images, batch_labels = batch_images.to(device), batch_labels.to(device)
        with precision.autocast():
            with torch.no_grad():
                target = teacher.forward_intermediates(batch_images)
            if stage == 1:
                terms = layer_losses(student.forward_intermediates(batch_images), target)
            else:
                terms = {
                    "prediction": prediction_loss(
                        student(batch_images),
                        target.logits,
                        batch_labels,
                        temperature=config.temperature,
                    )
                }
            loss = sum(terms.values(), start=torch.zeros(()))
        optimizer.zero_grad()
        precision.step(loss, optimizer)
        for key, value in {**terms, "total": loss}.items():
            sums[key] = sums.get(key, 0.0) + value.item() * len(batch_labels)
        seen += len(batch_labels)
    return {key: value / seen for key, value in sums.items()}


def _optimizer(
    student: DistillableModel, stage: int, config: DistillConfig
) -> torch.optim.Optimizer:
    lr = config.lr_stage1 if stage == 1 else config.lr_stage2
    return torch.optim.Adam(student.parameters(), lr=lr)


def distill(
    student: DistillableModel,
    teacher: DistillableModel,
    images: torch.Tensor,
    labels: torch.Tensor,
    config: DistillConfig,
    *,
    state_path: Path | None = None,
    run_settings: dict[str, Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    device: torch.device | None = None,
    precision: MixedPrecision | None = None,
) -> list[dict[str, Any]]:
    """Distill ``teacher`` into ``student`` in place; return one history row per epoch.

    Both models run on ``device`` (default: the CPU) and the student's training under
    ``precision`` (default: off); the student is on the CPU when this returns.

    ``teacher`` should be the teacher converted with exact non-linearities (so that its attention
    matrices are exposed). The student is calibrated on the auxiliary images before stage I and
    again before stage II. With ``state_path`` set, progress is saved after each epoch and an
    existing state with the same ``config`` and ``run_settings`` is resumed; a state made with
    other settings raises :class:`CheckpointError`.
    """
    device = device if device is not None else torch.device("cpu")
    precision = precision or MixedPrecision("off", device)
    student.to(device)
    teacher.to(device)
    generator = torch.Generator().manual_seed(config.seed)
    identity: dict[str, Any] = {"config": asdict(config), "run": run_settings or {}}
    if precision.enabled:  # mixed precision gives other weights: not a state to resume as fp32
        identity["precision"] = precision.mode
    history: list[dict[str, Any]] = []
    start_epoch = 0
    optimizer: torch.optim.Optimizer | None = None
    if state_path is not None and state_path.exists():
        state = read_checkpoint(state_path, expected_format=STATE_FORMAT)
        if state.get("identity") != identity:
            raise CheckpointError(
                f"{state_path} belongs to a distillation with other settings; "
                "use another --workdir or pass --restart to discard it"
            )
        load_state_strict(student, state["student"], source=f"distillation state {state_path}")
        history = list(state["history"])
        start_epoch = len(history)
        generator.set_state(state["generator"])
        last_stage = 1 if start_epoch <= config.stage1_epochs else 2
        optimizer = _optimizer(student, last_stage, config)
        optimizer.load_state_dict(state["optimizer"])
        log(
            f"[fedfm] distill: resuming from {state_path} after epoch {start_epoch}/{config.epochs}"
        )
    calibration = [batch.to(device) for batch in calibration_batches(images, config)]
    if start_epoch == 0:
        calibrate(student, calibration)

    for epoch in range(start_epoch, config.epochs):
        stage = 1 if epoch < config.stage1_epochs else 2
        if optimizer is None or (epoch == config.stage1_epochs and stage == 2):
            if stage == 2:
                # Stage I moved the weights: re-fix the division bounds before stage II.
                calibrate(student, calibration)
            optimizer = _optimizer(student, stage, config)
        reset_clamped(student)
        losses = run_epoch(
            student,
            teacher,
            images,
            labels,
            stage=stage,
            optimizer=optimizer,
            config=config,
            generator=generator,
            progress=progress,
            description=f"distill epoch {epoch + 1}/{config.epochs} (stage {stage})",
            precision=precision,
        )
        row = {"epoch": epoch + 1, "stage": stage, **losses, "clamped": clamped_count(student)}
        history.append(row)
        if state_path is not None:
            save_checkpoint(
                state_path,
                {
                    "format": STATE_FORMAT,
                    "identity": identity,
                    "student": student.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "generator": generator.get_state(),
                    "history": history,
                },
            )
        log(
            f"[fedfm] distill epoch {epoch + 1}/{config.epochs} stage {stage}: "
            + ", ".join(f"{k}={v:.4g}" for k, v in losses.items())
        )
    # Final bounds reflect the final weights; the encrypted evaluator uses these.
    calibrate(student, calibration)
    student.eval().cpu()
    teacher.cpu()
    return history
