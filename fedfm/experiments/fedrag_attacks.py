"""FedRAG's attacks (spec 002 §6), each measured against the current code and its control.

The adversary of the scrambling is the **compute node** (honest-but-curious, §3.3): it sees the
scrambled, token-permuted keys, values and queries of a pair for one layer of one request, and
knows the model, the vocabulary and the scrambler's structure, not the key. The adversary of
retrieval is a **context owner** reading the coordinator's query embedding (faithful mode).

* :func:`ica_attack`: FastICA (scikit-learn) on the scrambled rows, its components matched to the
  plaintext features by the Hungarian algorithm on ``|cos|``; positive control: i.i.d. Laplace
  sources under the same scrambler (ICA's assumptions hold); random control: Gaussian guesses.
* :func:`knn_overlap`: mean overlap of each row's 10 nearest neighbours in plaintext and in
  scrambled space (what graph matching needs), against sequence length and scaling range.
* :func:`known_plaintext_solve`: with ``r`` matched plaintext/scrambled rows the compute node
  solves ``S^{-T}`` by least squares; error of every other row against ``r``.
* :func:`vocabulary_matching`: VMA (Pal et al. 2025) on layer-0 values (no RoPE, one row per
  token): each scrambled row is matched to the vocabulary token whose value vector has the
  closest *sorted* entries; defeats a permutation-only scrambler, measured on the structured one.
* :func:`query_leakage`: an owner's nearest documents to the query embedding (faithful
  retrieval) against CKKS retrieval, where it holds only a ciphertext.

Activations come from the packaged MiniLM (the re-ranker, pretrained) and the decoder;
:func:`red_team_suite` runs small sizes in seconds, ``fedfm fedrag-attacks`` the curves.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.experiments.red_team import DEFENDED, SUCCEEDS, AttackResult
from fedfm.experiments.results import write_results
from fedfm.protocols.fedrag.scrambler import (
    DEFAULT_SCALING_RANGE,
    LocalRandomness,
    Scrambler,
    draw_scrambler,
)

TESTS = "tests/experiments/test_fedrag_attacks.py"
NEIGHBOURS = 10
QUERY_LEAKAGE_QUERIES, QUERY_LEAKAGE_DOCUMENTS = 20, 120


def _scramble_keys(x: np.ndarray, key: Scrambler, *, permute: bool = True) -> np.ndarray:
    """What the compute node holds: ``x S^{-T}`` with its rows in a random order."""
    out = key.inverse_transpose(np.asarray(x, dtype=np.float64))
    return (
        out[np.random.default_rng(int.from_bytes(os.urandom(8), "big")).permutation(len(out))]
        if permute
        else out
    )


def _abs_cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a - a.mean(0)
    b = b - b.mean(0)
    a = a / np.maximum(np.linalg.norm(a, axis=0), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=0), 1e-12)
    return np.abs(a.T @ b)


def hungarian_mean_abs_cos(recovered: np.ndarray, truth: np.ndarray) -> float:
    """Mean ``|cos|`` between recovered components and true features (columns, over rows),
    matched one to one by the Hungarian algorithm."""
    from scipy.optimize import linear_sum_assignment

    similarity = _abs_cos(recovered, truth)
    rows, cols = linear_sum_assignment(-similarity)
    return float(similarity[rows, cols].mean())


def ica_attack(
    x: np.ndarray,
    *,
    kind: str = "structured",
    scaling_range: float = DEFAULT_SCALING_RANGE,
    seed: int = 0,
) -> dict[str, float]:
    """FastICA on ``x S^{-T}`` (rows unpermuted: ICA ignores row order), on Laplace sources under
    the same ``S`` (positive control) and Gaussian guesses (random control)."""
    from sklearn.decomposition import FastICA

    x = np.asarray(x, dtype=np.float64)
    rng = np.random.default_rng(seed)
    key = draw_scrambler(
        LocalRandomness(), "ica", x.shape[1], kind=kind, scaling_range=scaling_range
    )

    def recover(observed: np.ndarray) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return FastICA(
                n_components=observed.shape[1],
                random_state=seed,
                max_iter=200,
                whiten="unit-variance",
            ).fit_transform(observed)

    laplace = rng.laplace(size=x.shape)
    return {
        "scrambled": hungarian_mean_abs_cos(recover(_scramble_keys(x, key, permute=False)), x),
        "laplace_control": hungarian_mean_abs_cos(
            recover(_scramble_keys(laplace, key, permute=False)), laplace
        ),
        "random_guess": hungarian_mean_abs_cos(rng.normal(size=x.shape), x),
    }


def knn_sets(x: np.ndarray, k: int = NEIGHBOURS) -> np.ndarray:
    distances = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(distances, np.inf)
    return np.argsort(distances, axis=1)[:, :k]


def knn_overlap(
    x: np.ndarray,
    *,
    kind: str = "structured",
    scaling_range: float = DEFAULT_SCALING_RANGE,
    k: int = NEIGHBOURS,
) -> float:
    """Mean ``|kNN_plain(i) & kNN_scrambled(i)| / k`` over rows (rows aligned: the attacker's
    best case, as if it had undone the token permutation)."""
    key = draw_scrambler(
        LocalRandomness(), "knn", x.shape[1], kind=kind, scaling_range=scaling_range
    )
    plain, scrambled = (
        knn_sets(np.asarray(x, np.float64), k),
        knn_sets(_scramble_keys(x, key, permute=False), k),
    )
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(plain, scrambled, strict=True)]))


def known_plaintext_solve(
    x: np.ndarray,
    known: int,
    *,
    kind: str = "structured",
    scaling_range: float = DEFAULT_SCALING_RANGE,
) -> float:
    """Relative error of the other rows' recovery from ``known`` matched rows (least squares
    ``x S^{-T}`` -> ``x``); about 0 once ``known >= d`` (and the rows span the space)."""
    x = np.asarray(x, dtype=np.float64)
    key = draw_scrambler(
        LocalRandomness(), "kpa", x.shape[1], kind=kind, scaling_range=scaling_range
    )
    scrambled = _scramble_keys(x, key, permute=False)
    solve, *_ = np.linalg.lstsq(scrambled[:known], x[:known], rcond=None)
    rest = slice(known, None)
    return float(np.linalg.norm(scrambled[rest] @ solve - x[rest]) / np.linalg.norm(x[rest]))


def vocabulary_matching(
    values_by_token: np.ndarray,
    tokens: np.ndarray,
    *,
    kind: str,
    scaling_range: float = DEFAULT_SCALING_RANGE,
) -> float:
    """VMA: the fraction of scrambled value rows (of ``tokens``) matched to their true token by
    the sorted entries of ``values_by_token`` (``(vocab, d)``, one head, layer 0)."""
    key = draw_scrambler(
        LocalRandomness(), "vma", values_by_token.shape[1], kind=kind, scaling_range=scaling_range
    )
    observed = key.forward(values_by_token[tokens])  # values are scrambled by M: v M
    table = np.sort(values_by_token, axis=1)
    guesses = [int(np.argmin(np.abs(table - np.sort(row)).sum(1))) for row in observed]
    return float(np.mean(np.asarray(guesses) == tokens))


def query_leakage(
    queries: np.ndarray,
    sources: np.ndarray,
    corpus: np.ndarray,
    *,
    seen: Sequence[dict[str, np.ndarray]] | None = None,
) -> float:
    """An owner's rate of finding each query's source document as the nearest neighbour of
    what it received. ``seen`` (per query, the arrays the owner got) is searched for a float
    vector of the corpus's width; without one (CKKS), its guess is a random document."""
    rng = np.random.default_rng(0)
    hits = []
    for number, source in enumerate(sources):
        vector: np.ndarray | None = queries[number]
        if seen is not None:
            floats = [
                a
                for a in seen[number].values()
                if a.dtype.kind == "f" and a.size == corpus.shape[1]
            ]
            vector = floats[0].reshape(-1) if floats else None
        guess = (
            int(np.argmax(corpus @ vector))
            if vector is not None
            else int(rng.integers(len(corpus)))
        )
        hits.append(guess == int(source))
    return float(np.mean(hits))


# -- activations ---------------------------------------------------------------------------------


def minilm_keys(
    texts: Sequence[str], *, layer: int = 2, head: int = 0, rows: int | None = None
) -> np.ndarray:
    """The re-ranker's real keys (one head of one layer) for ``texts``, stacked."""
    from fedfm.protocols.fedrag.reranking import encoder_runner

    encoder = encoder_runner()
    found = []
    for text in texts:
        hidden = encoder.embed(encoder.document_ids(text), 1, 0)
        for current in range(layer + 1):
            _, k, _ = encoder.qkv(current, hidden)
            if current == layer:
                found.append(k[head])
                break
            hidden = encoder.finish(current, hidden, [])
        if rows is not None and sum(len(f) for f in found) >= rows:
            break
    stacked = np.concatenate(found)
    return stacked[:rows] if rows is not None else stacked


def decoder_values(runner: Any, head: int = 0) -> np.ndarray:
    """Layer-0 values of every vocabulary token (position independent: RoPE is on q, k only)."""
    ids = np.arange(runner.geometry.vocab)
    _, _, v = runner.qkv(0, runner.embed(ids), np.zeros(ids.size, dtype=np.int64))
    return np.asarray(v[head], dtype=np.float64)


def _texts(count: int) -> list[str]:
    from fedfm.data.stdlib_text import split_documents

    return [d.text for d in split_documents(seed=0).held_out[:count]]


def _micro_runner(folder: Path) -> Any:
    from fedfm.experiments.decoder import quick_micro_decoder
    from fedfm.protocols.fedrag.decoder import runner_for

    return runner_for(quick_micro_decoder(folder))[0]


# -- the red team ----------------------------------------------------------------------------


def red_team_suite() -> list[AttackResult]:
    """The attacks at small sizes (seconds): outcome against the current code, control."""
    pooled = minilm_keys(_texts(40), rows=512)
    keys = pooled[:160]
    ica = ica_attack(pooled)
    knn = knn_overlap(keys)
    knn_permutation = knn_overlap(keys, kind="permutation")
    d = keys.shape[1]
    below, at = known_plaintext_solve(keys, d // 2), known_plaintext_solve(keys, d + 4)
    vma, vma_control = vocabulary_matching_pair()
    leak = _query_leakage_pair()
    return [
        AttackResult(
            "fedrag_ica",
            "plaintext keys (re-ranker layer 2)",
            "compute node",
            SUCCEEDS if ica["scrambled"] > 0.8 else DEFENDED,
            f"Hungarian mean |cos| of FastICA components, {len(pooled)} rows (random guess "
            f"{ica['random_guess']:.2f})",
            ica["scrambled"],
            ica["laplace_control"],
            f"{TESTS}::test_ica_recovers_laplace_not_keys",
            "control: i.i.d. Laplace sources under the same scrambler",
        ),
        AttackResult(
            "fedrag_knn_overlap",
            "neighbourhoods of plaintext keys (graph matching)",
            "compute node",
            SUCCEEDS if knn > 0.5 else DEFENDED,
            f"kNN@{NEIGHBOURS} overlap, {len(keys)} rows, scaling range {DEFAULT_SCALING_RANGE:g}",
            knn,
            knn_permutation,
            f"{TESTS}::test_knn_overlap_falls_with_scaling",
            "control: the permutation-only scrambler (an isometry: overlap 1); see fedfm "
            "fedrag-attacks for the curve",
        ),
        AttackResult(
            "fedrag_known_plaintext",
            "the scrambler S of one layer and pair",
            "compute node",
            SUCCEEDS if at < 1e-6 else DEFENDED,
            f"relative error of the other rows from d+4 = {d + 4} known rows "
            f"(control: d/2 = {d // 2})",
            at,
            below,
            f"{TESTS}::test_known_plaintext_needs_d_rows",
            "succeeds with >= d_head matched rows; the token permutation and fresh keys per "
            "layer and request leave the compute node about one predictable row (<s> at "
            "position 0) per layer",
        ),
        AttackResult(
            "fedrag_vocabulary_matching",
            "tokens of an owner's segment (layer-0 values)",
            "compute node",
            SUCCEEDS if vma > 0.5 else DEFENDED,
            "fraction of tokens recovered by sorted-value matching (VMA)",
            vma,
            vma_control,
            f"{TESTS}::test_vma_beats_permutation_only_not_structured",
            "control: the permutation-only variant",
        ),
        AttackResult(
            "fedrag_query_leakage",
            "the coordinator's query (retrieval)",
            "context owner",
            SUCCEEDS if leak[0] > 0.5 else DEFENDED,
            "rate of finding the query's source document as nearest neighbour (CKKS retrieval)",
            leak[0],
            leak[1],
            f"{TESTS}::test_query_leakage_faithful_vs_private",
            "control: faithful retrieval (plaintext embedding, §5.1)",
        ),
    ]


VMA_TOKENS = 200


def vocabulary_matching_pair(
    runner: Any | None = None, *, tokens: int = VMA_TOKENS
) -> tuple[float, float]:
    """(structured, permutation-only) VMA success on ``tokens`` random tokens' layer-0 values
    of ``runner``'s decoder (default: the micro decoder, trained for seconds in a temporary
    folder, as the red team does)."""
    if runner is None:
        with tempfile.TemporaryDirectory(prefix="fedfm-fedrag-vma-") as folder:
            return vocabulary_matching_pair(_micro_runner(Path(folder)), tokens=tokens)
    table = decoder_values(runner)
    chosen = np.random.default_rng(0).integers(3, len(table), tokens)
    return (
        vocabulary_matching(table, chosen, kind="structured"),
        vocabulary_matching(table, chosen, kind="permutation"),
    )


def _query_leakage_pair() -> tuple[float, float]:
    """(private, faithful) success of the owner's nearest-document attack on 20 queries."""
    from fedfm.experiments.fedrag_data import embed, question_of
    from fedfm.protocols.fedrag.retrieval import QueryKeys

    texts = _texts(QUERY_LEAKAGE_DOCUMENTS)
    asked = [(i, question_of(t)) for i, t in enumerate(texts)]
    pairs = [(i, qa) for i, qa in asked if qa is not None][:QUERY_LEAKAGE_QUERIES]
    corpus = embed(texts)
    queries = embed([qa[0] for _, qa in pairs])
    sources = np.asarray([i for i, _ in pairs])
    keys = QueryKeys.generate()
    context = keys.public_context()
    seen = [{"context": context, **keys.encrypt_query(q)} for q in queries]
    faithful = query_leakage(queries, sources, corpus, seen=[{"embedding": q} for q in queries])
    private = query_leakage(queries, sources, corpus, seen=seen)
    return private, faithful


def run_fedrag_attacks(
    *, results_dir: Path = Path("results"), log: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """``fedfm fedrag-attacks``: kNN overlap against rows and scaling range, ICA, known
    plaintext against rows, with the bf16 error of each scaling range; vocabulary matching and
    query leakage with their controls (the figures of ``docs/fedrag.md``'s attack table)."""
    from fedfm.experiments.fedrag_bench import bf16_error

    rows: list[dict[str, Any]] = []
    keys = minilm_keys(_texts(80), rows=512)
    for length in (32, 64, 128, 256, 512):
        rows.append(
            {
                "attack": "knn_overlap",
                "rows": length,
                "scaling_range": DEFAULT_SCALING_RANGE,
                "value": knn_overlap(keys[:length]),
            }
        )
        log(f"[fedfm] fedrag-attacks: {rows[-1]}")
    rng = np.random.default_rng(0)
    q = keys[rng.permutation(len(keys))[:64]][None]
    for r in (1.0, 2.0, 4.0, 8.0, 16.0, 64.0):
        error = bf16_error(
            q,
            keys[None, :128],
            keys[None, 128:256],
            scaling=32**-0.5,
            kind="structured",
            scaling_range=r,
        )
        rows.append(
            {
                "attack": "knn_overlap",
                "rows": 128,
                "scaling_range": r,
                "value": knn_overlap(keys[:128], scaling_range=r),
                "bf16_relative_error": error,
            }
        )
        log(f"[fedfm] fedrag-attacks: {rows[-1]}")
    for length in (64, 512):
        for name, value in ica_attack(keys[:length]).items():
            rows.append(
                {
                    "attack": f"ica_{name}",
                    "rows": length,
                    "scaling_range": DEFAULT_SCALING_RANGE,
                    "value": value,
                }
            )
    for known in (8, 16, 31, 32, 36, 64):
        rows.append(
            {
                "attack": "known_plaintext_error",
                "rows": known,
                "scaling_range": DEFAULT_SCALING_RANGE,
                "value": known_plaintext_solve(keys[:256], known),
            }
        )
    structured, permutation_only = vocabulary_matching_pair()
    for name, value in (("vma_structured", structured), ("vma_permutation_only", permutation_only)):
        rows.append(
            {
                "attack": name,
                "rows": VMA_TOKENS,
                "scaling_range": DEFAULT_SCALING_RANGE,
                "value": value,
            }
        )
    log(
        f"[fedfm] fedrag-attacks: VMA structured {structured:.3f}, "
        f"permutation-only {permutation_only:.3f}"
    )
    private, faithful = _query_leakage_pair()
    for name, value in (("query_leakage_private", private), ("query_leakage_faithful", faithful)):
        rows.append({"attack": name, "rows": QUERY_LEAKAGE_QUERIES, "value": value})
    log(f"[fedfm] fedrag-attacks: query leakage private {private:.3f}, faithful {faithful:.3f}")
    write_results(
        results_dir,
        "fedrag_attacks",
        title="FedRAG attacks (spec 002 §6): the compute node against the scrambler, an owner "
        "against the query",
        description=(
            "Keys of the packaged MiniLM (the re-ranker; layer 2, head 0) on held-out docstrings. "
            "kNN@10 overlap of plaintext and scrambled rows (rows aligned: the attacker's best "
            "case), against the rows it sees and the scaling range r (with the bf16 relative "
            "error of attention at that r); FastICA (Hungarian mean |cos|) with its Laplace and "
            "random controls; known-plaintext least squares error against matched rows (d = 32). "
            f"Vocabulary matching (VMA, Pal et al. 2025) on the micro decoder's layer-0 values "
            f"(one head, {VMA_TOKENS} random tokens; rows = tokens): the fraction of tokens "
            "recovered under the structured scrambler and the permutation-only variant. Query "
            f"leakage ({QUERY_LEAKAGE_QUERIES} queries against {QUERY_LEAKAGE_DOCUMENTS} held-out "
            "documents; rows = queries): the rate at which a context owner finds the query's "
            "source document as the nearest neighbour of what it receives, under CKKS retrieval "
            "(private) and with the plaintext embedding (faithful, §5.1)."
        ),
        rows=rows,
        columns=[
            ("attack", "attack"),
            ("rows", "rows"),
            ("scaling_range", "r"),
            ("value", "value"),
            ("bf16_relative_error", "bf16 error"),
        ],
    )
    return rows
