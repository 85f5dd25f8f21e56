"""Small training utilities shared by teacher pretraining, distillation and benchmarks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score
from torch import nn
from tqdm.auto import tqdm

from fedfm.errors import ConfigError
from fedfm.models.device import MixedPrecision


def check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be an integer >= 1, got {batch_size!r}")


def batches(
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int,
    generator: torch.Generator | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Mini-batches in order, or shuffled by ``generator`` when one is given."""
    check_batch_size(batch_size)
    count = len(labels)
    order = torch.randperm(count, generator=generator) if generator is not None else None
    for start in range(0, count, batch_size):
        index = (
            order[start : start + batch_size]
            if order is not None
            else slice(start, start + batch_size)
        )
        yield images[index], labels[index]


def random_shift(images: torch.Tensor, *, pixels: int, generator: torch.Generator) -> torch.Tensor:
    """Shift each image by up to ``pixels`` in each direction (zero fill): cheap augmentation."""
    if pixels == 0:
        return images
    padded = F.pad(images, (pixels, pixels, pixels, pixels))
    size = images.shape[-1]
    out = torch.empty_like(images)
    offsets = torch.randint(0, 2 * pixels + 1, (len(images), 2), generator=generator)
    for i, (dy, dx) in enumerate(offsets.tolist()):
        out[i] = padded[i, :, dy : dy + size, dx : dx + size]
    return out


@dataclass(frozen=True)
class Scores:
    """Accuracy and balanced accuracy (the paper's metric) of a classifier on a labelled set."""

    accuracy: float
    balanced_accuracy: float

    def as_dict(self) -> dict[str, float]:
        return {"accuracy": self.accuracy, "balanced_accuracy": self.balanced_accuracy}


@torch.no_grad()
def predict(
    model: Callable[[torch.Tensor], torch.Tensor],
    images: torch.Tensor,
    *,
    batch_size: int = 128,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Predicted class of each image (on the CPU); batches go to ``device`` (default: where the
    model's parameters are, or the CPU)."""
    if isinstance(model, nn.Module):
        model.eval()
        if device is None:
            device = next(model.parameters(), torch.zeros(())).device
    outputs = [
        model(images[start : start + batch_size].to(device)).argmax(dim=-1).cpu()
        for start in range(0, len(images), batch_size)
    ]
    return torch.cat(outputs)


def score(
    model: Callable[[torch.Tensor], torch.Tensor],
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int = 128,
) -> Scores:
    """Accuracy and balanced accuracy of ``model`` on ``(images, labels)`` (on the model's
    device)."""
    predicted = predict(model, images, batch_size=batch_size).numpy()
    truth = labels.numpy()
    return Scores(
        accuracy=float(np.mean(predicted == truth)),
        balanced_accuracy=float(balanced_accuracy_score(truth, predicted)),
    )


@dataclass(frozen=True)
class PretrainConfig:
    """Teacher pretraining ("preliminary adaptation" on D_aux, assumption i) for CPU budgets."""

    epochs: int = 40
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    shift_pixels: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        check_batch_size(self.batch_size)
        if self.epochs < 1:
            raise ConfigError(f"teacher epochs must be >= 1, got {self.epochs}")


def pretrain(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    config: PretrainConfig,
    *,
    progress: bool = True,
    device: torch.device | None = None,
    precision: MixedPrecision | None = None,
) -> dict[str, Any]:
    """Train ``model`` in place with AdamW and a cosine schedule; return the loss per epoch.

    The model trains on ``device`` (default: the CPU) under ``precision`` (default: off) and is
    back on the CPU afterwards; data stay on the CPU (shuffling and shifts there, so the draws
    do not depend on the device) and move one batch at a time.
    """
    device = device if device is not None else torch.device("cpu")
    precision = precision or MixedPrecision("off", device)
    model.to(device)
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    steps = config.epochs * -(-len(labels) // config.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.lr, total_steps=steps, pct_start=0.1
    )
    history = []
    bar = tqdm(range(config.epochs), desc="teacher", disable=not progress, unit="epoch")
    for _ in bar:
        model.train()
        total, seen = 0.0, 0
        for batch_images, batch_labels in batches(
            images, labels, batch_size=config.batch_size, generator=generator
        ):
            batch_images = random_shift(
                batch_images, pixels=config.shift_pixels, generator=generator
            )
            batch_images, batch_labels = batch_images.to(device), batch_labels.to(device)
            with precision.autocast():
                loss = F.cross_entropy(model(batch_images), batch_labels)
            optimizer.zero_grad()
            precision.step(loss, optimizer)
            schedule.step()
            total += loss.item() * len(batch_labels)
            seen += len(batch_labels)
        history.append(total / seen)
        bar.set_postfix(loss=f"{history[-1]:.3f}")
    model.eval().cpu()
    return {"pretrain_loss": history}
