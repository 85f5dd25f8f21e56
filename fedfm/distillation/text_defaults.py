"""Defaults of ``fedfm distill-text`` (no heavy imports: the ``fedfm`` parser reads them).

Sized for a budget of about 15 minutes on 2 cores: 20 texts per family for the teacher's head,
20 test texts per family, and 320 unlabelled standard-library docstrings distilled for 2 epochs
(one per stage); measured 1431 s while another benchmark kept the load at about 6.7
(docs/text_encoder.md), an idle machine not measured. App. D.2 uses far more. The GELU is the
least-squares quartic on [-4, 4] behind a per-channel calibrated input scale (the paper's Quad
leaves MiniLM at chance).
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
    distill_data: str = "stdlib"
    distill_texts: int = 320
    head_c: float = 10.0
    ablation: bool = True
    epochs: int = 2
    batch_size: int = 16
    lr_stage1: float = 1e-4
    lr_stage2: float = 1e-5
    calibration_batches: int = 4
    gelu_degree: int | None = 4
    gelu_radius: float = 4.0
    gelu_channel_scale: bool = True


TEXT_DISTILL_DEFAULTS = TextDistillDefaults()
