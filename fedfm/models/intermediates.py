"""What two-stage distillation aligns between a teacher and its FHE-friendly student."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Intermediates:
    """Everything distillation aligns (App. E): embedding, per-block A and hidden states, logits.

    Built by :meth:`fedfm.models.fhe_vit.FheViT.forward_intermediates` and
    :meth:`fedfm.models.fhe_text.FheTextClassifier.forward_intermediates` (where padding is
    zeroed, so that it adds nothing to the losses).
    """

    embedding: torch.Tensor
    attention_logits: list[torch.Tensor]
    hidden_states: list[torch.Tensor]
    logits: torch.Tensor
