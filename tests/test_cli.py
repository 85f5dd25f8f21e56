"""The ``fedfm`` command line: one-line errors with exit status 2, and small real runs end to end.

Every run writes only below pytest's temporary directories (``--workdir``, ``--cache-dir``,
``--results-dir``). The end-to-end runs use 16x16 digits, at most 60 samples per split and two
epochs everywhere; one teacher is pretrained for the whole module and then reused from the cache.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import fedfm.distillation.pipeline
from fedfm.cli import main
from fedfm.data import DataSplits, load_splits
from fedfm.distillation.pipeline import (
    ApproxSettings,
    DistillRun,
    load_data,
    load_student,
    save_student,
)
from fedfm.distillation.training import predict
from fedfm.errors import CheckpointError, ConfigError
from fedfm.models import FheViT, ModelSpec, to_fhe_friendly

TINY = [
    "--max-samples", "60",
    "--teacher-epochs", "2",
    "--epochs", "2",
    "--batch-size", "16",
    "--image-size", "16",
    "--no-progress",
]  # fmt: skip
TIMM_VIT = "vit_tiny_patch16_224"
REPORT_KEYS = {
    "teacher_accuracy",
    "student_accuracy",
    "exact_student_accuracy",
    "distill_history",
    "input_bounds",
    "model",
    "split_sizes",
}


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str


@dataclass(frozen=True)
class EndToEnd:
    """The first ``fedfm distill`` of the module (it pretrains the shared teacher)."""

    argv: list[str]
    workdir: Path
    cache_dir: Path
    result: Result
    report: dict[str, Any]
    student: FheViT  # the object the pipeline saved, captured in-process


def command(name: str, tmp: Path, *options: str, cache_dir: Path | None = None) -> list[str]:
    """``fedfm <name> <options>`` with every output directory inside ``tmp``."""
    argv = [name, *options, "--workdir", str(tmp / "work")]
    argv += ["--cache-dir", str(cache_dir if cache_dir is not None else tmp / "cache")]
    if name in {"sweep", "bench"}:
        argv += ["--results-dir", str(tmp / "results")]
    return argv


def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> Result:
    code = main(list(argv))
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def error_line(result: Result) -> str:
    """The one line a refused command prints; fails unless exit status and format are right."""
    assert "Traceback" not in result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("fedfm: error: "), lines[0]
    assert result.code == 2, result
    return lines[0]


def tiny_splits() -> DataSplits:
    return load_splits("digits", image_size=16, seed=0, max_samples=60)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity, which are not JSON (RFC 8259)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not valid JSON")

    return json.loads(text, parse_constant=refuse)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> EndToEnd:
    tmp = tmp_path_factory.mktemp("e2e")
    cache_dir = tmp / "cache"
    argv = command("distill", tmp, *TINY, cache_dir=cache_dir)
    saved: list[FheViT] = []

    def capture(path: Path, student: FheViT, spec: ModelSpec, settings: ApproxSettings) -> None:
        saved.append(student)
        save_student(path, student, spec, settings)

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fedfm.distillation.pipeline, "save_student", capture)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    result = Result(code, out.getvalue(), err.getvalue())
    assert code == 0, result
    assert len(saved) == 1
    report = read_json(tmp / "work" / "report.json")
    return EndToEnd(argv, tmp / "work", cache_dir, result, report, saved[0])


# --- refused input: exit status 2, one line, no traceback ----------------------------------------


@pytest.mark.parametrize(
    "name_and_options", [["distill"], ["sweep", "--kind", "exp"], ["bench"]], ids=lambda v: v[0]
)
def test_unknown_model_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name_and_options: list[str]
) -> None:
    name, *options = name_and_options
    result = run_cli(command(name, tmp_path, *options, "--model", "vit_nope"), capsys)
    line = error_line(result)
    assert "unknown model 'vit_nope'" in line
    assert not (tmp_path / "results").exists()
    assert not (tmp_path / "cache").exists()


def test_missing_dataset_folder_names_the_expected_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "data"
    root.mkdir()
    argv = command("distill", tmp_path, "--dataset", "cifar10", "--data-root", str(root))
    line = error_line(run_cli(argv, capsys))
    assert f"{root}/cifar-10-batches-py/" in line
    assert "never downloads" in line


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--exp-degree", "0"], "exp degree"),
        (["--inverse-iterations", "0"], "inverse iterations"),
        (["--inv-sqrt-iterations", "0"], "inverse-sqrt iterations"),
        (["--batch-size", "0"], "batch size"),
        (["--epochs", "1"], ">= 2 epochs"),
        (["--temperature", "0"], "temperature"),
        (["--teacher-epochs", "0"], "teacher epochs"),
        (["--max-samples", "0"], "max_samples"),
    ],
)
def test_invalid_setting_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    line = error_line(run_cli(command("distill", tmp_path, *options), capsys))
    assert message in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "--kind", "exp", "--values", "0"], "exp degree"),
        (["sweep", "--kind", "inverse", "--values", "0"], "inverse iterations"),
        (["bench", "--bench-batch-size", "0"], "batch size"),
        (["bench", "--repeats", "0", "--max-samples", "20", "--image-size", "16"], "repeats"),
    ],
)
def test_invalid_sweep_and_bench_settings_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    name, *options = argv
    line = error_line(run_cli(command(name, tmp_path, *options), capsys))
    assert message in line
    assert not (tmp_path / "results").exists()


def test_malformed_argument_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(command("distill", tmp_path, "--exp-degree", "six"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--exp-degree: expected an integer or 'exact', got 'six'" in err
    assert "Traceback" not in err


def test_corrupt_distillation_state_is_named_and_restart_discards_it(
    e2e: EndToEnd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "work" / "distill-state.pt"
    state.parent.mkdir()
    state.write_bytes(random.Random(0).randbytes(2048))
    argv = command("distill", tmp_path, *TINY, cache_dir=e2e.cache_dir)

    line = error_line(run_cli(argv, capsys))
    assert str(state) in line
    assert "corrupt" in line
    assert state.exists()  # never deleted behind the user's back

    restarted = run_cli([*argv, "--restart"], capsys)
    assert restarted.code == 0, restarted
    assert "teacher: loading cached" in restarted.out
    report = read_json(tmp_path / "work" / "report.json")
    assert report["distill_history"] == e2e.report["distill_history"]


def test_garbage_weights_file_fails_fast_without_network(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = tmp_path / "weights.pth"
    weights.write_bytes(random.Random(1).randbytes(4096))
    options = ["--model", TIMM_VIT, "--checkpoint", str(weights), "--image-size", "32"]
    attempts: list[object] = []

    def no_network(self: socket.socket, address: object) -> None:
        attempts.append(address)
        raise OSError("the test forbids network access")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    result = run_cli(command("distill", tmp_path, *options, "--max-samples", "40"), capsys)
    line = error_line(result)
    assert f"could not load pretrained weights for '{TIMM_VIT}' from file {weights}" in line
    assert attempts == []  # fast: a local file's error, no hub round trip


def test_missing_weights_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = tmp_path / "absent.pth"
    options = ["--model", TIMM_VIT, "--checkpoint", str(weights), "--image-size", "32"]
    result = run_cli(command("distill", tmp_path, *options, "--max-samples", "40"), capsys)
    line = error_line(result)
    assert f"weights file {weights} does not exist" in line


def test_student_checkpoint_of_another_architecture_does_not_match(tmp_path: Path) -> None:
    declared = ModelSpec("vit_fedfm_tiny", 10, 16)
    torch.manual_seed(0)
    other = to_fhe_friendly(ModelSpec("vit_fedfm_small", 10, 16).build(), ApproxSettings().build())
    path = tmp_path / "student.pt"
    save_student(path, other, declared, ApproxSettings())
    with pytest.raises(CheckpointError, match="does not match") as error:
        load_student(path)
    assert str(path) in str(error.value)


def test_corrupt_student_checkpoint_is_named(tmp_path: Path) -> None:
    path = tmp_path / "student.pt"
    path.write_bytes(random.Random(2).randbytes(1024))
    with pytest.raises(CheckpointError, match="corrupt") as error:
        load_student(path)
    assert str(path) in str(error.value)


def test_student_with_bounds_from_part_of_d_aux_is_refused_with_the_remedy(
    tmp_path: Path,
) -> None:
    declared = ModelSpec("vit_fedfm_tiny", 10, 16)
    torch.manual_seed(0)
    student = to_fhe_friendly(declared.build(), ApproxSettings().build())
    path = tmp_path / "student.pt"
    save_student(path, student, declared, ApproxSettings())
    payload = torch.load(path, weights_only=True)
    payload["format"] = "fedfm-student/1"  # as the versions before full-D_aux calibration wrote
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match="retired format") as error:
        load_student(path)
    assert "fedfm distill --restart" in str(error.value)
    assert str(path) in str(error.value)


# --- the installed console script ------------------------------------------------------------


def fedfm_script() -> str:
    script = shutil.which("fedfm", path=str(Path(sys.executable).parent))
    assert script is not None, "the fedfm console script is not installed next to the interpreter"
    return script


def test_console_script_timm_model_offline_fails_fast_with_one_line(tmp_path: Path) -> None:
    # Without HF_HUB_OFFLINE the hub client retries each weight file 5 times with back-off
    # (about 50 s without DNS) and prints a warning line per retry; offline it fails at once.
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),  # no cached weights can make the download succeed
        "OMP_NUM_THREADS": "1",
    }
    argv = command("distill", tmp_path, "--model", TIMM_VIT, "--image-size", "32")
    completed = subprocess.run(
        [fedfm_script(), *argv, "--max-samples", "40", "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    line = error_line(Result(completed.returncode, completed.stdout, completed.stderr))
    assert f"could not load pretrained weights for '{TIMM_VIT}' from the Hugging Face hub" in line
    assert "--checkpoint" in line
    # fast means no network attempt: no retry warnings (a wall-clock bound flaked under load)
    assert "retry" not in (completed.stdout + completed.stderr).lower()


# --- a small real run ------------------------------------------------------------------------


def test_distill_writes_student_and_report(e2e: EndToEnd) -> None:
    assert "teacher: pretraining embedded vit_fedfm_tiny" in e2e.result.out
    assert (e2e.workdir / "student.pt").is_file()
    report = e2e.report
    assert report.keys() >= REPORT_KEYS
    assert report["model"] == {"name": "vit_fedfm_tiny", "num_classes": 10, "img_size": 16}
    assert [row["epoch"] for row in report["distill_history"]] == [1, 2]
    assert [row["stage"] for row in report["distill_history"]] == [1, 2]
    assert "hidden" in report["distill_history"][0]
    assert "prediction" in report["distill_history"][1]
    for key in ("teacher_accuracy", "student_accuracy", "exact_student_accuracy"):
        assert 0.0 <= report[key] <= 1.0
    assert all(size <= 60 for size in report["split_sizes"].values())
    strict_json((e2e.workdir / "report.json").read_text())  # default approximations: no NaN


def test_saved_student_reproduces_in_process_predictions(e2e: EndToEnd) -> None:
    test = tiny_splits().test
    loaded = load_student(e2e.workdir / "student.pt")
    with torch.no_grad():
        torch.testing.assert_close(loaded(test.images), e2e.student.eval()(test.images))
    predicted = predict(loaded, test.images)
    assert torch.equal(predicted, predict(e2e.student, test.images))
    accuracy = float((predicted == test.labels).float().mean())
    assert accuracy == pytest.approx(e2e.report["student_accuracy"])


def test_second_identical_run_reuses_teacher_and_finished_state(
    e2e: EndToEnd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "work"
    shutil.copytree(e2e.workdir, workdir)
    argv = command("distill", tmp_path, *TINY, cache_dir=e2e.cache_dir)

    result = run_cli(argv, capsys)

    assert result.code == 0, result
    assert "teacher: loading cached" in result.out
    assert "pretraining" not in result.out
    assert "after epoch 2/2" in result.out
    assert "distill epoch" not in result.out  # nothing trained again
    assert len(list(e2e.cache_dir.glob("teacher-*.pt"))) == 1
    report = read_json(workdir / "report.json")
    assert report["distill_history"] == e2e.report["distill_history"]
    assert report["student_accuracy"] == e2e.report["student_accuracy"]
    first = torch.load(e2e.workdir / "student.pt", weights_only=True)["state_dict"]
    second = torch.load(workdir / "student.pt", weights_only=True)["state_dict"]
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_sweep_writes_one_row_per_value(
    e2e: EndToEnd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["--kind", "exp", "--values", "2", "exact", *TINY]
    result = run_cli(command("sweep", tmp_path, *options, cache_dir=e2e.cache_dir), capsys)

    assert result.code == 0, result
    assert "teacher: loading cached" in result.out  # same cache key as `fedfm distill`
    payload = strict_json((tmp_path / "results" / "approx_sweep_exp.json").read_text())
    rows = payload["rows"]
    assert [row["exp"] for row in rows] == [2, "exact"]
    assert [row["depth"] for row in rows] == [2, None]
    for row in rows:
        assert 0.0 <= row["one_epoch_accuracy"] <= 1.0
        assert row["latency_ms_per_batch"] > 0 and row["activation_mib_per_batch"] > 0
        if Path("/proc/self/clear_refs").exists():  # measured in a fresh process on Linux
            assert isinstance(row["peak_step_mib"], float) and row["peak_step_mib"] >= 0
    # The exact student computes what the teacher does, so stage I has nothing to learn.
    assert rows[1]["attention_loss"] < 1e-10 and rows[1]["representation_loss"] < 1e-10
    assert rows[0]["representation_loss"] > 1e-6
    markdown = (tmp_path / "results" / "approx_sweep_exp.md").read_text()
    assert "| exp degree d | mult. depth |" in markdown
    assert "| exact | - |" in markdown


def test_bench_writes_three_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = [*TINY, "--repeats", "2"]
    result = run_cli(command("bench", tmp_path, *options), capsys)

    assert result.code == 0, result
    payload = strict_json((tmp_path / "results" / "latency_fhe_friendly.json").read_text())
    rows = {row["model"]: row for row in payload["rows"]}
    assert list(rows) == ["timm", "exact", "fhe_friendly"]
    assert rows["exact"]["ratio_vs_exact"] == 1.0
    assert rows["timm"]["ratio_vs_timm"] == 1.0
    assert all(row["latency_ms_per_batch"] > 0 for row in rows.values())
    assert payload["batch_size"] == 8
    markdown = (tmp_path / "results" / "latency_fhe_friendly.md").read_text()
    assert "| model | ms / batch |" in markdown
    assert "| fhe_friendly |" in markdown


# --- known bugs (strict: these start failing once the bug is fixed; then drop the marker) ---------


def test_workdir_that_is_a_file_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "work").write_text("not a folder")
    line = error_line(run_cli(command("distill", tmp_path, *TINY), capsys))
    assert str(tmp_path / "work") in line


def test_image_smaller_than_a_patch_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["--max-samples", "20", "--teacher-epochs", "1", "--image-size", "2"]
    line = error_line(run_cli(command("distill", tmp_path, *options), capsys))
    assert "image size" in line


def test_image_size_zero_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"image[ _]size"):
        load_data(DistillRun(image_size=0, max_samples=20))


def test_report_is_valid_json_when_a_division_is_exact(
    e2e: EndToEnd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = [*TINY, "--inverse-iterations", "exact"]
    result = run_cli(command("distill", tmp_path, *options, cache_dir=e2e.cache_dir), capsys)
    assert result.code == 0, result
    strict_json((tmp_path / "work" / "report.json").read_text())


def test_results_record_the_command_that_made_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = command("bench", tmp_path, *TINY, "--repeats", "1")
    assert run_cli(argv, capsys).code == 0
    payload = read_json(tmp_path / "results" / "latency_fhe_friendly.json")
    assert payload["command"] == shlex.join(["fedfm", *argv])


def test_distill_on_out_of_distribution_photos_shares_the_teacher(
    e2e: EndToEnd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--distill-data sample-photos`` reuses the cached teacher (pretrained on D_aux) and
    distills a different student on photo crops; the report says which data it used."""
    argv = command("distill", tmp_path, *TINY, "--distill-data", "sample-photos")
    argv[argv.index("--cache-dir") + 1] = str(e2e.cache_dir)
    result = run_cli(argv, capsys)
    assert result.code == 0, result
    assert "distilling on sample-photos" in result.out
    report = read_json(tmp_path / "work" / "report.json")
    assert report["distill_data"] == "sample-photos" and e2e.report["distill_data"] == "aux"
    assert report["teacher_accuracy"] == e2e.report["teacher_accuracy"]
    photos = load_student(tmp_path / "work" / "student.pt")
    first = next(iter(photos.state_dict()))
    assert not torch.equal(photos.state_dict()[first], e2e.student.state_dict()[first])


def test_a_student_distilled_for_another_dataset_is_refused(
    e2e: EndToEnd, capsys: pytest.CaptureFixture[str]
) -> None:
    """The e2e work folder holds a digits student; asking it for SVHN names the mismatch."""
    from fedfm.distillation.pipeline import obtain_student

    run = DistillRun(dataset="svhn", workdir=e2e.workdir)
    with pytest.raises(ConfigError, match="distilled for dataset 'digits' on 'aux' data"):
        obtain_student(run, log=lambda _line: None)
    assert isinstance(obtain_student(DistillRun(workdir=e2e.workdir), log=print), FheViT)


@pytest.mark.parametrize(
    "command", ["adapt", "bench-protocol", "bench-reveal", "bench-extraction", "red-team"]
)
def test_protocol_options_default_to_the_one_table(command: str) -> None:
    """Every protocol option of every adaptation command defaults to the protocol's table; a
    command that deliberately runs fewer rounds says so in its help."""
    from fedfm.cli import build_parser
    from fedfm.protocols.double_blind.config import DoubleBlindConfig
    from fedfm.protocols.double_blind.runner import Federation

    args = build_parser().parse_args([command])
    config, federation = DoubleBlindConfig(), Federation()
    expected = {
        "batch_size": config.batch_size,
        "batches_per_round": config.batches_per_round,
        "rank": config.rank,
        "reveal": config.reveal,
        "backend": config.backend,
        "adapter_alpha": config.alpha,
        "lr_decay": config.lr_decay,
        "secure_aggregation": config.secure_aggregation,
        "secagg_clipping_range": config.secagg_clipping_range,
        "secagg_bits": config.secagg_bits,
        "secagg_neighbours": config.secagg_neighbours,
        "secagg_threshold": config.secagg_threshold,
        "clients": federation.num_clients,
        "partition": federation.scheme,
        "alpha": federation.alpha,
        "seed": federation.seed,
    }
    assert {name: getattr(args, name) for name in expected} == expected
    extraction = ("bench-extraction", "red-team")
    assert args.rounds == (3 if command in extraction else config.rounds)
