"""SLIP's experiments (spec 003 §5): Fig. 12, Fig. 13 and the Fig. 14 fine-tuning table.

On the shared decoder (default ``llama_fedfm_tiny``; any causal LM by name or folder), perplexity
on its held-out docstrings (:func:`fedfm.experiments.slip_models.decoder_task`):

* **Fig. 12** (``fedfm slip-figures``): the top ``s`` singular components removed from one layer
  type in one block (what David alone holds of that layer, ``W_D``), perplexity averaged over
  the blocks, per layer type and ``s``;
* **Fig. 13** (same command): windows of 1 and 3 consecutive blocks bypassed (the block returns
  its input), perplexity per window centre;
* **Fig. 14** (``fedfm slip-finetune``): David fine-tunes his ``W_D``-only model on public text
  (the decoder's training split: public standard-library docstrings) with AdamW, every
  parameter trainable, for a fixed budget of steps; per decomposition configuration the
  perplexity before and after, and the share of the gap to the original model it closes.
  Two adversaries: ``full`` trains every weight; ``subspace`` uses what ``W_D`` itself reveals
  (the seed's App. A.1 argument, for any ``k``): a null space of each split ``W_D`` is
  ``W_C``'s row or column space (:func:`hidden_basis`), so ``W_C = A B^T`` with one factor
  known, and he trains only the other. Control: the same budget from random weights.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.errors import ConfigError
from fedfm.experiments.results import write_results
from fedfm.experiments.slip_bench import david_model
from fedfm.experiments.slip_models import Task, decoder_task, risk
from fedfm.protocols.slip.decomposition import block_of, build_plan, split_weight
from fedfm.protocols.slip.hybrid import decompose, linear_layers

REMOVED = (0, 1, 2, 4, 8, 16, 32)
WINDOWS = (1, 3)


def _perplexity(task: Task, model: Any) -> float:
    return math.exp(risk(task, model))


def removal_curves(
    task: Task, removed: Sequence[int] = REMOVED, log: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Fig. 12: perplexity with the top ``s`` components of one layer in one block removed,
    averaged over blocks (one row per layer type and ``s``)."""
    model = task.model
    by_type: dict[str, list[str]] = {}
    for name in linear_layers(model):
        found = block_of(name)
        if found is not None:
            by_type.setdefault(found[1], []).append(name)
    rows = []
    for layer_type, names in by_type.items():
        log(f"[fedfm] slip fig. 12: {layer_type}")
        for count in removed:
            values = []
            for name in names:
                layer = dict(model.named_modules())[name]
                original = layer.weight.detach().clone()
                if count:
                    split = split_weight(original.double().numpy(), count, name=name)
                    with torch.no_grad():
                        layer.weight.copy_(torch.from_numpy(split.david).float())
                try:
                    values.append(_perplexity(task, model))
                finally:
                    with torch.no_grad():
                        layer.weight.copy_(original)
            rows.append(
                {
                    "layer_type": layer_type,
                    "removed": count,
                    "perplexity": float(np.mean(values)),
                    "perplexity_per_block": values,
                }
            )
    return rows


def _bypass(layers: torch.nn.ModuleList, indices: Sequence[int]) -> list[Any]:
    """Forward hooks making the decoder layers ``indices`` return their input."""

    def identity(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return [layers[i].register_forward_hook(identity, with_kwargs=True) for i in indices]


def bypass_curves(task: Task, windows: Sequence[int] = WINDOWS) -> list[dict[str, Any]]:
    """Fig. 13: perplexity with ``w`` consecutive blocks bypassed, per window centre."""
    layers = task.model.model.layers
    rows = [{"window": 0, "centre": -1, "perplexity": _perplexity(task, task.model)}]
    for window in windows:
        if window > len(layers):
            continue
        for start in range(len(layers) - window + 1):
            handles = _bypass(layers, range(start, start + window))
            try:
                value = _perplexity(task, task.model)
            finally:
                for handle in handles:
                    handle.remove()
            rows.append({"window": window, "centre": start + window // 2, "perplexity": value})
    return rows


def plot_figures(fig12: list[dict[str, Any]], fig13: list[dict[str, Any]], path: Path) -> None:
    """Fig. 12 and Fig. 13 side by side as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for layer_type in dict.fromkeys(row["layer_type"] for row in fig12):
        points = [(r["removed"], r["perplexity"]) for r in fig12 if r["layer_type"] == layer_type]
        xs = [max(x, 0.5) for x, _ in points]
        left.plot(xs, [y for _, y in points], marker="o", label=layer_type)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("singular components removed (one layer, one block; 0 at 0.5)")
    left.set_ylabel("held-out perplexity (mean over blocks)")
    left.set_title("Fig. 12: what W_D alone is worth, per layer type")
    left.legend(fontsize=7)
    base = next(r["perplexity"] for r in fig13 if r["window"] == 0)
    for window in sorted({r["window"] for r in fig13 if r["window"]}):
        points = [(r["centre"], r["perplexity"]) for r in fig13 if r["window"] == window]
        right.plot(*zip(*points, strict=True), marker="o", label=f"{window} blocks bypassed")
    right.axhline(base, color="grey", linestyle="--", label="no block bypassed")
    right.set_yscale("log")
    right.set_xlabel("centre block of the bypassed window")
    right.set_ylabel("held-out perplexity")
    right.set_title("Fig. 13: bypassed windows")
    right.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_slip_figures(
    *,
    model: str = "llama_fedfm_tiny",
    cache_dir: Path = Path("runs/cache"),
    blocks: int = 8,
    results_dir: Path = Path("results"),
    command: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Fig. 12 and Fig. 13: ``slip_fig12.json/.md``, ``slip_fig13`` in the same files, a PNG."""
    torch.manual_seed(0)
    task = decoder_task(model, cache_dir=cache_dir, blocks=blocks)
    fig12 = removal_curves(task, log=log)
    fig13 = bypass_curves(task)
    plot = results_dir / "slip_fig12.png"
    plot_figures(fig12, fig13, plot)
    tokens = int(task.inputs["input_ids"].numel())
    write_results(
        results_dir,
        "slip_fig12",
        title="SLIP Fig. 12 and Fig. 13: perplexity without singular components or blocks",
        description=(
            f"{model}, held-out perplexity on {blocks} blocks ({tokens} tokens) of held-out "
            "standard-library docstrings. Fig. 12 rows: the top singular components removed "
            "from one layer type in one block (W replaced by W_D), mean over blocks. Fig. 13 "
            f"(in the JSON, key fig13; plot {plot.name}): windows of consecutive blocks "
            "bypassed."
        ),
        rows=fig12,
        columns=[
            ("layer_type", "layer type"),
            ("removed", "components removed"),
            ("perplexity", "perplexity (mean over blocks)"),
        ],
        extra={"fig13": fig13, "plot": str(plot)},
        command=command,
    )
    return {"fig12": fig12, "fig13": fig13}


# -- Fig. 14 ---------------------------------------------------------------------------------------

FINETUNE_CONFIGS: tuple[tuple[str, str, int], ...] = (
    ("1", "all", 32),
    ("2", "first-last", 8),
)
FINETUNE_TOKENS = 64  # training sequences: the first half of each public block (CPU budget)


class SubspaceLinear(torch.nn.Module):
    """David's model of a split layer: ``W_D + A B^T`` where one factor is a basis ``W_D``
    reveals and only the other is trained (:func:`hidden_basis`)."""

    def __init__(self, linear: torch.nn.Linear, basis: np.ndarray, side: str) -> None:
        super().__init__()
        self.linear, self.side = linear, side
        for parameter in linear.parameters():
            parameter.requires_grad_(False)
        self.register_buffer("basis", torch.from_numpy(basis).float())
        size = linear.out_features if side == "right" else linear.in_features
        self.free = torch.nn.Parameter(torch.zeros(size, basis.shape[1]))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        basis: torch.Tensor = self.basis  # type: ignore[assignment]
        if self.side == "right":  # W_C = free basis^T: the row space is known
            return self.linear(inputs) + (inputs @ basis) @ self.free.T
        return self.linear(inputs) + (inputs @ self.free) @ basis.T  # W_C = basis free^T


def hidden_basis(weight: np.ndarray, k: int) -> tuple[np.ndarray, str]:
    """What ``W_D`` (``m x n``, from a full-rank ``W``) reveals of ``W_C``: for ``m >= n`` its
    ``k``-dimensional right null space is ``W_C``'s row space (``side = "right"``); for
    ``m < n`` its ``k``-dimensional left null space is ``W_C``'s column space (``"left"``).
    The seed's App. A.1 argument, for any ``k``."""
    u, _, vt = np.linalg.svd(weight, full_matrices=True)
    rank = min(weight.shape) - k
    if weight.shape[0] >= weight.shape[1]:
        return vt[rank : rank + k].T.copy(), "right"
    return u[:, rank : rank + k].copy(), "left"


def subspace_model(model: Any, splits: dict[str, int]) -> Any:
    """David's W_D-only model with :class:`SubspaceLinear` on each split layer; nothing else
    trainable."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for name, k in splits.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attribute)
        basis, side = hidden_basis(linear.weight.detach().double().numpy(), k)
        setattr(parent, attribute, SubspaceLinear(linear, basis, side))
    return model


def finetune(
    model: Any, blocks: torch.Tensor, *, steps: int, batch: int, lr: float, seed: int = 0
) -> Any:
    """AdamW on next-token loss over ``blocks`` (public text), ``steps`` steps."""
    model.train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    generator = np.random.default_rng(seed)
    for _ in range(steps):
        rows = torch.from_numpy(generator.choice(len(blocks), size=batch, replace=False))
        ids = blocks[rows]
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimiser.step()
    return model.eval()


def restoration(model_ppl: float, before: float, after: float) -> float:
    """Share of the log-perplexity gap between ``before`` and the model closed by ``after``."""
    gap = math.log(before) - math.log(model_ppl)
    return (math.log(before) - math.log(after)) / gap if gap > 0 else 0.0


def finetune_table(
    task: Task,
    *,
    configs: Sequence[tuple[str, str, int]] = FINETUNE_CONFIGS,
    steps: int = 80,
    batch: int = 4,
    lr: float = 3e-3,
    subspace_lr: float = 3e-3,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Fig. 14's rows: one per configuration, plus the random-weights control."""
    if task.train is None:
        raise ConfigError("fine-tuning needs the task's public training blocks")
    public = task.train["input_ids"][:, :FINETUNE_TOKENS]
    model = task.model
    model_ppl = _perplexity(task, model)
    rows = []
    total_linear = sum(m.weight.numel() for m in linear_layers(model).values())
    for index, blocks, k in configs:
        plan = build_plan(linear_layers(model), blocks=blocks, rank=k)
        decomposition = decompose(model, plan)
        exposed = david_model(model, decomposition)
        before = _perplexity(task, exposed)
        log(f"[fedfm] slip fig. 14: config {index} ({blocks}, k={k}): full fine-tuning")
        start = time.perf_counter()
        full = finetune(copy.deepcopy(exposed), public, steps=steps, batch=batch, lr=lr)
        full_s = time.perf_counter() - start
        log(f"[fedfm] slip fig. 14: config {index}: subspace fine-tuning")
        informed = subspace_model(copy.deepcopy(exposed), plan)
        informed = finetune(informed, public, steps=steps, batch=batch, lr=subspace_lr)
        after_full, after_sub = _perplexity(task, full), _perplexity(task, informed)
        flops_charlie = sum(
            k * (s.left.shape[0] + s.right.shape[0]) for s in decomposition.splits.values()
        )
        rows.append(
            {
                "config": index,
                "blocks": blocks,
                "excised_sv": k,
                "split_layers": len(plan),
                "density": decomposition.density,
                "offload_linear": 1.0 - flops_charlie / total_linear,
                "model_perplexity": model_ppl,
                "david_only_perplexity": before,
                "full_ft_perplexity": after_full,
                "full_ft_restored": restoration(model_ppl, before, after_full),
                "subspace_ft_perplexity": after_sub,
                "subspace_ft_restored": restoration(model_ppl, before, after_sub),
                "subspace_parameters": sum(
                    p.numel() for p in informed.parameters() if p.requires_grad
                ),
                "full_ft_seconds": full_s,
            }
        )
    log("[fedfm] slip fig. 14: random weights (control)")
    random = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in random.parameters():
            if parameter.ndim >= 2:
                parameter.normal_(0.0, 0.02, generator=generator)
    before = _perplexity(task, random)
    after = _perplexity(task, finetune(random, public, steps=steps, batch=batch, lr=lr))
    rows.append(
        {
            "config": "Rand",
            "blocks": "all (random weights)",
            "excised_sv": None,
            "density": 1.0,
            "offload_linear": 0.0,
            "model_perplexity": model_ppl,
            "david_only_perplexity": before,
            "full_ft_perplexity": after,
            "full_ft_restored": restoration(model_ppl, before, after),
        }
    )
    return rows


def plot_finetune(rows: list[dict[str, Any]], path: Path) -> None:
    """Fig. 14: perplexity of the W_D-only model before and after fine-tuning, per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['config']}: {r['blocks']}" + (f", k={r['excised_sv']}" if r["excised_sv"] else "")
        for r in rows
    ]
    series = [
        ("W_D only", "david_only_perplexity"),
        ("full FT", "full_ft_perplexity"),
        ("subspace FT", "subspace_ft_perplexity"),
    ]
    figure, axis = plt.subplots(figsize=(9, 4))
    width = 0.27
    for offset, (name, key) in enumerate(series):
        values = [r.get(key) or float("nan") for r in rows]
        positions = [i + (offset - 1) * width for i in range(len(rows))]
        axis.bar(positions, values, width, label=name)
    axis.axhline(rows[0]["model_perplexity"], color="grey", linestyle="--", label="original")
    axis.set_yscale("log")
    axis.set_xticks(range(len(rows)), labels, fontsize=8)
    axis.set_ylabel("held-out perplexity")
    axis.set_title("Fig. 14: David fine-tunes his W_D-only model on public text")
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_slip_finetune(
    *,
    model: str = "llama_fedfm_tiny",
    cache_dir: Path = Path("runs/cache"),
    steps: int = 80,
    public_blocks: int = 256,
    blocks: int = 8,
    results_dir: Path = Path("results"),
    command: str | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Fig. 14: ``slip_finetune.json`` and ``.md``."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a shared 2-core machine: a second thread only spins
    task = decoder_task(model, cache_dir=cache_dir, blocks=blocks, train_blocks=public_blocks)
    rows = finetune_table(task, steps=steps, log=log)
    plot = results_dir / "slip_finetune.png"
    plot_finetune(rows, plot)
    write_results(
        results_dir,
        "slip_finetune",
        title="SLIP Fig. 14: David fine-tunes his W_D-only model on public text",
        description=(
            f"{model}; David's public data: {public_blocks} blocks of its training split "
            f"(standard-library docstrings: public), first {FINETUNE_TOKENS} tokens of each; "
            f"{steps} AdamW steps of batch 4, lr 3e-3, one CPU thread (a small budget: the "
            "machine is shared). Perplexity on held-out docstrings (whole modules never "
            "trained on). restored: share of the log-perplexity gap between the W_D-only model "
            "and the original closed by fine-tuning (1: fully restored). full: every weight "
            "trainable; subspace: only X in W_D + X N^T per split layer, N the null space W_D "
            "reveals. offload_linear: share of the linear layers' multiply-adds David does. "
            f"Rand: the same budget from random weights (control). Plot: {plot.name}."
        ),
        rows=rows,
        columns=[
            ("config", "config"),
            ("blocks", "blocks"),
            ("excised_sv", "excised SV (k)"),
            ("offload_linear", "offload (linear MACs)"),
            ("density", "density eta"),
            ("model_perplexity", "model ppl"),
            ("david_only_perplexity", "W_D-only ppl"),
            ("full_ft_perplexity", "full FT ppl"),
            ("full_ft_restored", "full FT restored"),
            ("subspace_ft_perplexity", "subspace FT ppl"),
            ("subspace_ft_restored", "subspace FT restored"),
        ],
        command=command,
    )
    return rows
