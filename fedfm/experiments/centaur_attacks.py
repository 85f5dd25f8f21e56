"""The cloud's attacks on CENTAUR (seed §5.2, App. C; Tables 1, 4-5), faithful and hardened.

The adversary is the cloud P1, honest-but-curious, as the seed assumes: it follows the protocol,
holds Θ' (the permuted weights it was provisioned with) and sees every plaintext it reconstructs
for the non-linear layers (exactly what :func:`fedfm.protocols.centaur.local.run_locally`'s
observer records). It is after the client's input tokens and the developer's weights.

* :func:`row_matching` — P1 holds the permuted embedding table ``W_E π`` (and, BERT, the permuted
  position and type embeddings); the faithful protocol shows it ``X_M π`` (the embedding
  LayerNorm's input, Alg. 4), whose rows *are* rows of that table: nearest-row matching reads
  the tokens. Hardened (embedding LayerNorm under secret sharing) the first residual view is
  layer 0's ``(O_4 + X_E) π``: matched against ``LN(W_E π + P π + T π)`` computed from Θ'.
* :func:`permutation_recovery` — when the private model is a fine-tune of a public checkpoint,
  each column of ``W_E π`` is closest to its own column of the public ``W_E``: π falls out
  (and with it Θ from Θ'). Control: the same matching against the public table with its rows
  shuffled (no correspondence).
* :func:`sorted_row_matching` — sorting a row removes any column permutation: sorted rows of the
  view against sorted rows of the *public* embeddings read the tokens without any weight.
* :func:`causal_mask_order` — a decoder's causal mask is added before Π_PPP, so the cloud's
  ``O_1 π_1`` shows the masked entries: counting them per column reads π_1 exactly (then
  ``O_1 = Q K^T``, the seed's 100 %-recovery target, is in the clear), fresh π_1 or not.
* :func:`vocabulary_matching` (Pal et al., ICML 2025) — P1 runs Θ' (a working model in the
  permuted basis) on every candidate next token after the tokens recovered so far and keeps the
  one whose layer-``L`` hidden state equals the view; exact for a causal decoder, at any depth.
* :func:`learned_inversion` — the seed's Table 1 setting (a SIP-style inversion model trained on
  auxiliary text with white-box access to the model): a nearest-centroid token model on layer-0
  rows, applied to the plain rows (W/O), the permuted rows P1 sees (W), random rows (Rand), and
  — the permutation-invariant variant — to *sorted* rows (trained on sorted rows too).

``fedfm centaur-attacks`` writes ``results/centaur_attacks.json`` and ``.md``; the red-team suite
(:func:`red_team_suite`) runs small versions for ``fedfm red-team``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.errors import InvariantError
from fedfm.experiments.results import write_results
from fedfm.protocols.centaur.local import run_locally
from fedfm.protocols.centaur.model import Architecture, Trace, extract, forward, layer_norm
from fedfm.protocols.centaur.provisioning import Deployment, calibrate, prepare

TESTS = "tests/experiments/test_centaur_attacks.py"
MATCHED = 8  # positions the command's vocabulary matching recovers per prompt


def rouge_l(reference: Sequence[int] | np.ndarray, candidate: Sequence[int] | np.ndarray) -> float:
    """ROUGE-L F1 of two token sequences (longest common subsequence)."""
    a, b = list(reference), list(candidate)
    if not a or not b:
        return 0.0
    table = np.zeros((len(a) + 1, len(b) + 1), dtype=np.int64)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1, j + 1] = (
                table[i, j] + 1 if x == y else max(table[i, j + 1], table[i + 1, j])
            )
    lcs = table[-1, -1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(b), lcs / len(a)
    return float(2 * precision * recall / (precision + recall))


def cloud_views(plan: Deployment, ids: np.ndarray, **config: Any) -> dict[str, np.ndarray]:
    """Every plaintext the cloud reconstructs in one run, by step name (``l0.ln1``, ...)."""
    views: dict[str, np.ndarray] = {}

    def observer(role: str, name: str, value: np.ndarray) -> None:
        views.setdefault(name.split("#")[0], value)

    inputs = {
        "developer": plan.developer.arrays(),
        "cloud": plan.cloud.arrays(),
        "client": {"tokens": np.asarray(ids)},
    }
    run_locally(plan.run_config(**config), inputs, observer=observer)
    return views


def _nearest(rows: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest (L2) table row for each row."""
    norms = (table**2).sum(axis=1)
    return np.argmin(norms[None, :] - 2 * rows @ table.T, axis=1)


def bert_candidates(
    weights: Mapping[str, np.ndarray], position: int, eps: float, *, normalised: bool
) -> np.ndarray:
    """Every token's embedding at ``position`` (``X_M`` rows), or after the embedding LN."""
    rows = weights["embed.word"] + weights["embed.position"][position] + weights["embed.type"]
    if normalised:
        rows = layer_norm(rows, weights["embed.ln.g"], weights["embed.ln.b"], eps)
    return rows


def row_matching(
    architecture: Architecture,
    permuted: Mapping[str, np.ndarray],
    view: np.ndarray,
    *,
    normalised: bool,
) -> np.ndarray:
    """Tokens read from a view by nearest rows of Θ's permuted embeddings (module docstring)."""
    if architecture.kind == "llama":
        return _nearest(view, permuted["embed.word"])
    return np.asarray(
        [
            _nearest(
                view[i : i + 1],
                bert_candidates(permuted, i, architecture.eps, normalised=normalised),
            )[0]
            for i in range(len(view))
        ]
    )


def sorted_row_matching(
    architecture: Architecture,
    public: Mapping[str, np.ndarray],
    view: np.ndarray,
    *,
    normalised: bool,
) -> np.ndarray:
    """Tokens read by comparing sorted rows with sorted public embeddings (no private weight)."""
    seen = np.sort(view, axis=1)
    if architecture.kind == "llama":
        return _nearest(seen, np.sort(public["embed.word"], axis=1))
    return np.asarray(
        [
            _nearest(
                seen[i : i + 1],
                np.sort(
                    bert_candidates(public, i, architecture.eps, normalised=normalised), axis=1
                ),
            )[0]
            for i in range(len(view))
        ]
    )


def permutation_recovery(
    permuted_table: np.ndarray, public_table: np.ndarray, truth: np.ndarray
) -> float:
    """Fraction of π recovered by matching the permuted table's columns to the public ones."""
    a = (permuted_table - permuted_table.mean(0)) / (permuted_table.std(0) + 1e-12)
    b = (public_table - public_table.mean(0)) / (public_table.std(0) + 1e-12)
    correlation = b.T @ a / len(a)  # public column x permuted column
    guess = np.argmax(correlation, axis=0)  # for each permuted column j: its public column
    return float(np.mean(guess == truth))


def causal_mask_order(view: np.ndarray) -> np.ndarray:
    """π_1 of a decoder's attention, read off the cloud's permuted scores ``O_1 π_1``: key
    position ``c`` is masked (the additive ``-10^4``) for the ``c`` queries before it, so the
    number of masked entries in an observed column is its original position."""
    scores = view[0] if view.ndim == 3 else view
    return (scores < -1e3).sum(axis=0)


# -- vocabulary matching on a decoder -----------------------------------------------------------


def llama_from_weights(template: Any, weights: Mapping[str, np.ndarray]) -> Any:
    """A copy of the Hugging Face Llama ``template`` carrying ``weights`` (e.g. Θ')."""
    import copy

    model = copy.deepcopy(template).float().eval()
    inner = model.model

    def put(parameter: torch.nn.Parameter, value: np.ndarray) -> None:
        parameter.data = torch.as_tensor(np.ascontiguousarray(value), dtype=torch.float32)

    put(inner.embed_tokens.weight, weights["embed.word"])
    for index, layer in enumerate(inner.layers):
        p = f"l{index}"
        put(layer.input_layernorm.weight, weights[f"{p}.norm1.g"])
        put(layer.post_attention_layernorm.weight, weights[f"{p}.norm2.g"])
        for name in ("q", "k", "v", "o"):
            put(getattr(layer.self_attn, f"{name}_proj").weight, weights[f"{p}.{name}.w"].T)
        for name in ("gate", "up", "down"):
            put(getattr(layer.mlp, f"{name}_proj").weight, weights[f"{p}.{name}.w"].T)
    put(inner.norm.weight, weights["norm.g"])
    model.lm_head.weight = torch.nn.Parameter(
        torch.as_tensor(np.ascontiguousarray(weights["head.w"].T), dtype=torch.float32)
    )
    return model


def vocabulary_matching(model: Any, view: np.ndarray, layer: int, vocab: int) -> np.ndarray:
    """Pal et al.: recover tokens left to right from the layer-``layer`` residual view."""
    recovered: list[int] = []
    candidates = torch.arange(vocab)[:, None]
    with torch.no_grad():
        for position in range(len(view)):
            prefix = torch.as_tensor(recovered, dtype=torch.long)[None].expand(vocab, -1)
            batch = torch.cat([prefix, candidates], dim=1)
            hidden = model(batch, output_hidden_states=True).hidden_states[layer][:, -1]
            distance = ((hidden.numpy() - view[position]) ** 2).sum(axis=1)
            recovered.append(int(np.argmin(distance)))
    return np.asarray(recovered)


# -- learned inversion (Table 1) --------------------------------------------------------------


def train_inversion(rows: np.ndarray, tokens: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The inversion model: one centroid per token of the auxiliary rows (standardised), a
    query row read as the token of the nearest centroid. Weaker than SIP's GRU, CPU-sized."""
    classes, targets = np.unique(tokens, return_inverse=True)
    mean, std = rows.mean(0), rows.std(0) + 1e-6
    scaled = (rows - mean) / std
    centroids = np.stack([scaled[targets == k].mean(0) for k in range(len(classes))])

    def predict(query: np.ndarray) -> np.ndarray:
        return np.asarray(classes[_nearest((query - mean) / std, centroids)])

    return predict


def learned_inversion(
    architecture: Architecture,
    weights: Mapping[str, np.ndarray],
    auxiliary: Sequence[np.ndarray],
    victims: Sequence[np.ndarray],
    views: Sequence[Mapping[str, np.ndarray]],
    targets: Mapping[str, str],
) -> dict[str, dict[str, float]]:
    """Token accuracy and ROUGE-L of the inversion model per target (module docstring).

    ``targets`` maps a trace name (plain intermediate) to the cloud's view name (permuted)."""
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, float]] = {}
    traces = []
    for ids in auxiliary:
        trace = Trace()
        forward(architecture, weights, ids, trace=trace)
        traces.append(trace.values)
    victim_traces = []
    for ids in victims:
        trace = Trace()
        forward(architecture, weights, ids, trace=trace)
        victim_traces.append(trace.values)
    tokens = np.concatenate(auxiliary)
    for trace_name, view_name in targets.items():
        rows = np.concatenate([t[trace_name] for t in traces])
        plain_model = train_inversion(rows, tokens)
        sorted_model = train_inversion(np.sort(rows, axis=1), tokens)
        scores: dict[str, list[float]] = {
            k: [] for k in ("plain", "permuted", "random", "sorted_permuted")
        }
        accuracy: dict[str, list[float]] = {k: [] for k in scores}
        for ids, values, view in zip(victims, victim_traces, views, strict=True):
            observed = view[view_name]
            guesses = {
                "plain": plain_model(values[trace_name]),
                "permuted": plain_model(observed),
                "random": plain_model(rng.normal(rows.mean(), rows.std(), observed.shape)),
                "sorted_permuted": sorted_model(np.sort(observed, axis=1)),
            }
            for key, guess in guesses.items():
                scores[key].append(rouge_l(ids, guess))
                accuracy[key].append(float(np.mean(guess == ids)))
        results[trace_name] = {f"{k}_rouge_l": float(np.mean(v)) for k, v in scores.items()} | {
            f"{k}_token_accuracy": float(np.mean(v)) for k, v in accuracy.items()
        }
    return results


# -- the command ------------------------------------------------------------------------------


def _accuracy(guess: np.ndarray, ids: np.ndarray) -> float:
    return float(np.mean(np.asarray(guess) == np.asarray(ids)))


def encoder_attacks(
    cache_dir: Path, victims_count: int, log: Callable[[str], None]
) -> dict[str, Any]:
    from fedfm.experiments.centaur_bench import encoder_setup
    from fedfm.experiments.centaur_data import public_minilm

    classifier, architecture, weights, victims, calibration = encoder_setup(cache_dir, log)
    _, public_weights = extract_public_bert(public_minilm())
    victims = victims[:victims_count]
    out: dict[str, Any] = {"victims": len(victims), "tokens": len(victims[0])}
    modes: dict[str, Any] = {}
    all_views = {}
    for mode in ("faithful", "hardened"):
        plan = prepare(architecture, weights, mode=mode, calibration=calibration)
        if plan.permutations is None:
            raise InvariantError("a permuted deployment keeps its permutations")
        views = [cloud_views(plan, ids) for ids in victims]
        all_views[mode] = views
        permuted = plan.cloud.weights
        faithful_view = "embed.ln" if mode == "faithful" else "l0.ln1"
        normalised = mode != "faithful"
        row = [
            _accuracy(
                row_matching(architecture, permuted, v[faithful_view], normalised=normalised), ids
            )
            for v, ids in zip(views, victims, strict=True)
        ]
        sorted_rows = [
            _accuracy(
                sorted_row_matching(
                    architecture, public_weights, v[faithful_view], normalised=normalised
                ),
                ids,
            )
            for v, ids in zip(views, victims, strict=True)
        ]
        truth = plan.permutations.hidden
        recovered = permutation_recovery(
            permuted["embed.word"], public_weights["embed.word"], truth
        )
        shuffled = public_weights["embed.word"][
            np.random.default_rng(1).permutation(architecture.vocab)
        ]
        control = permutation_recovery(permuted["embed.word"], shuffled, truth)
        modes[mode] = {
            "view": faithful_view,
            "row_matching_token_accuracy": float(np.mean(row)),
            "sorted_row_matching_token_accuracy": float(np.mean(sorted_rows)),
            "permutation_recovered_fraction": recovered,
            "permutation_recovered_fraction_control_shuffled_public": control,
        }
        log(f"[fedfm] centaur-attacks: encoder {mode}: {modes[mode]}")
    out["modes"] = modes
    auxiliary = classifier.ids(classifier.data.public[:300])
    targets = {"l0.ln1.input": "l0.ln1", "l0.up": "l0.gelu", "l0.ln2.input": "l0.ln2"}
    out["learned_inversion"] = {
        mode: learned_inversion(architecture, weights, auxiliary, victims, all_views[mode], targets)
        for mode in ("faithful", "hardened")
    }
    return out


def extract_public_bert(model: Any) -> tuple[None, dict[str, np.ndarray]]:
    """The public checkpoint's embeddings and embedding LayerNorm (a BertModel has no head)."""
    emb = model.embeddings
    return None, {
        "embed.word": emb.word_embeddings.weight.detach().double().numpy(),
        "embed.position": emb.position_embeddings.weight.detach().double().numpy(),
        "embed.type": emb.token_type_embeddings.weight.detach().double().numpy()[0],
        "embed.ln.g": emb.LayerNorm.weight.detach().double().numpy(),
        "embed.ln.b": emb.LayerNorm.bias.detach().double().numpy(),
    }


def decoder_attacks(
    model: Any, tokenizer: Any, prompts: Sequence[np.ndarray], log: Callable[[str], None]
) -> dict[str, Any]:
    architecture, weights = extract(model)
    calibration = calibrate(architecture, weights, prompts[:2])
    out: dict[str, Any] = {}
    for mode in ("faithful", "hardened"):
        plan = prepare(architecture, weights, mode=mode, calibration=calibration)
        permuted_model = llama_from_weights(model, plan.cloud.weights)
        views = [cloud_views(plan, ids, **{"max-new-tokens": 1}) for ids in prompts]
        first = "l0.norm1" if mode == "faithful" else "l0.norm2"
        row = [
            _accuracy(
                row_matching(architecture, plan.cloud.weights, v[first], normalised=False), ids
            )
            for v, ids in zip(views, prompts, strict=True)
        ]
        # vocabulary matching costs vocab x position forward passes: the first MATCHED
        # positions of two prompts, at the second layer and the last one
        by_layer = {}
        for layer in sorted({1, architecture.layers - 1}):
            guesses = [
                vocabulary_matching(
                    permuted_model, v[f"l{layer}.norm1"][:MATCHED], layer, architecture.vocab
                )
                for v in views[:2]
            ]
            by_layer[f"layer_{layer}"] = float(
                np.mean(
                    [_accuracy(g, ids[:MATCHED]) for g, ids in zip(guesses, prompts, strict=False)]
                )
            )
        random_view = np.random.default_rng(2).normal(0, 1, views[0]["l1.norm1"][:MATCHED].shape)
        control = _accuracy(
            vocabulary_matching(permuted_model, random_view, 1, architecture.vocab),
            prompts[0][:MATCHED],
        )
        orders = [causal_mask_order(v["l0.softmax"]) for v in views]
        mask_reads_pi = float(np.mean([sorted(o) == list(range(len(o))) for o in orders]))
        out[mode] = {
            "causal_mask_reads_pi1_fraction": mask_reads_pi,
            "first_residual_view": first,
            "row_matching_token_accuracy": float(np.mean(row)),
            "vocabulary_matching_token_accuracy": by_layer,
            "vocabulary_matching_control_random_view": control,
        }
        log(f"[fedfm] centaur-attacks: decoder {mode}: {out[mode]}")
    return out


def run_centaur_attacks(
    *,
    results_dir: Path = Path("results"),
    cache_dir: Path = Path("runs/cache"),
    victims: int = 4,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Table 1 and the attacks above on the bench's models; write ``centaur_attacks.*``."""
    from fedfm.experiments.centaur_bench import decoder_setup
    from fedfm.experiments.centaur_data import decoder

    encoder = encoder_attacks(cache_dir, victims, log)
    model, tokenizer = decoder(cache_dir, log=log)
    _, _, prompts, _ = decoder_setup(cache_dir, log)
    decoder_results = decoder_attacks(model, tokenizer, prompts[:victims], log)
    rows = []
    for mode, entry in encoder["modes"].items():
        rows += [
            {
                "model": "MiniLM",
                "mode": mode,
                "attack": f"row matching ({entry['view']})",
                "value": entry["row_matching_token_accuracy"],
                "control": None,
                "metric": "token accuracy",
            },
            {
                "model": "MiniLM",
                "mode": mode,
                "attack": f"sorted-row matching vs public ({entry['view']})",
                "value": entry["sorted_row_matching_token_accuracy"],
                "control": None,
                "metric": "token accuracy",
            },
            {
                "model": "MiniLM",
                "mode": mode,
                "attack": "pi from the public checkpoint",
                "value": entry["permutation_recovered_fraction"],
                "control": entry["permutation_recovered_fraction_control_shuffled_public"],
                "metric": "fraction of pi",
            },
        ]
        for target, result in encoder["learned_inversion"][mode].items():
            rows += [
                {
                    "model": "MiniLM",
                    "mode": mode,
                    "attack": f"learned inversion {target}: W/O | W | Rand",
                    "value": result["plain_rouge_l"],
                    "control": result["permuted_rouge_l"],
                    "metric": f"ROUGE-L (W/O, W); Rand {result['random_rouge_l']:.3f}",
                },
                {
                    "model": "MiniLM",
                    "mode": mode,
                    "attack": f"sorted learned inversion {target} (on W)",
                    "value": result["sorted_permuted_rouge_l"],
                    "control": result["random_rouge_l"],
                    "metric": "ROUGE-L (control: Rand)",
                },
            ]
    for mode, entry in decoder_results.items():
        rows.append(
            {
                "model": "llama_fedfm_tiny",
                "mode": mode,
                "attack": "causal mask reads pi_1 (then O_1 = QK^T in the clear)",
                "value": entry["causal_mask_reads_pi1_fraction"],
                "control": None,
                "metric": "fraction of prompts, every layer's pi_1 exact",
            }
        )
        rows.append(
            {
                "model": "llama_fedfm_tiny",
                "mode": mode,
                "attack": f"row matching ({entry['first_residual_view']})",
                "value": entry["row_matching_token_accuracy"],
                "control": None,
                "metric": "token accuracy",
            }
        )
        for layer, value in entry["vocabulary_matching_token_accuracy"].items():
            rows.append(
                {
                    "model": "llama_fedfm_tiny",
                    "mode": mode,
                    "attack": f"vocabulary matching, {layer}",
                    "value": value,
                    "control": entry["vocabulary_matching_control_random_view"],
                    "metric": "token accuracy (control: random view)",
                }
            )
    write_results(
        results_dir,
        "centaur_attacks",
        title="CENTAUR: the cloud's attacks (Table 1 setting and beyond), faithful and hardened",
        description=(
            f"The cloud's real views from the protocol's steps (observer), {len(rows)} rows. "
            f"Encoder: fine-tuned MiniLM, {encoder['victims']} docstring queries of "
            f"{encoder['tokens']} tokens; decoder: llama_fedfm_tiny, 16-token prompts. Learned "
            "inversion: nearest-centroid token model, 300 public docstrings' layer-0 rows "
            "of the model (the seed's white-box SIP setting); value = ROUGE-L on plain rows (W/O), "
            "control = on the permuted rows the cloud sees (W)."
        ),
        rows=rows,
        columns=[
            ("model", "model"),
            ("mode", "mode"),
            ("attack", "attack"),
            ("value", "value"),
            ("control", "control"),
            ("metric", "metric"),
        ],
        extra={"encoder": encoder, "decoder": decoder_results},
    )
    return {"encoder": encoder, "decoder": decoder_results}


# -- the red team -----------------------------------------------------------------------------


def red_team_suite() -> list[Any]:
    """Small versions (seconds): the packaged MiniLM with a simulated fine-tune (weights plus
    1 % Gaussian noise, a public seed) as the private model, the micro decoder trained for 12
    steps; outcome against the current code (hardened where it has a defence) and the control."""
    from fedfm.experiments.centaur_data import public_minilm
    from fedfm.experiments.red_team import DEFENDED, SUCCEEDS, AttackResult

    public = public_minilm()
    _, public_weights = extract_public_bert(public)
    architecture, weights = _simulated_fine_tune(public)
    rng = np.random.default_rng(0)  # public: which tokens the victim sends
    ids = np.concatenate([[101], rng.integers(2000, 20000, 14), [102]])
    calibration = calibrate(architecture, weights, [ids])
    results = []
    plans = {
        m: prepare(architecture, weights, mode=m, calibration=calibration)
        for m in ("faithful", "hardened")
    }
    views = {m: cloud_views(plans[m], ids) for m in plans}
    faithful_rows = _accuracy(
        row_matching(
            architecture,
            plans["faithful"].cloud.weights,
            views["faithful"]["embed.ln"],
            normalised=False,
        ),
        ids,
    )
    hardened_rows = _accuracy(
        row_matching(
            architecture,
            plans["hardened"].cloud.weights,
            views["hardened"]["l0.ln1"],
            normalised=True,
        ),
        ids,
    )
    results.append(
        AttackResult(
            "centaur_embedding_row_matching",
            "the client's input tokens",
            "cloud (P1)",
            SUCCEEDS if hardened_rows > 0.5 else DEFENDED,
            "token accuracy, nearest rows of Θ's permuted embeddings vs the cloud's first view "
            "(hardened: layer 0's residual)",
            hardened_rows,
            faithful_rows,
            f"{TESTS}::test_row_matching_reads_tokens_from_the_faithful_view",
            "control: the faithful protocol (the cloud reconstructs X_M π)",
        )
    )
    sorted_hardened = _accuracy(
        sorted_row_matching(
            architecture, public_weights, views["hardened"]["l0.ln1"], normalised=True
        ),
        ids,
    )
    sorted_faithful = _accuracy(
        sorted_row_matching(
            architecture, public_weights, views["faithful"]["embed.ln"], normalised=False
        ),
        ids,
    )
    results.append(
        AttackResult(
            "centaur_sorted_row_matching",
            "the client's input tokens",
            "cloud (P1), no weights",
            SUCCEEDS if sorted_hardened > 0.5 else DEFENDED,
            "token accuracy, sorted rows vs sorted public MiniLM embeddings (hardened view)",
            sorted_hardened,
            sorted_faithful,
            f"{TESTS}::test_sorted_rows_defeat_the_permutation",
            "control: the faithful view",
        )
    )
    truth = plans["hardened"].permutations.hidden  # type: ignore[union-attr]
    recovered = permutation_recovery(
        plans["hardened"].cloud.weights["embed.word"], public_weights["embed.word"], truth
    )
    shuffled = public_weights["embed.word"][rng.permutation(architecture.vocab)]
    results.append(
        AttackResult(
            "centaur_permutation_from_public_checkpoint",
            "π, hence Θ from Θ'",
            "cloud (P1)",
            SUCCEEDS if recovered > 0.5 else DEFENDED,
            "fraction of π recovered by matching columns of W_E π to the public MiniLM",
            recovered,
            permutation_recovery(plans["hardened"].cloud.weights["embed.word"], shuffled, truth),
            f"{TESTS}::test_permutation_recovery_needs_a_public_relative",
            "control: public rows shuffled (no relation to the private model)",
        )
    )
    with tempfile.TemporaryDirectory(prefix="fedfm-centaur-vma-") as folder:
        model = _micro_decoder(Path(folder))
        d_architecture, d_weights = extract(model)
        prompt = np.random.default_rng(1).integers(3, d_architecture.vocab, 8)
        plan = prepare(
            d_architecture,
            d_weights,
            mode="hardened",
            calibration=calibrate(d_architecture, d_weights, [prompt]),
        )
        view = cloud_views(plan, prompt, **{"max-new-tokens": 1})
        permuted_model = llama_from_weights(model, plan.cloud.weights)
        layer = d_architecture.layers - 1
        vma = _accuracy(
            vocabulary_matching(
                permuted_model, view[f"l{layer}.norm1"], layer, d_architecture.vocab
            ),
            prompt,
        )
        random_view = np.random.default_rng(3).normal(0, 1, view[f"l{layer}.norm1"].shape)
        control = _accuracy(
            vocabulary_matching(permuted_model, random_view, layer, d_architecture.vocab), prompt
        )
        orders = causal_mask_order(view["l0.softmax"])
    results.append(
        AttackResult(
            "centaur_causal_mask_reveals_pi1",
            "π_1, then O_1 = Q K^T",
            "cloud (P1)",
            SUCCEEDS if sorted(orders) == list(range(len(prompt))) else DEFENDED,
            "1 if the masked entries of O_1 π_1 give π_1 exactly (hardened: fresh π_1 per head "
            "and layer)",
            float(sorted(orders) == list(range(len(prompt)))),
            float(set(causal_mask_order(np.zeros((len(prompt), len(prompt))))) != {0}),
            f"{TESTS}::test_the_causal_mask_reveals_the_attention_permutation",
            "control: unmasked (encoder) scores carry no order",
        )
    )
    results.append(
        AttackResult(
            "centaur_vocabulary_matching",
            "the client's input tokens",
            "cloud (P1)",
            SUCCEEDS if vma > 0.5 else DEFENDED,
            f"token accuracy, Pal et al.'s vocabulary matching with Θ' at layer {layer} (hardened)",
            vma,
            control,
            f"{TESTS}::test_vocabulary_matching_recovers_a_decoder_prompt",
            "control: a random view of the same shape",
        )
    )
    return results


def _simulated_fine_tune(public: Any) -> tuple[Architecture, dict[str, np.ndarray]]:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig.from_dict(public.config.to_dict() | {"num_labels": 7})
    model = BertForSequenceClassification(config).eval()
    model.bert.load_state_dict(public.state_dict(), strict=False)
    generator = torch.Generator().manual_seed(0)  # public: the simulation's noise
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(
                0.01
                * parameter.std()
                * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            )
    return extract(model)


def _micro_decoder(folder: Path) -> Any:
    from fedfm.experiments.decoder import quick_micro_decoder
    from fedfm.models.decoder import load_decoder

    return load_decoder(quick_micro_decoder(folder))[0]


__all__ = [
    "causal_mask_order",
    "cloud_views",
    "learned_inversion",
    "permutation_recovery",
    "red_team_suite",
    "rouge_l",
    "row_matching",
    "run_centaur_attacks",
    "sorted_row_matching",
    "vocabulary_matching",
]
