"""Packaging and layout contracts: what `pip install` ships and which way imports point."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Flower's app layer belongs in the adapters (strategies/, clients/), never in the library.
FLOWER_APP_LAYER = ("flwr.serverapp", "flwr.clientapp", "flwr.app")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_for_installation() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {name: Path(folder) for name, folder in setuptools["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *relative.parts]))
    assert found == listed


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_library_does_not_import_flower_app_layer_or_adapters() -> None:
    offenders = []
    for path in (ROOT / "fedfm").rglob("*.py"):
        for name in _imports(path):
            if name.startswith(FLOWER_APP_LAYER) or name.split(".")[0] in {
                "fedfm_strategies",
                "fedfm_clients",
            }:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def test_console_script_points_at_cli_main() -> None:
    assert _pyproject()["project"]["scripts"]["fedfm"] == "fedfm.cli:main"
