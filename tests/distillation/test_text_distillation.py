"""``fedfm distill-text``: its options follow one table of defaults; bad input is one line."""

from __future__ import annotations

import pytest

from fedfm.cli import build_parser, main
from fedfm.distillation.text import TextDistillRun
from fedfm.distillation.text_defaults import TEXT_DISTILL_DEFAULTS
from fedfm.errors import ConfigError


def test_command_and_run_take_their_defaults_from_the_table() -> None:
    args = build_parser().parse_args(["distill-text"])
    run = TextDistillRun()
    for name, value in TEXT_DISTILL_DEFAULTS._asdict().items():
        if hasattr(args, name):
            assert getattr(args, name) == value, name
        holder = next(h for h in (run.distill, run.approx, run) if hasattr(h, name))
        assert getattr(holder, name) == value, name


def test_gelu_options_reach_the_run(monkeypatch) -> None:
    import fedfm.experiments.text_distillation as experiment

    seen = []
    monkeypatch.setattr(
        experiment, "run_text_distillation_experiment", lambda run, **_: seen.append(run)
    )
    assert (
        main(["distill-text", "--gelu-degree", "0", "--distill-texts", "50", "--no-ablation"]) == 0
    )
    assert main(["distill-text", "--gelu-degree", "2", "--no-gelu-channel-scale"]) == 0
    quad, fitted = (run.approx.build() for run in seen)
    assert quad.gelu is not None and quad.gelu.name == "gelu_quad" and not quad.gelu_channel_scale
    assert seen[0].distill_texts == 50 and not seen[0].ablation
    assert fitted.gelu is not None and fitted.gelu.degree == 2 and not fitted.gelu_channel_scale
    assert seen[1].ablation


def test_the_adapted_students_split_is_one_command_line(monkeypatch) -> None:
    """``fedfm paper-text``'s student, distilled on more texts, is a ``distill-text`` run."""
    from dataclasses import replace

    import fedfm.experiments.text_distillation as experiment
    from fedfm.data.text_task import TEXT_SPLIT
    from fedfm.distillation.text import student_run

    seen = []
    monkeypatch.setattr(
        experiment, "run_text_distillation_experiment", lambda run, **_: seen.append(run)
    )
    line = ["distill-text", "--distill-texts", "960", "--no-ablation"]
    for name, value in TEXT_SPLIT.items():
        line += [f"--{name.replace('_', '-')}", str(value)]
    assert main(line) == 0
    assert seen == [replace(student_run("minilm"), distill_texts=960)]


def test_too_few_distillation_texts_are_refused() -> None:
    with pytest.raises(ConfigError, match="distill_texts must be >= 1"):
        TextDistillRun(distill_texts=0)


def test_unknown_distillation_data_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown distillation data 'photos'"):
        TextDistillRun(distill_data="photos")


def test_a_missing_model_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    missing = tmp_path / "no-such-encoder"
    assert main(["distill-text", "--model", str(missing), "--results-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fedfm: error: text encoder") and "not available" in error
    assert not (tmp_path / "text_distillation.json").exists()
