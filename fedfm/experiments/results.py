"""Benchmark results as a JSON file and a Markdown table, both naming the command that made them."""

from __future__ import annotations

import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fedfm.models.device import device_report


def command_line() -> str:
    """The command that is running, as a user would type it."""
    program = Path(sys.argv[0]).name
    program = "fedfm" if program in {"fedfm", "__main__.py", "cli.py"} else program
    return shlex.join([program, *sys.argv[1:]])


def environment(device: torch.device | None = None) -> dict[str, Any]:
    """Where a measurement ran: enough to compare numbers across machines honestly.

    With the ``device`` plaintext torch ran on: that device (and its name), the CUDA version
    torch was built for (``None`` for a CPU-only build) and, on a GPU, the peak memory torch
    allocated there (:func:`fedfm.models.device.device_report`).
    """
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        **(device_report(device) if device is not None else {}),
    }


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) replaced by ``None``: JSON has no NaN
    (e.g. the balanced accuracy of a round in which no client could evaluate)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")  # a bare pipe would end the cell


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Rows as a Markdown table; ``columns`` are ``(key, header)`` pairs."""
    lines = [
        "| " + " | ".join(_cell(header) for _, header in columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    lines += ["| " + " | ".join(_cell(row.get(key)) for key, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def _hardware_line(env: dict[str, Any]) -> str:
    """The device line of a Markdown result (empty when the run named no device)."""
    if "device" not in env:
        return ""
    peak = env["peak_accelerator_memory_bytes"]
    memory = "" if peak is None else f", peak accelerator memory {peak / 2**20:.0f} MiB"
    cuda = f"built for CUDA {env['cuda']}" if env["cuda"] else "a CPU-only build"
    device = f"{env['device']} ({env['device_name']})"
    return f"Device: {device}; torch {env['torch']}, {cuda}{memory}.\n\n"


def write_results(
    results_dir: Path,
    name: str,
    *,
    title: str,
    description: str,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[tuple[str, str]],
    extra: dict[str, Any] | None = None,
    command: str | None = None,
    device: torch.device | None = None,
) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` under ``results_dir`` and print the command.

    ``command`` is the command line that regenerates the results (default: this process's);
    ``device``, where plaintext torch ran, goes into the environment (:func:`environment`).
    """
    results_dir.mkdir(parents=True, exist_ok=True)
    command = command or command_line()
    payload = {
        "title": title,
        "description": description,
        "command": command,
        "environment": environment(device),
        "rows": list(rows),
        **(extra or {}),
    }
    payload = json_safe(payload)
    json_path = results_dir / f"{name}.json"
    md_path = results_dir / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str, allow_nan=False))
    md_path.write_text(
        f"# {title}\n\n{description}\n\n{markdown_table(rows, columns)}\n\n"
        f"{_hardware_line(payload['environment'])}Regenerate: `{command}`\n"
    )
    print(f"[fedfm] wrote {json_path} and {md_path}")
    print(f"[fedfm] regenerate with: {command}")
    return json_path, md_path
