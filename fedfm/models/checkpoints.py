"""Checkpoint files and cache keys shared by every cached model (the ViT teacher, the student,
the embedded decoder): atomic writes, format tags, clear errors. Imports torch only."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedfm.errors import CheckpointError


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically, so an interrupted run never leaves a truncated checkpoint behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")
    torch.save(payload, partial)
    partial.replace(path)


def read_checkpoint(
    path: str | Path, *, expected_format: str, retired: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Load a fedfm checkpoint, turning every way it can be unreadable into a clear error.

    ``retired`` maps an older format this version refuses to the reason and the remedy, which
    the error then gives instead of only naming the two formats.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip and torch errors all mean "not a checkpoint"
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a torch checkpoint ({type(error).__name__})"
        ) from error
    found = payload.get("format") if isinstance(payload, dict) else None
    if retired and isinstance(found, str) and found in retired:
        raise CheckpointError(
            f"checkpoint {path} has the retired format {found!r}: {retired[found]}"
        )
    if found != expected_format:
        raise CheckpointError(
            f"checkpoint {path} has format {found!r}, expected {expected_format!r}"
        )
    return payload


def load_state_strict(model: torch.nn.Module, state: dict[str, Any], *, source: str) -> None:
    """``load_state_dict(strict=True)``, raising a :class:`CheckpointError` naming the mismatch."""
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        first = str(error).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:3])
        raise CheckpointError(f"{source} does not match the model: {detail}") from error


def cache_key(**settings: Any) -> str:
    """A short hash of everything that determines a cached model."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
