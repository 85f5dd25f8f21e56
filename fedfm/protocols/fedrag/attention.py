"""Distributed attention by the online-softmax decomposition (spec 002 §4.1, Eqs. 4-6).

Eqs. 4-6 lost their symbols in extraction; reconstructed from the prose. For queries ``Q`` and
the keys and values ``K_i, V_i`` held by node ``i`` (scores ``A_i = Q K_i^T * scaling``):

* Eq. 4, node-local output:       ``O_i = softmax(A_i) V_i`` (normalised over node ``i``'s keys)
* Eq. 5, local normaliser:        ``l_i = log sum_j exp(A_i[:, j])`` (kept as a log-sum-exp)
* Eq. 6, global aggregation:      ``l = log sum_i exp(l_i)``,  ``O = sum_i exp(l_i - l) O_i``

(row-wise). With scrambled inputs (§4.4) the compute node returns ``O_i'`` and ``l_i``; the
scores, hence ``l_i``, are unchanged by the scrambling (Lemma 1) and ``O_i = O_i' M^{-1}``.

Everything here takes and returns ``(heads, tokens, head_dim)`` arrays (numpy or torch); the
arithmetic runs in torch, in the inputs' dtype, with the softmax in float32 or wider as
transformers' eager attention does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedfm.errors import ProtocolError

Part = tuple[torch.Tensor, torch.Tensor]  # (output (h, n, d), log-sum-exp (h, n))


def _tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


def causal_mask(queries: int, keys: int, *, offset: int) -> torch.Tensor:
    """Boolean ``(queries, keys)``: query ``i`` (at position ``offset + i`` of a block whose keys
    start at position 0) may attend to key ``j`` iff ``j <= offset + i``."""
    rows = torch.arange(queries).unsqueeze(1) + offset
    return torch.arange(keys).unsqueeze(0) <= rows


def attention_with_lse(
    q: np.ndarray | torch.Tensor,
    k: np.ndarray | torch.Tensor,
    v: np.ndarray | torch.Tensor,
    *,
    scaling: float,
    allowed: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Part:
    """Eqs. 4-5: ``(softmax(Q K^T s) V, logsumexp(Q K^T s))`` per head, over the keys ``allowed``
    (boolean ``(n, m)``; ``None``: all). ``compute_dtype`` (e.g. bfloat16) runs the two matrix
    products in that type; the softmax is float32 or the inputs' wider type."""
    q, k, v = _tensor(q), _tensor(k), _tensor(v)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or q.shape[-1] != k.shape[-1]:
        raise ProtocolError(
            "attention takes (heads, tokens, dim) arrays with matching dims, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2] or q.shape[0] != k.shape[0]:
        raise ProtocolError(
            f"keys {tuple(k.shape)}, values {tuple(v.shape)} and queries {tuple(q.shape)} disagree "
            "on heads or tokens"
        )
    dtype = compute_dtype or q.dtype
    soft = torch.promote_types(dtype, torch.float32)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(1, 2)).to(soft) * scaling
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1))
    weights = torch.nan_to_num(weights, nan=0.0)  # rows with no allowed key
    output = torch.matmul(weights.to(dtype), v.to(dtype)).to(soft)
    return output, lse


def merge_attention(parts: Sequence[Part]) -> Part:
    """Eq. 6: the global output and log-sum-exp from per-node parts (row-wise)."""
    if not parts:
        raise ProtocolError("merging attention needs at least one part")
    lses = torch.stack([lse.to(torch.float64) for _, lse in parts])
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total.unsqueeze(0))
    weights = torch.nan_to_num(weights, nan=0.0)
    output = sum(
        weight.unsqueeze(-1) * out.to(torch.float64)
        for weight, (out, _) in zip(weights, parts, strict=True)
    )
    dtype = parts[0][0].dtype
    return output.to(dtype), total.to(parts[0][1].dtype)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(kv_heads, n, d)`` -> ``(kv_heads * groups, n, d)`` (grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=0)
