"""Where plaintext torch runs: one device setting, its mixed precision, and what a run reports.

Every plaintext torch path of fedfm (teacher pretraining, two-stage distillation, the ``simulate``
backend's block evaluation, a data owner's side adapters and head, the baselines, the decoder's
training, the text encoders) takes one setting:

``auto``
    the first GPU when torch sees one, else the CPU (the default everywhere);
``cpu``
    the CPU;
``cuda`` / ``cuda:N``
    that GPU; a :class:`~fedfm.errors.ConfigError` in one line, naming the device and what torch
    sees, when torch sees no such GPU (never a silent fall-back to the CPU).

CKKS (TenSEAL) always computes on the CPU, whatever the setting: :func:`cpu_only_note` says so.

Tensors cross to numpy only at message and artefact boundaries (:func:`to_numpy`); checkpoints
and artefacts are written from the CPU, so a file made on a GPU loads on a machine without one.

Mixed precision (:class:`MixedPrecision`) is opt-in and only ever on a GPU: ``off`` (default),
``bf16`` or ``fp16`` autocast for training (teacher pretraining, distillation, full
fine-tuning). It is never used where the protocol compares values exactly (the ``simulate``
backend against CKKS, a data owner's loss check).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from fedfm.errors import ConfigError

DEVICE_SETTINGS = ("auto", "cpu", "cuda", "cuda:N")
DEVICE_HELP = (
    "where plaintext torch runs: auto (a GPU when torch sees one, else the CPU), cpu, cuda or "
    "cuda:N; CKKS always runs on the CPU"
)
PRECISIONS = ("off", "bf16", "fp16")
PRECISION_HELP = (
    "mixed precision for training on a GPU (teacher, distillation, full fine-tuning): off, bf16 "
    "or fp16 autocast; always off on the CPU and in the protocol's own evaluation"
)
_CUDA = re.compile(r"cuda(?::(\d+))?")


def torch_sees() -> str:
    """What torch sees, in words: the GPUs, or why there is none (build, availability)."""
    build = f"torch {torch.__version__}"
    if torch.version.cuda is None:
        return f"{build} is a CPU-only build (no CUDA)"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return (
            f"{build}, built for CUDA {torch.version.cuda}, sees no GPU "
            "(torch.cuda.is_available() is False)"
        )
    names = ", ".join(f"cuda:{i}" for i in range(count))
    return f"{build} sees {count} GPU{'s' if count > 1 else ''} ({names})"


def resolve_device(setting: str | torch.device | None = "auto") -> torch.device:
    """The device ``setting`` names (module docstring); ``None`` means ``auto``.

    Raises
    ------
    ConfigError
        If the setting is not one of ``auto``, ``cpu``, ``cuda``, ``cuda:N``, or names a GPU
        torch does not see.
    """
    if isinstance(setting, torch.device):
        setting = str(setting)
    text = (setting or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = _CUDA.fullmatch(text)
    if match is None:
        raise ConfigError(
            f"unknown device {setting!r}: use {', '.join(DEVICE_SETTINGS)} (N a GPU index)"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(match.group(1) or 0)
    if count == 0 or index >= count:
        raise ConfigError(
            f"device {setting!r} was requested but {torch_sees()}; use --device cpu or auto"
        )
    return torch.device("cuda", index)


def to_numpy(tensor: torch.Tensor) -> Any:
    """A tensor's values as a numpy array on the CPU (a message or artefact boundary)."""
    return tensor.detach().cpu().numpy()


@contextmanager
def ieee_float32() -> Iterator[None]:
    """Within this block float32 is IEEE float32 on a GPU too: no TF32 in matmuls or cuDNN
    convolutions (torch's default for convolutions on recent GPUs, about 1e-3 relative error).
    The ``simulate`` backend evaluates under it, so that it stays comparable with CKKS value by
    value whatever the device; on the CPU it changes nothing."""
    cudnn: Any = torch.backends.cudnn  # its per-operation precision settings are untyped
    matmul = torch.backends.cuda.matmul.fp32_precision
    conv = cudnn.conv.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    cudnn.conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = matmul
        cudnn.conv.fp32_precision = conv


def cpu_only_note(device: torch.device, what: str) -> str | None:
    """The log line for a CPU-only computation (CKKS) when a GPU was asked for; else ``None``."""
    if device.type == "cpu":
        return None
    return f"[fedfm] {what} runs on the CPU (TenSEAL has no GPU path); {device} serves the rest"


class MixedPrecision:
    """Autocast and loss scaling for one training run; off (plain float32) unless on a GPU.

    Parameters
    ----------
    mode:
        ``off``, ``bf16`` or ``fp16`` (:data:`PRECISIONS`).
    device:
        The device the run trains on; on the CPU every mode is off (``enabled`` is False).

    ``step(loss, optimizer)`` replaces ``loss.backward(); optimizer.step()``: with fp16 it scales
    the loss (``torch.amp.GradScaler``); otherwise it is exactly those two calls.
    """

    def __init__(self, mode: str = "off", device: torch.device | None = None) -> None:
        if mode not in PRECISIONS:
            raise ConfigError(f"unknown precision {mode!r}: use one of {list(PRECISIONS)}")
        self.mode = mode
        self.device = device if device is not None else torch.device("cpu")
        self.enabled = mode != "off" and self.device.type == "cuda"
        if self.enabled and mode == "bf16" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"precision bf16 was requested but {self.device} does not support it")
        self._dtype = torch.bfloat16 if mode == "bf16" else torch.float16
        self._scaler = torch.amp.GradScaler("cuda", enabled=self.enabled and mode == "fp16")

    def describe(self) -> str:
        """What runs, for logs and reports (``off``, ``bf16 autocast``, ``off (cpu)``)."""
        if self.enabled:
            return f"{self.mode} autocast"
        return "off" if self.mode == "off" else f"off ({self.device.type}: {self.mode} needs a GPU)"

    def autocast(self) -> AbstractContextManager[Any]:
        """The forward pass's context: ``torch.autocast`` when enabled, else nothing."""
        if not self.enabled:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self._dtype)

    def step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Backward pass and optimizer step (scaled under fp16)."""
        self._scaler.scale(loss).backward()
        self._scaler.step(optimizer)
        self._scaler.update()


def mixed_precision(
    mode: str, device: torch.device, *, log: Callable[[str], None] | None = None
) -> MixedPrecision:
    """:class:`MixedPrecision` for ``mode`` on ``device``, logging when a mode is off on a CPU."""
    precision = MixedPrecision(mode, device)
    if log is not None and mode != "off" and not precision.enabled:
        log(f"[fedfm] precision {mode} requested on {device}: off (autocast only on a GPU)")
    return precision


def reset_peak_memory(device: torch.device) -> None:
    """Start counting peak accelerator memory afresh (nothing to do on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_report(device: torch.device) -> dict[str, Any]:
    """Where torch ran, for results: the device (and its name), torch's and CUDA's versions, and
    the peak memory torch allocated on it since :func:`reset_peak_memory` (``None`` on the CPU,
    where the accelerator counter does not exist)."""
    on_gpu = device.type == "cuda"
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "peak_accelerator_memory_bytes": (
            int(torch.cuda.max_memory_allocated(device)) if on_gpu else None
        ),
    }


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (GPU timings are meaningless without it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
