"""``fedfm bench-slip``: SLIP's costs and guarantees per configuration, with its baselines.

For each model (:mod:`fedfm.experiments.slip_models`: the packaged MiniLM on the docstring task,
the shared decoder on held-out docstrings) and each configuration (composition x attention,
:mod:`fedfm.protocols.slip.hybrid`), in one process with both parties:

* ``max_rel_output_error``: ``max |y_slip - y| / max |y|`` over the evaluation set against the
  undecomposed model (float32); ``top1_agreement``: share of equal argmaxes (the classifier's
  label, the decoder's greedy next token at every position);
* ``trusted_flops_share`` (Definition 6): Charlie's online FLOPs over those of the undecomposed
  model run by Charlie alone, both counted by ``torch.utils.flop_counter.FlopCounterMode``
  (matrix products: his ``W_C`` factors, attention scores and mixes) plus his ring work (encode,
  mask, unmask, decode: 2 operations per element each); norms and activations are not counted
  on either side;
* per inference: Charlie's and David's wall time (median of ``repeats``; Charlie's is the run
  minus David's calls), bytes each way, round trips, the pad store's bytes, and Charlie's
  offline setup (``precompute_ms_per_inference``: tracing the model, drawing the pads and
  computing ``W_D r``, divided by the inferences the store serves);
* the decomposition's parameter density (Definition 4) and David-only utility: the model with
  ``W_D`` in place of every split weight, as David holds it (Definition 3's ``kappa`` with no
  adversary training: ``risk(model) / risk(W_D-only)``); Fig. 14 measures it after training.

Baselines in the same harness: Charlie running the whole model alone (Definition 6's reference;
``charlie_alone_ms``), the unmasked split (composition ``unmasked``: what David would see
without masks; same arithmetic), and one split layer evaluated under CKKS with HELIX's machinery
(:mod:`fedfm.protocols.helix.ckks`, N = 8192, 128-bit; replicated-rows layout, one token):
time and bytes beside SLIP's masked evaluation of the same layer and token.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from fedfm.experiments.results import write_results
from fedfm.experiments.slip_models import Task, load_task, risk, utility
from fedfm.protocols.slip.decomposition import build_plan
from fedfm.protocols.slip.hybrid import (
    ATTENTIONS,
    COMPOSITIONS,
    Charlie,
    Decomposition,
    Traffic,
    decompose,
    linear_layers,
)
from fedfm.protocols.slip.pads import PadStore
from fedfm.protocols.slip.ring import (
    ACTIVATION_BITS,
    HEADROOM,
    PRODUCT_BITS,
    WEIGHT_BITS,
    decode,
    decode_weights,
    encode_activations,
    ring_matmul,
    uniform_pads,
)

DEFAULT_MODELS = ("minilm", "llama_fedfm_tiny")
DEFAULT_RANKS = {"minilm": 16, "llama_fedfm_tiny": 8}


def david_model(model: Any, decomposition: Decomposition) -> Any:
    """A copy of ``model`` with David's weights (``W_D`` of split layers, as he holds them)."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for name, layer in linear_layers(copied).items():
            weight = decode_weights(decomposition.david[name])
            layer.weight.copy_(torch.from_numpy(weight).to(layer.weight.dtype))
    return copied.eval()


def flops(run: Callable[[], Any]) -> int:
    """Matrix-product FLOPs of ``run()`` (torch's FlopCounterMode)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        run()
    return int(counter.get_total_flops())


def _median_ms(values: Sequence[float]) -> float:
    return 1000.0 * statistics.median(values)


def _rows(inputs: dict[str, torch.Tensor]) -> int:
    return int(inputs["input_ids"].numel())


def build_charlie(
    task: Task,
    decomposition: Decomposition,
    *,
    composition: str,
    attention: str,
    pad_rows: int,
) -> Charlie:
    """Charlie for ``task``'s model and his pads (``pad_rows`` rows per masked layer)."""
    example = {key: value[:1, :4] for key, value in task.inputs.items()}
    charlie = Charlie(
        copy.deepcopy(task.model),
        decomposition.charlie_share(),
        example,
        composition=composition,
        attention=attention,
    )
    if composition != "unmasked":
        charlie.precompute_pads(decomposition.david_share(), pad_rows)
    return charlie


def accuracy_run(
    task: Task, decomposition: Decomposition, attention: str, batch: int
) -> dict[str, float]:
    """The safe composition on the whole evaluation set: error and agreement."""
    charlie = build_charlie(
        task, decomposition, composition="safe", attention=attention, pad_rows=_rows(task.inputs)
    )
    david = decomposition.david_share()
    errors, agree, total, outputs = [], 0, 0, []
    for inputs in task.batches(batch):
        with torch.no_grad():
            expected = task.model(**inputs).logits
        output, _ = charlie.run(inputs, david)
        got = output.logits
        errors.append(float((got - expected).abs().max() / expected.abs().max()))
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        total += int(expected.argmax(-1).numel())
        outputs.append(got)
    logits = torch.cat(outputs)
    return {
        "max_rel_output_error": max(errors),
        "top1_agreement": agree / total,
        "slip_utility": utility(task, logits),
    }


def timing_run(
    task: Task,
    decomposition: Decomposition,
    *,
    composition: str,
    attention: str,
    repeats: int,
    reference_flops: int,
) -> dict[str, Any]:
    """One inference (the first evaluation item), ``repeats`` times: costs per inference."""
    inputs = task.batches(1)[0]
    rows = _rows(inputs)
    start = time.perf_counter()
    charlie = build_charlie(
        task,
        decomposition,
        composition=composition,
        attention=attention,
        pad_rows=rows * (repeats + 2),
    )
    precompute = time.perf_counter() - start
    david = decomposition.david_share()
    charlie_s, david_s = [], []
    traffic = Traffic()
    charlie.run(inputs, david)  # warm-up (its pads are counted in the store)
    for _ in range(repeats):
        start = time.perf_counter()
        _, traffic = charlie.run(inputs, david)
        total = time.perf_counter() - start
        charlie_s.append(total - traffic.david_seconds)
        david_s.append(traffic.david_seconds)
    counted: list[Traffic] = []
    charlie_flops = flops(lambda: counted.append(charlie.run(inputs, david)[1]))
    share = (charlie_flops + counted[0].ring_ops) / reference_flops
    store: PadStore = charlie.pads
    return {
        "composition": composition,
        "attention": attention,
        "trusted_flops_share": share,
        "charlie_flops": charlie_flops + counted[0].ring_ops,
        "charlie_ms": _median_ms(charlie_s),
        "david_ms": _median_ms(david_s),
        "round_trips": traffic.round_trips,
        "bytes_to_david": traffic.bytes_to_david,
        "bytes_to_charlie": traffic.bytes_to_charlie,
        "masked_items": traffic.masked_items,
        "clear_items": traffic.clear_items,
        "pad_bytes_per_inference": store.nbytes // (repeats + 2) if store.layers else 0,
        "precompute_ms_per_inference": 1000.0 * precompute / (repeats + 2),
        "largest_product_bound": traffic.largest_product_bound,
    }


def he_baseline(task: Task, decomposition: Decomposition, layer: str) -> dict[str, Any]:
    """One token through one split layer's ``W_D``: CKKS (HELIX) against SLIP's masked ring."""
    from fedfm.crypto import CKKS_8192
    from fedfm.protocols.helix.ckks import ClientKeys, ProviderEvaluator
    from fedfm.protocols.helix.packing import ReplicatedRows

    captured: list[torch.Tensor] = []
    module = dict(task.model.named_modules())[layer]
    handle = module.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    with torch.no_grad():
        task.model(**task.batches(1)[0])
    handle.remove()
    token = captured[0].reshape(-1, captured[0].shape[-1])[:1].double().numpy()
    weight = decode_weights(decomposition.david[layer])
    expected = token @ weight.T
    # CKKS: Charlie encrypts, David evaluates with a public context, Charlie decrypts
    start = time.perf_counter()
    keys = ClientKeys.generate(CKKS_8192)
    layout = ReplicatedRows(weight.shape[1], keys.slots)
    context = keys.public_context(layout.rotation_steps())
    upload = keys.encrypt(layout.pack(token))
    charlie_s = time.perf_counter() - start
    start = time.perf_counter()
    evaluator = ProviderEvaluator(context, CKKS_8192)
    outputs = evaluator.linear_rows(
        evaluator.load(upload, 1), layout, weight.T, np.zeros(weight.shape[0])
    )
    result = evaluator.dump(outputs)
    david_s = time.perf_counter() - start
    start = time.perf_counter()
    values = layout.unpack(keys.decrypt(result), 1, weight.shape[0])
    charlie_s += time.perf_counter() - start
    he_bytes = sum(a.nbytes for a in upload.values()) + sum(a.nbytes for a in result.values())
    # SLIP: mask, David's ring product, unmask (the pad precomputed offline, timed apart)
    encoded_weight = decomposition.david[layer]
    pad = uniform_pads(token.shape)
    start = time.perf_counter()
    mask = ring_matmul(pad, encoded_weight)
    precompute_s = time.perf_counter() - start
    start = time.perf_counter()
    with np.errstate(over="ignore"):
        message = encode_activations(token) + pad
    masking_s = time.perf_counter() - start
    start = time.perf_counter()
    answer = ring_matmul(message, encoded_weight)
    slip_david_s = time.perf_counter() - start
    start = time.perf_counter()
    with np.errstate(over="ignore"):
        slip_values = decode(answer - mask)
    slip_charlie_s = masking_s + time.perf_counter() - start
    scale = float(np.abs(expected).max())
    return {
        "layer": layer,
        "shape": f"{weight.shape[0]}x{weight.shape[1]}",
        "ckks": "N=8192 q=[60,40,40,60] scale=2^40 (128-bit), replicated rows",
        "ckks_charlie_ms": 1000.0 * charlie_s,
        "ckks_david_ms": 1000.0 * david_s,
        "ckks_bytes": he_bytes,
        "ckks_context_bytes": int(np.asarray(context).nbytes),
        "ckks_max_rel_error": float(np.abs(values - expected).max()) / scale,
        "slip_charlie_ms": 1000.0 * slip_charlie_s,
        "slip_david_ms": 1000.0 * slip_david_s,
        "slip_precompute_ms": 1000.0 * precompute_s,
        "slip_bytes": int(message.nbytes + answer.nbytes),
        "slip_max_rel_error": float(np.abs(slip_values - expected).max()) / scale,
    }


def bench_model(
    name: str,
    *,
    blocks: str,
    layers: str,
    rank: int,
    repeats: int,
    batch: int,
    cache_dir: Path,
    he: bool,
    log: Callable[[str], None],
    task: Task | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None]:
    """Rows (one per configuration), the model's summary and its HE baseline row."""
    task = task or load_task(name, cache_dir=cache_dir)
    model = task.model
    plan = build_plan(linear_layers(model), blocks=blocks, types=layers, rank=rank)
    decomposition = decompose(model, plan)
    log(f"[fedfm] slip {name}: {len(plan)} split layers, k = {rank}")
    with torch.no_grad():
        reference_logits = torch.cat([model(**b).logits for b in task.batches(batch)])
    single = task.batches(1)[0]
    reference_flops = flops(lambda: model(**single))
    alone = []
    with torch.no_grad():
        model(**single)  # warm-up: first calls allocate
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            model(**single)
        alone.append(time.perf_counter() - start)
    david_only = david_model(model, decomposition)
    with torch.no_grad():
        david_logits = torch.cat([david_only(**b).logits for b in task.batches(batch)])
    model_risk, david_risk = risk(task, model), risk(task, david_only)
    summary = {
        "model": name,
        "split_layers": len(plan),
        "rank": rank,
        "blocks": blocks,
        "parameters": decomposition.total_parameters,
        "charlie_parameters": decomposition.charlie_parameters,
        "density": decomposition.density,
        "charlie_share_of_split_weights": decomposition.charlie_parameters
        / sum(int(np.prod(s.david.shape)) for s in decomposition.splits.values()),
        "utility_metric": "top-1 accuracy" if task.classification else "perplexity",
        "model_utility": utility(task, reference_logits),
        "david_only_utility": utility(task, david_logits),
        "kappa_no_training": model_risk / david_risk,
        "charlie_alone_ms": _median_ms(alone),
        "charlie_alone_flops": reference_flops,
        "evaluation_items": int(task.inputs["input_ids"].shape[0]),
        "tokens_per_inference": _rows(single),
    }
    accuracy = {}
    for attention in ATTENTIONS:
        log(f"[fedfm] slip {name}: {attention}, whole evaluation set")
        accuracy[attention] = accuracy_run(task, decomposition, attention, batch)
    rows = []
    for attention in ATTENTIONS:
        for composition in COMPOSITIONS:
            log(f"[fedfm] slip {name}: {composition}, {attention}, timing")
            row = timing_run(
                task,
                decomposition,
                composition=composition,
                attention=attention,
                repeats=repeats,
                reference_flops=reference_flops,
            )
            rows.append({"model": name, **row, **accuracy[attention]})
    baseline = None
    if he:
        first = next(iter(plan))
        log(f"[fedfm] slip {name}: one layer under CKKS ({first})")
        baseline = {"model": name, **he_baseline(task, decomposition, first)}
    return rows, summary, baseline


COLUMNS = [
    ("model", "model"),
    ("composition", "composition"),
    ("attention", "attention"),
    ("max_rel_output_error", "max rel. error"),
    ("top1_agreement", "top-1 agreement"),
    ("trusted_flops_share", "Charlie FLOPs share"),
    ("charlie_ms", "Charlie ms"),
    ("david_ms", "David ms"),
    ("round_trips", "round trips"),
    ("bytes_to_david", "bytes to David"),
    ("bytes_to_charlie", "bytes to Charlie"),
    ("masked_items", "masked items"),
    ("clear_items", "clear items"),
    ("pad_bytes_per_inference", "pad bytes / inference"),
]


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    from fedfm.experiments.results import markdown_table

    return markdown_table(list(rows), columns)


def run_bench_slip(
    *,
    models: Sequence[str] = DEFAULT_MODELS,
    blocks: str = "first-last",
    layers: str = "all",
    ranks: dict[str, int] | None = None,
    repeats: int = 3,
    batch: int = 16,
    cache_dir: Path = Path("runs/cache"),
    he: bool = True,
    results_dir: Path = Path("results"),
    command: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every model; write ``slip.json`` and ``slip.md``."""
    ranks = {**DEFAULT_RANKS, **(ranks or {})}
    rows, summaries, baselines = [], [], []
    for name in models:
        model_rows, summary, baseline = bench_model(
            name,
            blocks=blocks,
            layers=layers,
            rank=ranks.get(name, 8),
            repeats=repeats,
            batch=batch,
            cache_dir=cache_dir,
            he=he,
            log=log,
        )
        rows += model_rows
        summaries.append(summary)
        if baseline is not None:
            baselines.append(baseline)
    extra = {
        "ring": f"Z_2^64 (numpy uint64); activations 2^{ACTIVATION_BITS}, weights "
        f"2^{WEIGHT_BITS}, products 2^{PRODUCT_BITS}; Lemma 2 headroom |W_D a| < {HEADROOM:g}",
        "max_rel_output_error": max(row["max_rel_output_error"] for row in rows),
        "trusted_flops_share": {
            f"{row['model']}/{row['composition']}/{row['attention']}": row["trusted_flops_share"]
            for row in rows
        },
        "models": summaries,
        "he_baseline": baselines,
    }
    summary_columns = [
        ("model", "model"),
        ("split_layers", "split layers"),
        ("rank", "k"),
        ("density", "density eta"),
        ("utility_metric", "utility"),
        ("model_utility", "model"),
        ("david_only_utility", "W_D only"),
        ("kappa_no_training", "kappa (no training)"),
        ("charlie_alone_ms", "Charlie alone ms"),
        ("tokens_per_inference", "tokens / inference"),
    ]
    he_columns = [
        ("model", "model"),
        ("layer", "layer"),
        ("shape", "W_D"),
        ("ckks_charlie_ms", "CKKS Charlie ms"),
        ("ckks_david_ms", "CKKS David ms"),
        ("ckks_bytes", "CKKS bytes"),
        ("ckks_max_rel_error", "CKKS rel. error"),
        ("slip_charlie_ms", "SLIP Charlie ms"),
        ("slip_david_ms", "SLIP David ms"),
        ("slip_bytes", "SLIP bytes"),
        ("slip_max_rel_error", "SLIP rel. error"),
    ]
    description = (
        "Hybrid inference between Charlie (trusted: W_C factors, pads, input, output) and David "
        "(W_D of the split layers, every other linear layer whole), both in this process. "
        f"Split: every linear layer of blocks {blocks}; k per model as listed. Ring "
        f"{extra['ring']}. Error and agreement over the whole evaluation set against the "
        "undecomposed float32 model (MiniLM: docstring task queries, 32 tokens; decoder: "
        "held-out blocks); costs per inference (one query / one block), medians of "
        f"{repeats} runs on a shared 2-core machine (+-30%). Charlie FLOPs share: his matrix "
        "products (FlopCounterMode) plus 2 ring operations per element masked or unmasked, over "
        "the FLOPs of the undecomposed model.\n\n"
        + _table(summaries, summary_columns)
        + "\n\nOne split layer, one token: CKKS (HELIX's evaluator) against SLIP's masked ring "
        "(CKKS bytes: upload and result ciphertexts; the public context with its Galois keys "
        "is sent once per key and listed in the JSON).\n\n" + _table(baselines, he_columns)
    )
    write_results(
        results_dir,
        "slip",
        title="SLIP: masked hybrid inference, per configuration",
        description=description,
        rows=rows,
        columns=COLUMNS,
        extra=extra,
        command=command,
    )
    return extra
