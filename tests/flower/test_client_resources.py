"""Client resources of the Flower simulations: from the apps' TOML or run.py's options to the
backend config Flower's simulation process hands Ray, through Flower's own parsing."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.cli.run.run import _parse_federation_config_overrides
from flwr.cli.typing import SuperLinkConnection
from flwr.simulation.app import _run_simulation_settings
from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG

from fedfm.errors import ConfigError
from fedfm.protocols.double_blind.settings import DEFAULTS, app_settings
from fedfm_clients.double_blind import client_role

ROOT = Path(__file__).resolve().parents[2]
APPS = sorted(path.parent for path in (ROOT / "simulations").glob("*/pyproject.toml"))


def _launcher():
    spec = importlib.util.spec_from_file_location(
        "fedfm_double_blind_run_resources", ROOT / "simulations" / "double_blind" / "run.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _launcher()


def backend_config_flower_builds(command: list[str]) -> tuple[int, dict]:
    """What `flwr run` makes of the command's --federation-config, then what Flower's simulation
    process makes of that for its backend (Ray): (number of SuperNodes, backend config)."""
    overrides = [command[command.index("--federation-config") + 1]]
    simulation = _parse_federation_config_overrides(
        overrides, SuperLinkConnection(name=launcher.CONNECTION, address="127.0.0.1:9093")
    )
    assert simulation is not None
    supernodes, backend, config, _, _ = _run_simulation_settings(simulation)
    assert backend == "ray"
    return supernodes, config


@pytest.mark.parametrize("app", APPS, ids=lambda path: path.name)
def test_every_app_declares_flowers_default_client_resources(app: Path) -> None:
    table = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["fedfm"]["simulation"]
    assert table == {
        "client-resources-num-cpus": DEFAULT_SIMULATION_CONFIG.client_resources_num_cpus,
        "client-resources-num-gpus": DEFAULT_SIMULATION_CONFIG.client_resources_num_gpus,
    }
    assert launcher.ClientResources.of_app(app) == launcher.ClientResources()


def test_a_gpu_share_reaches_the_backend_flower_gives_ray() -> None:
    # the one-GPU recipe of docs/gpu.md: five virtual clients at 0.2 GPU and 1 CPU each
    resources = launcher.ClientResources.of_app(launcher.APP, num_cpus=1, num_gpus=0.2)
    command = launcher.flwr_run_command(launcher.APP, 5, resources, ["--run-config", "rounds=1"])
    assert command[2:4] == [str(launcher.APP), launcher.CONNECTION]
    assert command[-2:] == ["--run-config", "rounds=1"]
    supernodes, config = backend_config_flower_builds(command)
    assert supernodes == 5
    assert config["client_resources"]["num_cpus"] == 1
    assert config["client_resources"]["num_gpus"] == pytest.approx(0.2)  # a float32 field


def test_the_apps_toml_reaches_flower_when_run_py_is_given_nothing(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(
        "[tool.fedfm.simulation]\nclient-resources-num-cpus = 4\nclient-resources-num-gpus = 0.5\n"
    )
    resources = launcher.ClientResources.of_app(app)
    _, config = backend_config_flower_builds(launcher.flwr_run_command(app, 2, resources, []))
    assert config["client_resources"] == {"num_cpus": 4, "num_gpus": 0.5}
    # run.py's options win over the TOML
    assert launcher.ClientResources.of_app(app, num_gpus=0.25).num_gpus == 0.25


@pytest.mark.parametrize(
    ("cpus", "gpus", "message"),
    [(0, 0.0, "num-cpus must be an integer >= 1"), (1, -0.5, "num-gpus must be >= 0")],
)
def test_impossible_resources_are_refused(cpus: int, gpus: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launcher.ClientResources(num_cpus=cpus, num_gpus=gpus)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_a_gpu_share_without_a_gpu_stops_run_py_before_flower_starts(capsys) -> None:
    # Ray would otherwise wait forever for a GPU it does not have
    assert launcher.main(["--num-gpus", "0.2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "device 'cuda' was requested" in err


def test_the_apps_device_setting_is_in_the_run_config() -> None:
    assert DEFAULTS["device"] == "auto"
    assert app_settings({}).device == "auto"
    assert app_settings({"device": "cuda:1"}).device == "cuda:1"  # checked where it is used


def _client(run_device: str | None, own_device: str | None):
    run_config: dict[str, object] = {"num-clients": 2, "image-size": 8, "max-samples": 120}
    if run_device is not None:
        run_config["device"] = run_device
    node: dict[str, object] = {"partition-id": 0, "num-partitions": 2}
    if own_device is not None:
        node["device"] = own_device
    return client_role(Context(1, 1, node, RecordDict(), run_config))


def test_a_client_app_takes_the_run_configs_device_unless_its_own_node_config_says() -> None:
    assert _client(None, None).device == torch.device(
        "cpu" if not torch.cuda.is_available() else "cuda:0"
    )
    assert _client("cpu", None).device == torch.device("cpu")
    assert _client("cuda:7", "cpu").device == torch.device("cpu")  # the data owner's hardware
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device 'cuda' was requested"):
            _client("cpu", "cuda")
