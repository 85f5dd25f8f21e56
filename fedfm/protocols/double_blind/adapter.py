"""The client's trainable part: low-rank parallel side adapters and a classification head.

Spec ``001`` §3.3 (Eq. 4-6): ``H_l = g_l(B_l + H_{l-1}) + H_{l-1}`` with ``H_0 = B_L`` and
``g_l(z) = alpha W_u GELU(W_d z)``, applied per token. The client holds block ``l``'s output only
in the server's order ``pi_l``, so it chains the relative permutations (see ``permutation``):
``H_0' = B_L pi_1`` via ``wrap``; after block ``l``, ``H_l`` (order ``pi_l``) moves to order
``pi_{l+1}`` via ``steps[l-1]``. The head reads the class token of ``H_L`` in the label order
``pi_{L+1}``. With ``rank=0`` there is no adapter: the head reads ``B_L`` (linear probing in the
same harness). A text encoder's head reads the mean over a text's real tokens instead of the class
token (``pooling="mean"``, with the key mask in label order), as the encoder's own head does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedfm.errors import ConfigError, ProtocolError
from fedfm.models.device import to_numpy

POOLINGS: tuple[str, ...] = ("class-token", "mean")


class SideAdapterHead(nn.Module):
    """Parallel adapters for ``num_blocks`` blocks of width ``dim`` plus a linear head on the
    class token (``pooling="class-token"``, the ViT) or on the mean over real tokens
    (``"mean"``, a text encoder)."""

    def __init__(
        self,
        *,
        num_blocks: int,
        dim: int,
        num_classes: int,
        rank: int = 8,
        alpha: float = 1.0,
        pooling: str = "class-token",
    ) -> None:
        super().__init__()
        if num_blocks < 1 or dim < 1 or num_classes < 2 or rank < 0:
            raise ConfigError(
                f"adapter needs num_blocks >= 1, dim >= 1, num_classes >= 2, rank >= 0; got "
                f"{num_blocks}, {dim}, {num_classes}, {rank}"
            )
        if pooling not in POOLINGS:
            raise ConfigError(f"unknown pooling {pooling!r}; choose one of {list(POOLINGS)}")
        self.num_blocks, self.dim, self.rank, self.alpha = num_blocks, dim, rank, alpha
        self.pooling = pooling
        self.down = nn.ModuleList(nn.Linear(dim, rank) for _ in range(num_blocks if rank else 0))
        ups = [nn.Linear(rank, dim) for _ in range(num_blocks if rank else 0)]
        for up in ups:  # zero-initialised: training starts from linear probing
            nn.init.zeros_(up.weight)
            nn.init.zeros_(up.bias)
        self.up = nn.ModuleList(ups)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(
        self,
        block_outputs: Sequence[torch.Tensor],
        wrap: torch.Tensor,
        steps: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits in label order ``pi_{L+1}``; ``block_outputs[l-1]`` is ``B_l`` in ``pi_l``.
        ``key_mask`` (``True`` at real tokens, label order) is required by mean pooling."""
        if len(block_outputs) != self.num_blocks or len(steps) != self.num_blocks:
            raise ProtocolError(
                f"expected {self.num_blocks} block outputs and steps, got {len(block_outputs)} "
                f"and {len(steps)}"
            )
        if self.rank == 0:
            final = block_outputs[-1][steps[-1]]
        else:
            hidden = block_outputs[-1][wrap]
            for index, block in enumerate(block_outputs):
                update = self.up[index](F.gelu(self.down[index](block + hidden)))
                hidden = (self.alpha * update + hidden)[steps[index]]
            final = hidden
        if self.pooling == "class-token":
            return self.head(self.norm(final[:, 0]))
        if key_mask is None or key_mask.shape != final.shape[:2]:
            raise ProtocolError(
                f"mean pooling needs a key mask of shape {tuple(final.shape[:2])}, got "
                f"{None if key_mask is None else tuple(key_mask.shape)}"
            )
        weights = key_mask.unsqueeze(-1).to(final.dtype)
        pooled = (final * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        return self.head(self.norm(pooled))

    def get_arrays(self) -> dict[str, np.ndarray]:
        """Parameters as numpy arrays (what is aggregated)."""
        return {name: to_numpy(value).copy() for name, value in self.state_dict().items()}

    def set_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Load parameters; refuses missing, extra or mis-shaped arrays."""
        expected = self.state_dict()
        if set(arrays) != set(expected):
            missing, extra = set(expected) - set(arrays), set(arrays) - set(expected)
            raise ProtocolError(
                f"adapter arrays mismatch: missing {sorted(missing)}, extra {sorted(extra)}"
            )
        for name, value in arrays.items():
            if tuple(value.shape) != tuple(expected[name].shape):
                raise ProtocolError(
                    f"adapter array {name} has shape {tuple(value.shape)}, expected "
                    f"{tuple(expected[name].shape)}"
                )
        self.load_state_dict({name: torch.from_numpy(np.asarray(v)) for name, v in arrays.items()})
