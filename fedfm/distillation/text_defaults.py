"""Defaults of ``fedfm distill-text`` (no heavy imports: the ``fedfm`` parser reads them).

Sized for ~10 minutes on 2 shared cores: 20 texts per family for the teacher's head and the
distillation, 2 epochs (one per stage), 20 test texts per family. App. D.2 uses far more.
"""

from __future__ import annotations

from typing import NamedTuple


class TextDistillDefaults(NamedTuple):
    model: str = "minilm"
    max_tokens: int = 64
    seed: int = 0
    aux_per_class: int = 20
    pool_per_class: int = 20
    test_per_class: int = 20
    distill_data: str = "aux"
    head_c: float = 10.0
    epochs: int = 2
    batch_size: int = 16
    lr_stage1: float = 1e-4
    lr_stage2: float = 1e-5
    calibration_batches: int = 4


TEXT_DISTILL_DEFAULTS = TextDistillDefaults()
