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


def command_line() -> str:
    """The command that is running, as a user would type it."""
    program = Path(sys.argv[0]).name
    program = "fedfm" if program in {"fedfm", "__main__.py", "cli.py"} else program
    return shlex.join([program, *sys.argv[1:]])


def environment() -> dict[str, Any]:
    """Where a measurement ran: enough to compare numbers across machines honestly."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
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
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Rows as a Markdown table; ``columns`` are ``(key, header)`` pairs."""
    lines = [
        "| " + " | ".join(header for _, header in columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    lines += ["| " + " | ".join(_cell(row.get(key)) for key, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


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
) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` under ``results_dir`` and print the command.

    ``command`` is the command line that regenerates the results (default: this process's).
    """
    results_dir.mkdir(parents=True, exist_ok=True)
    command = command or command_line()
    payload = {
        "title": title,
        "description": description,
        "command": command,
        "environment": environment(),
        "rows": list(rows),
        **(extra or {}),
    }
    payload = json_safe(payload)
    json_path = results_dir / f"{name}.json"
    md_path = results_dir / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str, allow_nan=False))
    md_path.write_text(
        f"# {title}\n\n{description}\n\n{markdown_table(rows, columns)}\n\n"
        f"Regenerate: `{command}`\n"
    )
    print(f"[fedfm] wrote {json_path} and {md_path}")
    print(f"[fedfm] regenerate with: {command}")
    return json_path, md_path
