"""SLIP's attacks (fedfm.experiments.slip_attacks): each succeeds against its control and fails
against the current code; the red-team suite is registered and reports every one."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfm.experiments import red_team
from fedfm.experiments.red_team import DEFENDED, SUCCEEDS
from fedfm.experiments.slip_attacks import (
    FINETUNE_RESULTS,
    _llama,
    chain_fit,
    finetune_restoration,
    nullspace_solve,
    rank_one_recovery,
    red_team_suite,
    uniformity,
)
from fedfm.experiments.slip_figures import (
    finetune,
    hidden_basis,
    restoration,
    subspace_model,
)
from fedfm.protocols.slip.decomposition import build_plan, split_weight
from fedfm.protocols.slip.hybrid import linear_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[2]


def _weight(m: int = 40, n: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(m, n)) / np.sqrt(n)


def test_the_slip_suite_is_registered() -> None:
    assert red_team.PROTOCOL_SUITES["slip"] == "fedfm.experiments.slip_attacks:red_team_suite"
    assert callable(red_team.protocol_suite("slip"))


def test_rank_one_recovery() -> None:
    """App. A.1: W_D alone gives v_1; one clear pair gives W_C exactly; a masked one does not."""
    found = rank_one_recovery(_weight())
    assert found["direction_cosine"] > 1 - 1e-9
    assert found["clear"] < 1e-9 and found["pairs"] == 1
    assert found["masked"] > 0.5


@pytest.mark.parametrize("shape", [(40, 32), (32, 32)])
def test_nullspace_solve(shape: tuple[int, int]) -> None:
    found = nullspace_solve(_weight(*shape), 4)
    assert found["clear"] < 1e-9  # k pairs suffice unmasked
    assert found["masked"] > 0.5


def test_the_hidden_subspace_is_what_w_d_reveals() -> None:
    for shape in [(12, 8), (8, 12), (10, 10)]:
        split = split_weight(_weight(*shape), 3)
        basis, side = hidden_basis(split.david, 3)
        hidden = split.charlie()
        kept = hidden @ basis @ basis.T if side == "right" else basis @ basis.T @ hidden
        assert np.abs(kept - hidden).max() < 1e-12
        assert side == ("right" if shape[0] >= shape[1] else "left")


def test_masked_words_are_uniform() -> None:
    rows = np.random.default_rng(5).normal(size=(64, 384))
    # the suite's criterion is p > 0.01; here 1e-4, so that chance fails one run in 10^4
    assert uniformity(rows, masked=True) > 1e-4
    assert uniformity(rows, masked=False) < 1e-10  # the control: clear encodings


def test_fig10_chain_fit() -> None:
    """The seed's composition hands David a split up_proj's input and output: W_C follows.
    The safe default sends him only masked words."""
    model = _llama()
    assert chain_fit("faithful", model=model) < 1e-2
    assert chain_fit("safe", model=model) > 0.5


def test_subspace_finetuning_trains_only_the_hidden_factor() -> None:
    model = _llama(hidden=32, context=32)
    plan = build_plan(linear_layers(model), blocks="first", types="mlp.up_proj", rank=4)
    informed = subspace_model(copy.deepcopy(model), plan)
    trainable = [p for p in informed.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == 64 * 4  # up_proj is 64x32: X is 64 x k
    blocks = torch.from_numpy(np.random.default_rng(0).integers(3, 320, (16, 32)))
    before = [p.detach().clone() for p in informed.parameters() if not p.requires_grad]
    finetune(informed, blocks, steps=3, batch=4, lr=1e-2)
    after = [p for p in informed.parameters() if not p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert restoration(10.0, 100.0, 10.0) == 1.0 and restoration(10.0, 100.0, 100.0) == 0.0


def test_finetune_restoration_is_measured() -> None:
    """The red team reads Fig. 14's default row from the committed table."""
    found = finetune_restoration(ROOT / FINETUNE_RESULTS)
    rows = json.loads((ROOT / FINETUNE_RESULTS).read_text())["rows"]
    default = next(r for r in rows if str(r["config"]) == "2")
    assert found["subspace"] == default["subspace_ft_restored"]
    assert found["david_only_perplexity"] > found["model_perplexity"]
    assert all(math.isfinite(v) for v in found.values())


@pytest.mark.slow
def test_the_red_team_suite_reports_every_attack() -> None:
    results = red_team_suite()
    names = [r.name for r in results]
    assert names == [
        "slip_rank_one_recovery",
        "slip_nullspace_solve",
        "slip_masked_uniformity",
        "slip_fig10_chain_fit",
        "slip_finetune_restoration",
    ]
    outcome = {r.name: r.outcome for r in results}
    for name in names[:4]:
        assert outcome[name] == DEFENDED, name
    assert outcome["slip_finetune_restoration"] in (DEFENDED, SUCCEEDS)
    by_name = {r.name: r for r in results}
    assert by_name["slip_nullspace_solve"].control < 1e-9  # on MiniLM's real weight
    assert by_name["slip_fig10_chain_fit"].control < 1e-2
    for result in results:
        assert result.test.startswith("tests/") and "::test_" in result.test
