"""Two-stage distillation: losses go down, runs resume exactly, states and settings are checked.

Everything runs on a tiny ViT (16x16 digits, patch 4, width 32, depth 2) whose teacher is
pretrained once per module for about a second, so the whole file takes a few seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import fedfm.distillation.distill
from fedfm.approx import ApproxConfig, calibrate
from fedfm.approx.modules import calibrated_modules
from fedfm.data import DataSplits, load_splits
from fedfm.distillation.distill import (
    STATE_FORMAT,
    DistillConfig,
    calibration_batches,
    distill,
    layer_losses,
    prediction_loss,
    run_epoch,
)
from fedfm.distillation.training import PretrainConfig, pretrain, score
from fedfm.errors import CheckpointError, ConfigError
from fedfm.models import FheViT, to_fhe_friendly
from fedfm.models.foundation import read_checkpoint, save_checkpoint

DEPTH = 2
CONFIG = DistillConfig(epochs=4, batch_size=16, calibration_batches=4)
STAGE1_TERMS = ("embedding", "attention", "hidden")


@dataclass(frozen=True)
class Setup:
    """D_aux and a teacher, as timm ViT and as the exact FHE-friendly model distillation uses."""

    splits: DataSplits
    teacher_vit: VisionTransformer
    teacher: FheViT


@dataclass(frozen=True)
class Finished:
    """The result of an uninterrupted distillation run."""

    state: dict[str, torch.Tensor]
    history: list[dict[str, Any]]


class Log:
    """A ``log`` callback that records messages and can interrupt the run like Ctrl-C."""

    def __init__(self, *, interrupt_at_epoch: int | None = None) -> None:
        self.messages: list[str] = []
        self.interrupt_at_epoch = interrupt_at_epoch

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        at = self.interrupt_at_epoch
        if at is not None and message.startswith(f"[fedfm] distill epoch {at}/"):
            raise KeyboardInterrupt

    def epoch_messages(self) -> list[str]:
        return [m for m in self.messages if m.startswith("[fedfm] distill epoch")]


class InterruptAfterSaves:
    """Stands in for ``save_checkpoint`` in ``fedfm.distillation.distill``: saves, then Ctrl-C
    after ``saves``.

    Interrupting right after a save does not depend on where ``distill`` logs an epoch.
    """

    def __init__(self, saves: int) -> None:
        self.saves = saves
        self.count = 0

    def __call__(self, path: Path, payload: dict[str, Any]) -> None:
        save_checkpoint(path, payload)
        self.count += 1
        if self.count == self.saves:
            raise KeyboardInterrupt


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup() -> Setup:
    splits = load_splits("digits", image_size=16, seed=0, max_samples=200)
    torch.manual_seed(0)
    vit = VisionTransformer(
        img_size=16,
        patch_size=4,
        embed_dim=32,
        depth=DEPTH,
        num_heads=2,
        mlp_ratio=2.0,
        num_classes=splits.aux.num_classes,
    )
    # Long enough for confident logits: with a near-uniform teacher the KL term of stage II
    # vanishes and the prediction loss is just the cross-entropy of an untrained classifier.
    pretrain(
        vit,
        splits.aux.images,
        splits.aux.labels,
        PretrainConfig(epochs=40, batch_size=16, lr=3e-3, shift_pixels=0),
        progress=False,
    )
    vit.eval()
    return Setup(splits, vit, to_fhe_friendly(vit, ApproxConfig.exact()).eval())


def new_student(setup: Setup) -> FheViT:
    """A fresh, uncalibrated student with the default approximations (every bound used)."""
    return to_fhe_friendly(setup.teacher_vit, ApproxConfig())


def calibrated_student(setup: Setup, config: DistillConfig = CONFIG) -> FheViT:
    student = new_student(setup)
    calibrate(student, calibration_batches(setup.splits.aux.images, config))
    return student


def run_distill(
    setup: Setup,
    student: FheViT,
    config: DistillConfig = CONFIG,
    *,
    state_path: Path | None = None,
    run_settings: dict[str, Any] | None = None,
    log: Log | None = None,
) -> list[dict[str, Any]]:
    aux = setup.splits.aux
    return distill(
        student,
        setup.teacher,
        aux.images,
        aux.labels,
        config,
        state_path=state_path,
        run_settings=run_settings,
        progress=False,
        log=log if log is not None else Log(),
    )


def train_stage(
    setup: Setup, student: FheViT, *, stage: int, epochs: int, config: DistillConfig
) -> list[dict[str, float]]:
    """``epochs`` epochs of one stage with one optimizer, as ``distill`` runs them."""
    aux = setup.splits.aux
    lr = config.lr_stage1 if stage == 1 else config.lr_stage2
    optimizer = torch.optim.Adam(student.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(config.seed)
    return [
        run_epoch(
            student,
            setup.teacher,
            aux.images,
            aux.labels,
            stage=stage,
            optimizer=optimizer,
            config=config,
            generator=generator,
        )
        for _ in range(epochs)
    ]


@torch.no_grad()
def aux_losses(setup: Setup, student: FheViT, *, temperature: float) -> dict[str, float]:
    """Stage-I terms, their sum and the stage-II loss of ``student`` on all of D_aux (eval mode)."""
    student.eval()
    aux = setup.splits.aux
    mine = student.forward_intermediates(aux.images)
    target = setup.teacher.forward_intermediates(aux.images)
    terms = {key: float(value) for key, value in layer_losses(mine, target).items()}
    terms["stage1"] = sum(terms[key] for key in STAGE1_TERMS)
    terms["prediction"] = float(
        prediction_loss(mine.logits, target.logits, aux.labels, temperature=temperature)
    )
    return terms


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    different = [
        key
        for key in expected
        if not torch.allclose(actual[key], expected[key], rtol=0.0, atol=1e-6, equal_nan=True)
    ]
    assert not different, f"tensors differ after resuming: {different}"


def bounds(student: FheViT) -> torch.Tensor:
    return torch.stack([module.input_bound.clone() for module in calibrated_modules(student)])


@pytest.fixture(scope="module")
def reference(setup: Setup) -> Finished:
    """A full run without any state file: what every resumed run must reproduce."""
    student = new_student(setup)
    history = run_distill(setup, student)
    return Finished(clone_state(student), history)


# --- the fixture itself -----------------------------------------------------------------------


def test_teacher_is_trained_enough_for_the_stage_two_test(setup: Setup) -> None:
    aux = setup.splits.aux
    assert score(setup.teacher_vit, aux.images, aux.labels).accuracy > 0.6
    # The exact FHE-friendly model is the teacher, computed through the explicit attention path.
    with torch.no_grad():
        torch.testing.assert_close(setup.teacher(aux.images), setup.teacher_vit(aux.images))


# --- the two stages reduce their losses ---------------------------------------------------------


def test_stage_one_reduces_embedding_attention_hidden_loss(setup: Setup) -> None:
    student = calibrated_student(setup)
    teacher_before = clone_state(setup.teacher)
    before = aux_losses(setup, student, temperature=CONFIG.temperature)
    assert before["stage1"] > 0  # the approximations do change the intermediates

    rows = train_stage(setup, student, stage=1, epochs=4, config=CONFIG)
    calibrate(student, calibration_batches(setup.splits.aux.images, CONFIG))  # as distill does
    after = aux_losses(setup, student, temperature=CONFIG.temperature)

    assert set(rows[0]) == {*STAGE1_TERMS, "total"}
    assert rows[0]["total"] == pytest.approx(sum(rows[0][key] for key in STAGE1_TERMS))
    assert rows[-1]["total"] < rows[0]["total"]
    assert after["stage1"] < 0.7 * before["stage1"], (before, after)
    assert after["hidden"] < 0.7 * before["hidden"], (before, after)
    assert_same_state(clone_state(setup.teacher), teacher_before)  # only the student learns


def test_stage_two_reduces_prediction_loss(setup: Setup) -> None:
    config = replace(CONFIG, lr_stage2=1e-4)  # 1e-5 needs more epochs than a unit test affords
    student = calibrated_student(setup, config)
    before = aux_losses(setup, student, temperature=config.temperature)

    rows = train_stage(setup, student, stage=2, epochs=4, config=config)
    after = aux_losses(setup, student, temperature=config.temperature)

    assert set(rows[0]) == {"prediction", "total"}
    assert rows[0]["total"] == rows[0]["prediction"]
    assert rows[-1]["prediction"] < rows[0]["prediction"]
    # measured 0.717 of the loss before on 2026-11-28 (torch 2.14.1, 2 threads); the earlier
    # bound 0.7 sat at that edge and failed there. A stage that did not learn stays near 1.
    assert after["prediction"] < 0.8 * before["prediction"], (before, after)


def test_prediction_loss_is_cross_entropy_plus_scaled_kl() -> None:
    generator = torch.Generator().manual_seed(0)
    teacher_logits = torch.randn(6, 10, generator=generator) * 3
    student_logits = torch.randn(6, 10, generator=generator) * 3
    labels = torch.arange(6)
    tau = 5.0
    p_teacher = (teacher_logits / tau).softmax(dim=-1)
    kl = (p_teacher * (p_teacher.log() - (student_logits / tau).log_softmax(dim=-1))).sum() / 6
    expected = torch.nn.functional.cross_entropy(student_logits, labels) + tau**2 * kl
    actual = prediction_loss(student_logits, teacher_logits, labels, temperature=tau)
    torch.testing.assert_close(actual, expected)
    # A student that copies the teacher pays only the cross-entropy.
    torch.testing.assert_close(
        prediction_loss(teacher_logits, teacher_logits, labels, temperature=tau),
        torch.nn.functional.cross_entropy(teacher_logits, labels),
    )


# --- the run as a whole ---------------------------------------------------------------------------


def test_history_has_half_the_epochs_per_stage(reference: Finished) -> None:
    assert [row["epoch"] for row in reference.history] == [1, 2, 3, 4]
    assert [row["stage"] for row in reference.history] == [1, 1, 2, 2]
    assert set(reference.history[0]) == {"epoch", "stage", *STAGE1_TERMS, "total", "clamped"}
    assert set(reference.history[-1]) == {"epoch", "stage", "prediction", "total", "clamped"}


def test_distilled_student_has_bounds_calibrated_on_its_final_weights(setup: Setup) -> None:
    student = new_student(setup)
    assert torch.isnan(bounds(student)).all()  # nothing calibrated yet

    run_distill(setup, student, replace(CONFIG, epochs=2))

    final = bounds(student)
    assert len(final) == 3 * DEPTH + 1  # per block: norm1, softmax, norm2; then the final norm
    assert torch.isfinite(final).all() and (final > 0).all(), final
    assert not student.training
    # Recalibrating the final weights changes nothing: the last calibration came after training.
    calibrate(student, calibration_batches(setup.splits.aux.images, CONFIG))
    assert torch.equal(bounds(student), final)


def test_default_calibration_sees_every_auxiliary_image() -> None:
    images = torch.arange(37.0).reshape(37, 1)
    default = calibration_batches(images, DistillConfig(batch_size=8))
    assert torch.equal(torch.cat(default).sort(dim=0).values, images)
    first_two = calibration_batches(images, DistillConfig(batch_size=8, calibration_batches=2))
    assert sum(len(batch) for batch in first_two) == 16


# --- resuming ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "finished_epochs", [1, 2, 3], ids=["mid-stage-1", "stage-boundary", "mid-stage-2"]
)
def test_interrupted_run_resumes_to_the_uninterrupted_result(
    setup: Setup,
    reference: Finished,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    finished_epochs: int,
) -> None:
    path = tmp_path / "distill-state.pt"
    with monkeypatch.context() as patch:
        patch.setattr(
            fedfm.distillation.distill, "save_checkpoint", InterruptAfterSaves(finished_epochs)
        )
        with pytest.raises(KeyboardInterrupt):
            run_distill(setup, new_student(setup), state_path=path)
    saved = read_checkpoint(path, expected_format=STATE_FORMAT)
    assert saved["history"] == reference.history[:finished_epochs]

    log = Log()
    student = new_student(setup)  # fresh weights: everything must come from the state file
    history = run_distill(setup, student, state_path=path, log=log)

    assert log.messages[0] == (
        f"[fedfm] distill: resuming from {path} after epoch {finished_epochs}/{CONFIG.epochs}"
    )
    assert len(log.epoch_messages()) == CONFIG.epochs - finished_epochs
    assert history == reference.history
    assert_same_state(clone_state(student), reference.state)


def test_interrupt_while_an_epoch_is_logged_keeps_that_epoch(
    setup: Setup, reference: Finished, tmp_path: Path
) -> None:
    """Ctrl-C during the log line of epoch 1 (e.g. a slow terminal) must not lose epoch 1."""
    path = tmp_path / "distill-state.pt"
    with pytest.raises(KeyboardInterrupt):
        run_distill(setup, new_student(setup), state_path=path, log=Log(interrupt_at_epoch=1))
    saved = read_checkpoint(path, expected_format=STATE_FORMAT)
    assert saved["history"] == reference.history[:1]


def test_rerunning_a_finished_run_trains_nothing(
    setup: Setup, reference: Finished, tmp_path: Path
) -> None:
    path = tmp_path / "distill-state.pt"
    run_distill(setup, new_student(setup), state_path=path)

    log = Log()
    student = new_student(setup)
    history = run_distill(setup, student, state_path=path, log=log)

    assert log.epoch_messages() == []
    assert f"after epoch {CONFIG.epochs}/{CONFIG.epochs}" in log.messages[0]
    assert history == reference.history
    assert_same_state(clone_state(student), reference.state)


@pytest.mark.parametrize("changed", ["config", "run_settings"])
def test_state_made_with_other_settings_is_refused(
    setup: Setup, tmp_path: Path, changed: str
) -> None:
    path = tmp_path / "distill-state.pt"
    config = replace(CONFIG, epochs=2)
    run_distill(setup, new_student(setup), config, state_path=path, run_settings={"data": "a"})
    saved = path.read_bytes()

    if changed == "config":
        other_config, other_settings = replace(config, lr_stage1=3e-4), {"data": "a"}
    else:
        other_config, other_settings = config, {"data": "b"}
    with pytest.raises(CheckpointError, match="--restart") as error:
        run_distill(
            setup, new_student(setup), other_config, state_path=path, run_settings=other_settings
        )
    assert str(path) in str(error.value)
    assert path.read_bytes() == saved  # the refused state is left alone


@pytest.mark.parametrize(
    ("damage", "message"),
    [("random_bytes", "corrupt"), ("truncated", "corrupt"), ("other_format", "format")],
)
def test_unreadable_state_raises_checkpoint_error(
    setup: Setup, tmp_path: Path, damage: str, message: str
) -> None:
    path = tmp_path / "distill-state.pt"
    if damage == "random_bytes":
        path.write_bytes(random.Random(0).randbytes(4096))
    elif damage == "truncated":
        run_distill(setup, new_student(setup), replace(CONFIG, epochs=2), state_path=path)
        content = path.read_bytes()
        path.write_bytes(content[: len(content) // 2])
    else:
        torch.save({"format": "something-else/1", "history": []}, path)

    with pytest.raises(CheckpointError, match=message) as error:
        run_distill(setup, new_student(setup), state_path=path)
    assert str(path) in str(error.value)


# --- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"batch_size": 0}, "batch size"),
        ({"batch_size": -4}, "batch size"),
        ({"epochs": 1}, ">= 2 epochs"),
        ({"epochs": 0}, ">= 2 epochs"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -5.0}, "temperature"),
        ({"lr_stage1": 0.0}, "learning rates"),
        ({"lr_stage2": -1e-5}, "learning rates"),
        ({"calibration_batches": 0}, "calibration"),
    ],
)
def test_invalid_config_raises_config_error(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DistillConfig(**settings)


@pytest.mark.parametrize(("epochs", "stage1"), [(2, 1), (3, 1), (8, 4)])
def test_stage_one_takes_half_the_epochs_rounded_down(epochs: int, stage1: int) -> None:
    assert DistillConfig(epochs=epochs).stage1_epochs == stage1
