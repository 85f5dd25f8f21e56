"""One device setting for plaintext torch (fedfm.models.device), as the CLI and the apps use it."""

from __future__ import annotations

import json

import pytest
import torch

from fedfm.cli import DEVICE_HELP as CLI_DEVICE_HELP
from fedfm.cli import PRECISION_HELP as CLI_PRECISION_HELP
from fedfm.cli import main
from fedfm.errors import ConfigError
from fedfm.experiments.results import write_results
from fedfm.models import device as devices
from fedfm.models.device import (
    DEVICE_HELP,
    PRECISION_HELP,
    MixedPrecision,
    cpu_only_note,
    device_report,
    ieee_float32,
    mixed_precision,
    resolve_device,
    to_numpy,
)

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")


@no_gpu
def test_auto_and_cpu_resolve_to_the_cpu_without_a_gpu() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@no_gpu
@pytest.mark.parametrize("setting", ["cuda", "cuda:0", "cuda:7"])
def test_a_gpu_without_one_stops_with_one_line_naming_it_and_what_torch_sees(setting) -> None:
    with pytest.raises(ConfigError) as raised:
        resolve_device(setting)
    message = str(raised.value)
    assert "\n" not in message
    assert f"device {setting!r} was requested" in message
    assert f"torch {torch.__version__}" in message
    assert "no GPU" in message or "CPU-only" in message


def test_a_gpu_index_torch_does_not_see_names_the_gpus_it_does(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"'cuda:7' was requested but .* sees 1 GPU \(cuda:0\)"):
        resolve_device("cuda:7")


@pytest.mark.parametrize("setting", ["gpu", "mps", "cuda:x", "cuda:-1", "cuda0", ""])
def test_unknown_settings_name_the_choices(setting) -> None:
    if setting == "":  # empty means auto, as None does
        assert resolve_device(setting).type in {"cpu", "cuda"}
        return
    with pytest.raises(ConfigError, match="use auto, cpu, cuda, cuda:N"):
        resolve_device(setting)


@no_gpu
def test_the_command_line_stops_before_any_work_with_one_line(tmp_path, capsys) -> None:
    status = main(["distill", "--device", "cuda", "--workdir", str(tmp_path / "never")])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("fedfm: error: device 'cuda' was requested")
    assert not (tmp_path / "never").exists()  # nothing ran
    assert main(["train-llm", "--device", "cuda:7", "--cache-dir", str(tmp_path)]) == 2
    assert "'cuda:7'" in capsys.readouterr().err


def test_the_cli_help_texts_are_the_modules() -> None:
    assert CLI_DEVICE_HELP == DEVICE_HELP
    assert CLI_PRECISION_HELP == PRECISION_HELP


def test_mixed_precision_is_off_on_the_cpu_and_steps_exactly_as_plain_torch() -> None:
    logged: list[str] = []
    precision = mixed_precision("bf16", torch.device("cpu"), log=logged.append)
    assert not precision.enabled
    assert precision.describe() == "off (cpu: bf16 needs a GPU)"
    assert logged and "off" in logged[0]
    with pytest.raises(ConfigError, match="unknown precision 'int8'"):
        MixedPrecision("int8")

    def trained(use_helper: bool) -> torch.Tensor:
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        inputs = torch.randn(8, 4)
        with precision.autocast():
            loss = layer(inputs).square().mean()
        assert loss.dtype == torch.float32
        optimizer.zero_grad()
        if use_helper:
            precision.step(loss, optimizer)
        else:
            loss.backward()
            optimizer.step()
        return layer.weight.detach().clone()

    assert torch.equal(trained(True), trained(False))


def test_ckks_says_it_stays_on_the_cpu_only_when_a_gpu_was_asked_for() -> None:
    assert cpu_only_note(torch.device("cpu"), "the ckks evaluation") is None
    note = cpu_only_note(torch.device("cuda", 0), "the ckks evaluation")
    assert note is not None and "the ckks evaluation runs on the CPU" in note and "cuda:0" in note


def test_results_record_device_torch_cuda_and_peak_memory(tmp_path) -> None:
    cpu = torch.device("cpu")
    report = device_report(cpu)
    assert report == {
        "device": "cpu",
        "device_name": "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "peak_accelerator_memory_bytes": None,
    }
    json_path, md_path = write_results(
        tmp_path,
        "probe",
        title="t",
        description="d",
        rows=[{"a": 1}],
        columns=[("a", "a")],
        command="fedfm probe",
        device=cpu,
    )
    environment = json.loads(json_path.read_text())["environment"]
    assert {key: environment[key] for key in report} == report
    assert "Device: cpu (cpu); torch" in md_path.read_text()
    # without a device (commands that run no plaintext torch) nothing is claimed
    json_path, _ = write_results(
        tmp_path, "plain", title="t", description="d", rows=[], columns=[], command="x"
    )
    assert "device" not in json.loads(json_path.read_text())["environment"]


def test_to_numpy_detaches_and_copies_to_the_cpu() -> None:
    values = torch.ones(2, requires_grad=True) * 2
    assert to_numpy(values).tolist() == [2.0, 2.0]
    assert devices.torch_sees().startswith(f"torch {torch.__version__}")


def test_ieee_float32_turns_tf32_off_inside_and_restores_the_settings_after() -> None:
    cudnn = torch.backends.cudnn.conv
    before = (torch.backends.cuda.matmul.fp32_precision, cudnn.fp32_precision)
    with pytest.raises(RuntimeError), ieee_float32():
        assert (torch.backends.cuda.matmul.fp32_precision, cudnn.fp32_precision) == (
            "ieee",
            "ieee",
        )
        raise RuntimeError("an evaluation that fails")
    assert (torch.backends.cuda.matmul.fp32_precision, cudnn.fp32_precision) == before


def test_ckks_commands_say_so_when_a_gpu_is_asked_for(monkeypatch, capsys) -> None:
    from argparse import Namespace

    from fedfm.cli import _say_ckks_stays_on_the_cpu

    _say_ckks_stays_on_the_cpu(Namespace(device="cpu"), "CKKS")
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _say_ckks_stays_on_the_cpu(Namespace(device="auto"), "CKKS (the benchmarked blocks)")
    assert "CKKS (the benchmarked blocks) runs on the CPU" in capsys.readouterr().out
