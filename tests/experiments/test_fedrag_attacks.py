"""FedRAG's attacks (spec 002 §6): each watched succeeding under its control, then measured.

Fast tests use synthetic activations with the structure that matters (anisotropic, correlated
features; a vocabulary table); the slow ones use the re-ranker's real keys and the real
retrieval path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedfm.experiments import red_team
from fedfm.experiments.fedrag_attacks import (
    _query_leakage_pair,
    _texts,
    ica_attack,
    knn_overlap,
    known_plaintext_solve,
    minilm_keys,
    vocabulary_matching,
    vocabulary_matching_pair,
)
from fedfm.models.decoder import train_decoder
from fedfm.protocols.fedrag.decoder import runner_for
from tests.helpers import micro_decoder_source


def correlated_rows(rows: int, dims: int = 32, seed: int = 0) -> np.ndarray:
    """Gaussian rows through a random mixing with decaying spectrum (collinear, like LLM states)."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(dims, dims)) * (0.8 ** np.arange(dims))[:, None]
    return rng.normal(size=(rows, dims)) @ mixing + rng.normal(size=dims)


def test_knn_overlap_falls_with_scaling() -> None:
    x = correlated_rows(128)
    # an isometry keeps every neighbourhood: the permutation-only scrambler, and Hadamard with r=1
    assert knn_overlap(x, kind="permutation") == pytest.approx(1.0)
    assert knn_overlap(x, scaling_range=1.0) == pytest.approx(1.0)
    r2, r16 = knn_overlap(x, scaling_range=2.0), knn_overlap(x, scaling_range=16.0)
    assert r16 < r2 < 1.0


def test_known_plaintext_needs_d_rows() -> None:
    x = correlated_rows(200)
    assert known_plaintext_solve(x, 32) < 1e-6  # d = 32 matched rows: solved exactly
    assert known_plaintext_solve(x, 8) > 0.2  # a quarter: not
    # collinear rows have a low effective rank: fewer than d rows already recover much
    assert known_plaintext_solve(x, 16) < known_plaintext_solve(x, 8)


def test_vma_beats_permutation_only_not_structured() -> None:
    rng = np.random.default_rng(1)
    table = rng.normal(size=(300, 16)) * rng.uniform(0.2, 3.0, size=16)
    tokens = rng.integers(0, 300, 100)
    assert vocabulary_matching(table, tokens, kind="permutation") > 0.95  # the attack works
    assert vocabulary_matching(table, tokens, kind="structured") < 0.1  # Hadamard + scalings


def test_the_fedrag_suite_is_registered() -> None:
    assert red_team.PROTOCOL_SUITES["fedrag"] == "fedfm.experiments.fedrag_attacks:red_team_suite"
    assert callable(red_team.protocol_suite("fedrag"))


@pytest.mark.slow
def test_ica_recovers_laplace_not_keys() -> None:
    keys = minilm_keys(_texts(40), rows=512)
    found = ica_attack(keys)
    assert found["laplace_control"] > 0.85  # ICA works when its sources are independent
    assert found["scrambled"] < found["laplace_control"] - 0.3
    assert found["random_guess"] < found["scrambled"]  # but it is above a random guess: measured


@pytest.mark.slow
@pytest.mark.ckks
def test_query_leakage_faithful_vs_private() -> None:
    private, faithful = _query_leakage_pair()
    assert faithful >= 0.4  # the owner finds the query's document from the plaintext embedding
    assert private <= 0.1  # from a CKKS ciphertext it cannot (chance is 1/120)


def test_vma_on_the_micro_decoders_values(tmp_path: Path, one_torch_thread: None) -> None:
    """VMA on a real decoder's layer-0 values (what ``fedfm fedrag-attacks`` and the red team
    report): the permutation-only variant gives the tokens away, the structured scrambler not."""
    source = micro_decoder_source(tmp_path)
    train_decoder(source, progress=False, log=lambda _: None)
    structured, permutation_only = vocabulary_matching_pair(runner_for(source)[0])
    assert permutation_only > 0.9
    assert structured < 0.2
