"""Packaging and layout contracts: what `pip install` ships and which way imports point.

The library's floors, bottom up (``docs/architecture.md`` draws them): a module may import its
own package and the floors below it, never a floor above or another package of its own floor.
Imports inside functions count: a cycle held together by a late import is still a cycle.
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = {"fedfm_strategies": "strategies", "fedfm_clients": "clients"}
# Flower's app layer: only fedfm.flower (the adapters' seam) and the adapters import it.
FLOWER_APP_LAYER = ("flwr.serverapp", "flwr.clientapp", "flwr.app")
FLOORS: tuple[tuple[str, ...], ...] = (
    ("fedfm.errors", "fedfm.hub"),
    ("fedfm.approx", "fedfm.data"),
    ("fedfm.models",),
    ("fedfm.crypto", "fedfm.secagg"),
    ("fedfm.runtime",),
    ("fedfm.protocols", "fedfm.distillation"),
    ("fedfm.flower",),
    ("fedfm.experiments",),
    ("fedfm.cli",),
)
# Inside fedfm.crypto (its __init__ docstring explains them): a module imports crypto modules of
# its own layer or below, never above.
CRYPTO_LAYERS: tuple[tuple[str, ...], ...] = (
    ("randomness", "backend", "simulate", "params", "schedule"),
    ("seal_memory", "seal_raw", "rns_linear"),
    ("workers", "refresh", "circuit"),
    ("packing", "benes", "ckks_vit", "ckks_text"),
    ("ckks",),
)
ROOT_MODULE_LIMIT = 4  # modules at the root of fedfm/ besides __init__.py


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@cache
def _modules() -> dict[str, Path]:
    """Every module of the library and the adapters, by its import name."""
    folders = {"fedfm": "fedfm", **ADAPTERS}
    found = {}
    for name, folder in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported_names(module: str, path: Path) -> set[str]:
    """Every name ``module`` imports, anywhere in it (module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")
                if path.name != "__init__.py":
                    package.pop()
                base = ".".join(package[: len(package) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


@cache
def _graph() -> dict[str, set[str]]:
    """Module -> the modules of the library and adapters it imports."""
    modules = _modules()
    return {
        module: {name for name in _imported_names(module, path) if name in modules} - {module}
        for module, path in modules.items()
    }


def _package(module: str) -> str:
    """The floor package a module belongs to (``fedfm.crypto.ckks`` -> ``fedfm.crypto``)."""
    for floor in FLOORS:
        for package in floor:
            if module == package or module.startswith(package + "."):
                return package
    return module


def _floor(module: str) -> int:
    package = _package(module)
    for index, floor in enumerate(FLOORS):
        if package in floor:
            return index
    raise AssertionError(f"{module} is on no floor: add its package to FLOORS")


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


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_every_library_module_is_on_a_floor_and_imports_only_downwards() -> None:
    offenders = []
    for module, targets in _graph().items():
        if not module.startswith("fedfm."):
            continue
        for target in targets:
            if target.split(".")[0] != "fedfm" or target == "fedfm":
                continue
            same_package = _package(module) == _package(target)
            if not same_package and _floor(target) >= _floor(module):
                offenders.append(f"{module} imports {target}")
    assert offenders == []


def test_crypto_modules_import_only_their_layer_or_below() -> None:
    layer = {name: index for index, names in enumerate(CRYPTO_LAYERS) for name in names}
    crypto = [m for m in _graph() if m.startswith("fedfm.crypto.")]
    assert sorted(m.rsplit(".", 1)[1] for m in crypto) == sorted(layer), "a module on no layer"
    offenders = [
        f"{module} imports {target}"
        for module in crypto
        for target in _graph()[module]
        if target == "fedfm.crypto"  # a submodule never runs the package's __init__ on purpose
        or (
            target.startswith("fedfm.crypto.")
            and layer[target.rsplit(".", 1)[1]] > layer[module.rsplit(".", 1)[1]]
        )
    ]
    assert offenders == []
    assert not any(t.startswith("fedfm.crypto") for t in _graph()["fedfm.crypto.workers"])


def test_helix_uses_only_the_public_crypto_api() -> None:
    offenders = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module.startswith("fedfm.protocols.helix")
        for target in targets
        if target.startswith("fedfm.crypto.")
    ]
    assert offenders == []


def test_protocols_stay_apart_and_never_import_distillation() -> None:
    offenders = []
    for module, targets in _graph().items():
        parts = module.split(".")
        if parts[:2] != ["fedfm", "protocols"] or len(parts) < 3:
            continue
        for target in targets:
            target_parts = target.split(".")
            if target_parts[:2] == ["fedfm", "distillation"]:
                offenders.append(f"{module} imports {target}")
            # another protocol's package; the shared modules at the protocols root are fine
            other_protocol = (
                target_parts[:2] == ["fedfm", "protocols"]
                and len(target_parts) > 2
                and (ROOT / Path(*target_parts[:3])).is_dir()
                and target_parts[2] != parts[2]
            )
            if other_protocol:
                offenders.append(f"{module} imports {target}")
    assert offenders == []


def test_only_the_flower_seam_imports_flowers_app_layer_and_nothing_imports_the_adapters() -> None:
    offenders = []
    for module, path in _modules().items():
        if not module.startswith("fedfm.") or module.startswith("fedfm.flower"):
            continue
        for name in _imported_names(module, path):
            if name.startswith(FLOWER_APP_LAYER) or name.split(".")[0] in ADAPTERS:
                offenders.append(f"{module} imports {name}")
    assert offenders == []


def test_the_adapters_never_import_each_other() -> None:
    offenders = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if module.split(".")[0] in ADAPTERS
        and target.split(".")[0] in ADAPTERS
        and target.split(".")[0] != module.split(".")[0]
    ]
    assert offenders == []


def test_the_library_never_imports_the_harness() -> None:
    offenders = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if target.startswith("fedfm.experiments")
        and not module.startswith(("fedfm.experiments", "fedfm.cli"))
    ]
    assert offenders == []


def test_the_root_of_the_library_keeps_few_modules() -> None:
    root_modules = sorted(p.name for p in (ROOT / "fedfm").glob("*.py") if p.name != "__init__.py")
    assert len(root_modules) <= ROOT_MODULE_LIMIT, root_modules


def test_the_contracts_see_what_they_check(tmp_path: Path) -> None:
    """The checks above would pass on an empty graph: make sure they read real imports."""
    graph = _graph()
    assert "fedfm.errors" in graph["fedfm.crypto.backend"]
    assert "fedfm.flower.codec" in graph["fedfm_clients.double_blind"]
    assert any(t.startswith("fedfm.experiments") for t in graph["fedfm.cli"])
    # late (function-level) and relative imports are seen too
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from fedfm.crypto.refresh import RefreshClient\n")
    assert "fedfm.crypto.refresh" in _imported_names("x", probe)
    probe.write_text("from .refresh import RefreshClient\n")
    assert "fedfm.crypto.refresh" in _imported_names("fedfm.crypto.circuit", probe)


def test_packaged_data_files_are_declared() -> None:
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    for package, patterns in package_data.items():
        folder = ROOT / Path(*package.split("."))
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: nothing matches {pattern}"
    assert (ROOT / "fedfm" / "experiments" / "paper.toml").exists()


def test_console_script_points_at_cli_main() -> None:
    assert _pyproject()["project"]["scripts"]["fedfm"] == "fedfm.cli:main"


def test_library_code_raises_invariant_errors_instead_of_asserting() -> None:
    """``python -O`` strips ``assert``: internal invariants raise ``InvariantError`` instead."""
    offenders = [
        f"{module} line {node.lineno}"
        for module, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert offenders == []


def test_the_lazy_double_blind_package_exports_what_it_lists() -> None:
    """fedfm.protocols.double_blind loads its names on first use (the CLI reads its defaults
    without torch); every listed name must resolve, from the module its table names."""
    import fedfm.protocols.double_blind as package

    assert sorted(package.__all__) == sorted(package._HOME)
    for name in package.__all__:
        assert getattr(package, name).__module__.endswith(package._HOME[name])


def test_ci_runs_the_readme_test_command() -> None:
    """The README's test command is what ``.ci/run`` runs: the same install, lint, types and the
    two pytest lanes in the same order."""
    readme = (ROOT / "README.md").read_text()
    command = next(
        line
        for line in readme.splitlines()
        if line.startswith("python3 -m venv .venv") and "pytest" in line
    )
    ci = (ROOT / ".ci" / "run").read_text()
    steps = [step.strip() for step in command.split("&&")]
    assert steps[:4] == [
        "python3 -m venv .venv",
        ".venv/bin/pip install -e '.[test]'",
        ".venv/bin/ruff check .",
        ".venv/bin/mypy",
    ]
    for step in steps[:4]:
        assert step in ci, step
    lanes = re.findall(r'pytest -q -m "([^"]+)"', command)
    assert lanes == ["not slow and not deployment", "slow or deployment"]
    assert re.findall(r'lane "([^"]+)"', ci) == lanes


def test_a_data_owners_clientapp_process_imports_only_flower_and_light_modules() -> None:
    """On the Deployment Engine every message starts a fresh ClientApp process (issue 23): the
    data owner's app module imports Flower and fedfm's light modules only. torch, TenSEAL, timm
    and scikit-learn load with the role, when a message is answered in this process; a site's
    ClientApp (node config ``site-dir``) forwards every message and never loads them."""
    import subprocess
    import sys

    probe = (
        "import sys, fedfm_clients.double_blind; "
        "print(sorted({'torch', 'tenseal', 'timm', 'torchvision', 'sklearn'} & set(sys.modules)))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    assert completed.stdout.strip() == "[]", completed.stdout + completed.stderr[-2000:]
