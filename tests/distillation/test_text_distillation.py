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
        holder = run.distill if hasattr(run.distill, name) else run
        assert getattr(holder, name) == value, name


def test_unknown_distillation_data_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown distillation data 'photos'"):
        TextDistillRun(distill_data="photos")


def test_a_missing_model_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    missing = tmp_path / "no-such-encoder"
    assert main(["distill-text", "--model", str(missing), "--results-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fedfm: error: text encoder") and "not available" in error
    assert not (tmp_path / "text_distillation.json").exists()
