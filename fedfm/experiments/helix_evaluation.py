"""Tables 1 and 4 and App. J of spec 000 on standard-library docstrings (``fedfm helix-eval``).

For a pair of encoders (provider ``g_A``, client ``g_B``), each fitted on its owner's corpus
(the provider: public + its training texts; the client: public + its queries):

* the provider's head ``f_A`` is a multinomial logistic regression on ``g_A`` of its training
  set; ``V = coef^T``, ``c = intercept``;
* **Table 1** (task-supervised alignment): *Baseline* is ``f_A(g_A(x))`` on the client's
  queries; *Lin.Map* is ``f_A(g_B(x) W* + b*)`` with the map fitted on the training split; OOD
  AUROC of the energy score ``-log sum_k exp f_A(z)_k`` (higher: more OOD) against the OOD set;
* **Table 4** (public alignment): the map fitted on the public set only, or on public + 64 /
  128 in-distribution samples the provider shares; against a logistic regression the client
  trains on ``g_B`` of the same 64 / 128 labelled samples. Few-shot draws repeat per seed;
* **App. J**: shadow-mapper membership inference on ``W*``: mappers on public + 128 shared
  samples that include (IN) or exclude (OUT) one target sample, geometric features of each
  ``(W*, b*)``, a logistic regression with 5-fold stratified cross-validation; chance is 0.5.

Every map here is :func:`fedfm.protocols.helix.ridge.fit_alignment`, the function the encrypted
protocol reproduces (``tests/protocols/test_helix.py`` checks they agree), so the metrics are the
protocol's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.special import logsumexp
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from fedfm.data.stdlib_text import HelixData, build_splits
from fedfm.errors import DataError
from fedfm.experiments.results import write_results
from fedfm.models.text_encoders import TextEncoder, build_encoder
from fedfm.protocols.helix.ridge import AffineMap, fit_alignment

FEW_SHOT = (64, 128)
HEAD_C = 10.0  # inverse regularisation of the provider's logistic-regression head
TOP_SINGULAR_VALUES = 32


@dataclass(frozen=True)
class LinearHead:
    """``f_A(z) = z V + c``."""

    weight: np.ndarray
    bias: np.ndarray

    def logits(self, embeddings: np.ndarray) -> np.ndarray:
        return embeddings @ self.weight + self.bias


def train_head(embeddings: np.ndarray, labels: np.ndarray, *, seed: int = 0) -> LinearHead:
    """A multinomial logistic regression as a linear head."""
    model = LogisticRegression(C=HEAD_C, max_iter=2000, random_state=seed)
    model.fit(embeddings, labels)
    return LinearHead(model.coef_.T.copy(), model.intercept_.copy())


def energy(logits: np.ndarray) -> np.ndarray:
    """The energy score ``-log sum_k exp(logit_k)`` (Liu et al., 2020): higher is more OOD."""
    return -logsumexp(logits, axis=1)


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(axis=1) == labels).mean())


def ood_auroc(in_logits: np.ndarray, ood_logits: np.ndarray) -> float:
    """AUROC of the energy score separating OOD (positive) from in-distribution inputs."""
    scores = np.concatenate([energy(in_logits), energy(ood_logits)])
    truth = np.concatenate([np.zeros(len(in_logits)), np.ones(len(ood_logits))])
    return float(roc_auc_score(truth, scores))


def embed(encoder: TextEncoder, texts: Sequence[str], cache_dir: Path | None = None) -> np.ndarray:
    """``encoder`` on ``texts``; pretrained encoders' results are cached under ``cache_dir``."""
    if cache_dir is None or encoder.name.startswith("lsa"):
        return encoder.encode(texts)
    digest = hashlib.sha256("\x00".join([encoder.name, *texts]).encode()).hexdigest()[:24]
    path = cache_dir / f"{digest}.npy"
    if path.is_file():
        return np.load(path)
    values = encoder.encode(texts)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(path, values)
    return values


@dataclass(frozen=True)
class PartyView:
    """One party's embeddings of every split."""

    public: np.ndarray
    train: np.ndarray
    queries: np.ndarray
    ood: np.ndarray


def embed_party(
    spec: str,
    data: HelixData,
    corpus: Sequence[str],
    *,
    seed: int,
    cache_dir: Path | None,
    device: str | None = None,
) -> PartyView:
    """Build ``spec`` (on ``device``), fit it on its owner's ``corpus``, embed every split."""
    encoder = build_encoder(spec, seed=seed, device=device)
    encoder.fit(corpus)
    return PartyView(
        *(
            embed(encoder, texts, cache_dir)
            for texts in (data.public, data.train.texts, data.queries.texts, data.ood)
        )
    )


def mapper_features(mapping: AffineMap) -> np.ndarray:
    """App. J's geometric features of ``(W*, b*)``: norms, row/column statistics, top singular
    values, effective rank, bias norm."""
    weight = mapping.weight
    singular = np.linalg.svd(weight, compute_uv=False)
    share = singular / singular.sum()
    rows, columns = np.linalg.norm(weight, axis=1), np.linalg.norm(weight, axis=0)
    top = np.zeros(TOP_SINGULAR_VALUES)
    top[: min(TOP_SINGULAR_VALUES, singular.size)] = singular[:TOP_SINGULAR_VALUES]
    return np.concatenate(
        [
            [np.linalg.norm(weight), singular[0], np.exp(-(share * np.log(share + 1e-300)).sum())],
            [rows.mean(), rows.std(), rows.min(), rows.max()],
            [columns.mean(), columns.std(), columns.min(), columns.max()],
            top,
            [np.linalg.norm(mapping.bias)],
        ]
    )


def membership_inference(
    client: PartyView,
    provider: PartyView,
    *,
    ridge: float,
    shadows: int,
    shared: int,
    seed: int,
) -> dict[str, float]:
    """App. J: accuracy of a shadow-mapper attack telling IN from OUT mappers (chance 0.5)."""
    rng = np.random.default_rng(seed)
    target, others = 0, np.arange(1, client.train.shape[0])
    features, membership = [], []
    for index in range(shadows):
        inside = index % 2 == 0
        chosen = rng.choice(others, size=shared - 1 if inside else shared, replace=False)
        rows = np.concatenate([[target], chosen]) if inside else chosen
        mapping = fit_alignment(
            np.concatenate([client.public, client.train[rows]]),
            np.concatenate([provider.public, provider.train[rows]]),
            ridge,
        )
        features.append(mapper_features(mapping))
        membership.append(int(inside))
    attack = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    folds = StratifiedKFold(5, shuffle=True, random_state=seed)
    scores = cross_val_score(attack, np.asarray(features), np.asarray(membership), cv=folds)
    samples = client.public.shape[0] + shared
    return {
        "mia_accuracy": float(scores.mean()),
        "mia_accuracy_std": float(scores.std()),
        "mia_shadows": shadows,
        "mia_bound": float(np.sqrt(client.public.shape[1] * provider.public.shape[1]) / samples),
    }


def _mean_std(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values))


def evaluate_pair(
    provider: PartyView,
    client: PartyView,
    data: HelixData,
    *,
    ridge: float,
    seeds: Sequence[int],
) -> dict[str, Any]:
    """Table 1 and Table 4 metrics for one (provider, client) pair (module docstring)."""
    labels, queries = data.train.labels, data.queries.labels
    if len(labels) < max(FEW_SHOT):
        raise DataError(
            f"the provider's training set has {len(labels)} samples; the few-shot settings "
            f"draw up to {max(FEW_SHOT)}"
        )
    head = train_head(provider.train, labels, seed=seeds[0])

    def mapped(mapping: AffineMap) -> tuple[np.ndarray, np.ndarray]:
        return head.logits(mapping.apply(client.queries)), head.logits(mapping.apply(client.ood))

    row: dict[str, Any] = {}
    base_in, base_ood = head.logits(provider.queries), head.logits(provider.ood)
    row["baseline_accuracy"] = accuracy(base_in, queries)
    row["baseline_auroc"] = ood_auroc(base_in, base_ood)
    task_in, task_ood = mapped(fit_alignment(client.train, provider.train, ridge))
    row["linmap_accuracy"] = accuracy(task_in, queries)
    row["linmap_auroc"] = ood_auroc(task_in, task_ood)
    public_in, public_ood = mapped(fit_alignment(client.public, provider.public, ridge))
    row["public_accuracy"] = accuracy(public_in, queries)
    row["public_auroc"] = ood_auroc(public_in, public_ood)
    for shots in FEW_SHOT:
        mapped_scores, few_shot_scores = [], []
        for seed in seeds:
            rows = np.random.default_rng(seed).choice(len(labels), size=shots, replace=False)
            mapping = fit_alignment(
                np.concatenate([client.public, client.train[rows]]),
                np.concatenate([provider.public, provider.train[rows]]),
                ridge,
            )
            mapped_scores.append(accuracy(mapped(mapping)[0], queries))
            own = train_head(client.train[rows], labels[rows], seed=seed)
            few_shot_scores.append(accuracy(own.logits(client.queries), queries))
        row[f"public_id{shots}_accuracy"], row[f"public_id{shots}_std"] = _mean_std(mapped_scores)
        row[f"fewshot{shots}_accuracy"], row[f"fewshot{shots}_std"] = _mean_std(few_shot_scores)
    return row


def run_helix_evaluation(
    *,
    pairs: Sequence[tuple[str, str]],
    ridge: float,
    seed: int,
    repeats: int,
    public_size: int,
    train_per_class: int,
    queries_per_class: int,
    ood_size: int,
    shadows: int,
    results_dir: Path,
    cache_dir: Path | None,
    command: str | None = None,
    device: str | None = None,
) -> list[dict[str, Any]]:
    """Every metric for every (provider, client) encoder pair; writes ``helix_eval.{json,md}``.
    The transformer encoders run on ``device`` (default: the CPU)."""
    data = build_splits(
        seed=seed,
        public_size=public_size,
        train_per_class=train_per_class,
        queries_per_class=queries_per_class,
        ood_size=ood_size,
    )
    provider_corpus = data.public + data.train.texts
    client_corpus = data.public + data.queries.texts
    rows = []
    for provider_spec, client_spec in pairs:
        provider = embed_party(
            provider_spec, data, provider_corpus, seed=seed, cache_dir=cache_dir, device=device
        )
        client = embed_party(
            client_spec, data, client_corpus, seed=seed, cache_dir=cache_dir, device=device
        )
        row: dict[str, Any] = {"provider": provider_spec, "client": client_spec}
        row["d_A"], row["d_B"] = provider.public.shape[1], client.public.shape[1]
        row |= evaluate_pair(provider, client, data, ridge=ridge, seeds=range(seed, seed + repeats))
        row |= membership_inference(
            client, provider, ridge=ridge, shadows=shadows, shared=FEW_SHOT[-1], seed=seed
        )
        rows.append(row)
        print(f"[fedfm] helix-eval {provider_spec} <- {client_spec}: {row}")
    columns = [
        ("provider", "A (target)"),
        ("client", "B (source)"),
        ("baseline_accuracy", "baseline acc"),
        ("linmap_accuracy", "Lin.Map acc"),
        ("baseline_auroc", "baseline AUROC"),
        ("linmap_auroc", "Lin.Map AUROC"),
        ("fewshot64_accuracy", "B's own 64-shot"),
        ("fewshot128_accuracy", "B's own 128-shot"),
        ("public_accuracy", "public only"),
        ("public_id64_accuracy", "public + ID 64"),
        ("public_id128_accuracy", "public + ID 128"),
        ("public_auroc", "public-only AUROC"),
        ("mia_accuracy", "App. J MIA acc"),
    ]
    description = (
        f"Seven module families of standard-library docstrings; provider trains its head on "
        f"{len(data.train.texts)} texts, the client queries {len(data.queries.texts)}, OOD "
        f"{len(data.ood)} GUI/terminal docstrings, public set {len(data.public)} docstrings of "
        f"other modules. Ridge lambda {ridge}; few-shot columns are means over {repeats} "
        f"draws; MIA: {shadows} shadow mappers (chance 0.5). Accuracies are fractions."
    )
    write_results(
        results_dir,
        "helix_eval",
        title="HELIX alignment: Tables 1/4 and App. J on docstrings",
        description=description,
        rows=rows,
        columns=columns,
        extra={"classes": list(data.classes), "seed": seed, "ridge": ridge},
        command=command,
    )
    return rows
