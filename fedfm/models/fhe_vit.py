"""The FHE-friendly ViT: a trained timm ViT with its non-linearities swapped for approximations.

:func:`to_fhe_friendly` copies a timm ``VisionTransformer`` and replaces, module by module,

* each attention layer by :class:`FheAttention` (same weights; softmax explicit and approximable,
  the un-normalised attention matrix ``A = QK^T / sqrt(d_k)`` of Eq. 10 exposed),
* each ``GELU`` by :class:`~fedfm.approx.ApproxGELU` (Eq. 2),
* each ``LayerNorm`` by :class:`~fedfm.approx.ApproxLayerNorm` (same weight and bias),

so that a student starts from the teacher's weights. :class:`FheViT` decomposes the model into
embedding, blocks ``1..L`` and head (spec ``001`` §3.1-3.2: the server evaluates one block at a
time on encrypted inputs).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import cast

import torch
from timm.layers.attention import Attention
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from fedfm.approx.modules import ApproxGELU, ApproxLayerNorm, ApproxSoftmax
from fedfm.approx.specs import ApproxConfig
from fedfm.errors import ModelError
from fedfm.models.intermediates import Intermediates

# Modules that are not polynomial and that no approximation replaces: refusing them keeps a model
# from silently carrying an operation CKKS cannot evaluate.
_UNSUPPORTED = (nn.ReLU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Softmax, nn.GroupNorm, nn.BatchNorm1d)


class FheAttention(nn.Module):
    """Multi-head self-attention with an explicit softmax module (timm ``Attention`` weights)."""

    def __init__(self, source: Attention, softmax: ApproxSoftmax) -> None:
        super().__init__()
        if getattr(source, "gate", None) is not None:
            raise ModelError("gated attention is not supported by the FHE-friendly ViT")
        self.num_heads = source.num_heads
        self.head_dim = source.head_dim
        self.attn_dim = source.attn_dim
        self.scale = source.scale
        self.qkv = source.qkv
        self.q_norm = source.q_norm
        self.k_norm = source.k_norm
        self.attn_drop = source.attn_drop
        self.norm = source.norm
        self.proj = source.proj
        self.proj_drop = source.proj_drop
        self.softmax = softmax

    def forward_with_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the output and the pre-softmax attention matrix ``A`` (batch, heads, N, N)."""
        batch, tokens, _ = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        logits = (q * self.scale) @ k.transpose(-2, -1)
        weights = self.attn_drop(self.softmax(logits))
        out = (weights @ v).transpose(1, 2).reshape(batch, tokens, self.attn_dim)
        return self.proj_drop(self.proj(self.norm(out))), logits

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ModelError("the FHE-friendly ViT does not support attention masks")
        return self.forward_with_logits(x)[0]


def _swap_modules(module: nn.Module, approx: ApproxConfig) -> None:
    for name, child in module.named_children():
        if isinstance(child, Attention | FheAttention):
            _swap_modules(child, approx)  # q/k norms and the output norm are LayerNorms too
            softmax = ApproxSoftmax(approx.exp, approx.inverse)
            if isinstance(child, Attention):
                setattr(module, name, FheAttention(child, softmax))
            else:
                child.softmax = softmax
        elif isinstance(child, nn.GELU | ApproxGELU):
            approximate = getattr(child, "approximate", "none")
            setattr(module, name, ApproxGELU(approx.gelu, approximate=approximate))
        elif isinstance(child, nn.LayerNorm | ApproxLayerNorm):
            setattr(module, name, ApproxLayerNorm.replacing(child, approx.inv_sqrt))
        elif isinstance(child, _UNSUPPORTED):
            raise ModelError(
                f"module {name} is a {type(child).__name__}, which has no FHE-friendly replacement"
            )
        else:
            _swap_modules(child, approx)


@dataclass(frozen=True)
class VitBlockModules:
    """The layers of one block by role (what an encrypted evaluator checks, folds and runs)."""

    attention: FheAttention
    attention_norm: nn.Module
    mlp_norm: nn.Module
    fc1: nn.Module
    activation: nn.Module
    fc2: nn.Module
    unsupported: tuple[nn.Module, ...]  # layer scales, q/k norms, the MLP's norm: identities


class FheViT(nn.Module):
    """A ViT whose non-linearities follow an :class:`ApproxConfig`; embedding, blocks and head.

    Build it with :func:`to_fhe_friendly`. With ``ApproxConfig.exact()`` it computes exactly what
    the timm model it was built from computes.
    """

    def __init__(self, vit: VisionTransformer, approx: ApproxConfig) -> None:
        super().__init__()
        self.vit = vit
        self.approx = approx

    @property
    def num_blocks(self) -> int:
        return len(self.vit.blocks)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Patch embedding, position embedding and class token: the first block's input ``b_0``."""
        vit = self.vit
        return vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(images))))

    def block(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Block ``index`` (0-based) on its input alone: ``b_{l} = B_l(b_{l-1})``."""
        return self.block_with_logits(index, hidden)[0]

    def block_modules(self, index: int) -> VitBlockModules:
        """The layers of block ``index`` by role."""
        if not 0 <= index < self.num_blocks:
            raise ModelError(f"block index {index} out of range 0..{self.num_blocks - 1}")
        block = cast(Block, self.vit.blocks[index])  # to_fhe_friendly refuses other blocks
        attention, mlp = block.attn, cast(nn.Module, block.mlp)
        if not isinstance(attention, FheAttention):  # to_fhe_friendly swaps every attention
            raise ModelError(f"block {index}'s attention is not the FHE-friendly attention")
        return VitBlockModules(
            attention=attention,
            attention_norm=block.norm1,
            mlp_norm=block.norm2,
            fc1=cast(nn.Module, mlp.fc1),
            activation=cast(nn.Module, mlp.act),
            fc2=cast(nn.Module, mlp.fc2),
            unsupported=(
                block.ls1,
                block.ls2,
                cast(nn.Module, attention.q_norm),
                cast(nn.Module, attention.k_norm),
                cast(nn.Module, attention.norm),
                cast(nn.Module, mlp.norm),
            ),
        )

    def block_with_logits(
        self, index: int, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``index`` and its un-normalised attention matrix (Eq. 10)."""
        if not 0 <= index < self.num_blocks:
            raise ModelError(f"block index {index} out of range 0..{self.num_blocks - 1}")
        block = cast(Block, self.vit.blocks[index])  # to_fhe_friendly refuses other blocks
        attention = self.block_modules(index).attention
        attended, logits = attention.forward_with_logits(block.norm1(hidden))
        hidden = hidden + block.drop_path1(block.ls1(attended))
        hidden = hidden + block.drop_path2(block.ls2(block.mlp(block.norm2(hidden))))
        return hidden, logits

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, pooling and classifier on the last block's output ``b_L``."""
        return self.vit.forward_head(self.vit.norm(hidden))

    def forward_intermediates(self, images: torch.Tensor) -> Intermediates:
        hidden = self.embed(images)
        embedding = hidden
        attention, states = [], []
        for index in range(self.num_blocks):
            hidden, logits = self.block_with_logits(index, hidden)
            attention.append(logits)
            states.append(hidden)
        return Intermediates(embedding, attention, states, self.head(hidden))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(images)
        for index in range(self.num_blocks):
            hidden = self.block(index, hidden)
        return self.head(hidden)

    def with_approx(self, approx: ApproxConfig) -> FheViT:
        """A copy with the same weights but other approximations.

        Input bounds depend on the approximations before each layer, so they are not copied:
        calibrate the copy (:func:`fedfm.approx.calibrate`) unless ``approx`` is exact.
        """
        return to_fhe_friendly(self.vit, approx)


def to_fhe_friendly(model: nn.Module, approx: ApproxConfig) -> FheViT:
    """Copy ``model`` (a timm ``VisionTransformer`` or an :class:`FheViT`) and replace its
    non-linearities as ``approx`` says; the source is untouched.

    Raises :class:`ModelError` for another model and for architectures the block decomposition
    cannot represent (blocks other than timm's ``Block``, attention pooling, gated attention,
    non-polynomial layers).
    """
    vit = model.vit if isinstance(model, FheViT) else model
    if not isinstance(vit, VisionTransformer):
        raise ModelError(f"expected a timm VisionTransformer, got {type(vit).__name__}")
    for index, block in enumerate(vit.blocks):
        if type(block) is not Block:
            raise ModelError(
                f"block {index} is a {type(block).__name__}; the FHE-friendly ViT needs "
                "timm's Block"
            )
    if vit.global_pool == "map":
        raise ModelError("attention-pooling heads ('map') are not supported")
    vit = copy.deepcopy(vit)
    _swap_modules(vit, approx)
    return FheViT(vit, approx)
