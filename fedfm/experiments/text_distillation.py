"""``fedfm distill-text``: teacher (BERT-family encoder + linear head) vs its FHE-friendly student.

Runs :func:`fedfm.distillation.text.run_text_distillation` and writes
``results/text_distillation.json`` and ``.md`` (plaintext torch, no encryption).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedfm.distillation.text import TextDistillRun, run_text_distillation
from fedfm.experiments.results import write_results

GOAL_POINTS = 3.0


def run_text_distillation_experiment(
    run: TextDistillRun,
    *,
    results_dir: Path = Path("results"),
    command: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Distill, score and write the results; return the report."""
    report, _ = run_text_distillation(run, progress=progress)
    rows = [
        {
            "model": "teacher (exact encoder + logistic-regression head)",
            "accuracy": report["teacher_accuracy"],
        },
        {
            "model": "FHE-friendly student, calibrated, not distilled",
            "accuracy": report["undistilled_student_accuracy"],
        },
        {"model": "FHE-friendly student, distilled", "accuracy": report["student_accuracy"]},
        {
            "model": "distilled student with exact non-linearities",
            "accuracy": report["exact_student_accuracy"],
        },
    ]
    rows += [
        {"model": f"teacher's weights, only {name} approximated (calibrated, not distilled)",
         "accuracy": accuracy}
        for name, accuracy in report["one_approximation_accuracy"].items()
    ]  # fmt: skip
    sizes = report["split_sizes"]
    architecture = report["architecture"]
    description = (
        f"Standard-library docstrings by module family ({len(report['classes'])} classes), "
        f"{architecture['max_tokens']} tokens, test accuracy on {sizes['test']} held-out texts. "
        f"Encoder {report['model']} ({architecture['type']}, {architecture['blocks']} blocks, "
        f"width {architecture['width']}, {architecture['heads']} heads). Teacher head fitted on "
        f"D_aux ({sizes['aux']} texts); student distilled on {report['distill_data']} "
        f"({sizes['distilled_on']} texts) for {run.distill.epochs} epochs (half per stage), "
        "a CPU-budget run: far fewer texts and epochs than App. D.2. Approximations: "
        f"{run.approx}. Goal: student within {GOAL_POINTS:g} points of the teacher: "
        f"{'met' if report['within_3_points'] else 'NOT met'} "
        f"(gap {report['accuracy_gap_points']:.1f} points). Plaintext torch, no encryption."
    )
    write_results(
        results_dir,
        "text_distillation",
        title="FHE-friendly text encoder: two-stage distillation",
        description=description,
        rows=rows,
        columns=[("model", "model"), ("accuracy", "test accuracy")],
        extra={"report": report},
        command=command,
    )
    return report
