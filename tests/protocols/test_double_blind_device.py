"""A double-blind round with the ``simulate`` backend on a device: the CPU numbers are the ones
the code gave before it took a device, and a GPU (when there is one) gives them within
tolerance; the server's model is back where it was after an in-process run."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedfm.crypto.randomness import ResearchStream
from fedfm.data import load_splits
from fedfm.protocols.double_blind.config import DoubleBlindConfig
from fedfm.protocols.double_blind.driver import load_state
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.runner import Federation, run_in_process
from tests.helpers import tiny_fhe_vit

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLAIN = DataOwnerPolicy(allow_plaintext=True, require_secure_aggregation=False)
CONFIG = DoubleBlindConfig(
    rounds=1,
    batch_size=16,
    batches_per_round=1,
    secure_aggregation=False,
    backend="simulate",
    reveal="all",
)
FEDERATION = Federation(num_clients=2, seed=0)
# Measured with the code before devices existed (main at 2f46ea4, torch 2.14.1, one thread): the
# round's record and the sum of |value| of each array of the new global adapter and head.
# Re-measured at 30ed88a: the held-out sets now ride along the training round, so the server
# draws their permutations between client 0's and client 1's batches and client 1 trains on
# another batch. With the ride-along forced off, that code still gave the 2f46ea4 numbers
# (train loss 2.733994960784912, balanced accuracy 0.09166666666666666, to rel 1e-5).
BEFORE_ROUND = {
    "train_loss": 2.6671178340911865,
    "balanced_accuracy": 0.10075757575757575,
    "accuracy": 0.15,
    "clients_trained": 2,
    "clients_evaluated": 2,
}
BEFORE_ADAPTER = {
    "down.0.bias": 1.0383284008130431,
    "down.0.weight": 11.157730283215642,
    "down.1.bias": 1.0835767295211554,
    "down.1.weight": 11.684140524128452,
    "head.bias": 1.9993719309568405,
    "head.weight": 15.96690107905306,
    "norm.bias": 0.02498342137550935,
    "norm.weight": 7.974192976951599,
    "up.0.bias": 0.0034323030267842114,
    "up.0.weight": 0.03980429785355,
    "up.1.bias": 0.00343230293947272,
    "up.1.weight": 0.07078809122091911,
}
CPU_RTOL = 1e-5
# One round on a GPU in IEEE float32 (the simulate backend turns TF32 off): the blocks' outputs
# differ from the CPU's by float32 summation order, the adapter's single SGD step by as much
# (not measured here: no GPU on this machine).
GPU_RTOL = 1e-3


@pytest.fixture(scope="module")
def splits():
    return load_splits("digits", image_size=8, max_samples=400, seed=0)


def simulate_round(splits, folder: Path, device: str | None) -> dict[str, Any]:
    model, _ = tiny_fhe_vit(0)
    records, _ = run_in_process(
        model,
        splits,
        CONFIG,
        FEDERATION,
        policy=PLAIN,
        randomness=ResearchStream(3),
        checkpoint_dir=folder,
        log=lambda _: None,
        **({} if device is None else {"device": device}),
    )
    assert next(model.parameters()).device.type == "cpu"  # lent to the run, then given back
    state = load_state(folder, {"config": CONFIG.to_config(), "federation": asdict(FEDERATION)})
    assert state is not None
    (record,) = records
    return {
        "round": {key: getattr(record, key) for key in BEFORE_ROUND},
        "adapter": {
            name: float(np.abs(values.astype(np.float64)).sum())
            for name, values in state.global_arrays.items()
        },
    }


@pytest.mark.parametrize("device", [None, "auto", "cpu"])
def test_cpu_round_gives_the_numbers_it_gave_before_devices(splits, tmp_path, device) -> None:
    if device == "auto" and torch.cuda.is_available():
        pytest.skip("auto is a GPU here: the GPU test compares it")
    run = simulate_round(splits, tmp_path, device)
    assert run["round"] == pytest.approx(BEFORE_ROUND, rel=CPU_RTOL)
    assert run["adapter"] == pytest.approx(BEFORE_ADAPTER, rel=CPU_RTOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU torch can see")
def test_a_simulate_round_on_the_gpu_matches_the_cpu_within_tolerance(splits, tmp_path) -> None:
    cpu = simulate_round(splits, tmp_path / "cpu", "cpu")
    gpu = simulate_round(splits, tmp_path / "gpu", "cuda")
    assert gpu["round"]["train_loss"] == pytest.approx(cpu["round"]["train_loss"], rel=GPU_RTOL)
    # a prediction may flip at a near tie: at most one held-out sample of 80
    assert abs(gpu["round"]["accuracy"] - cpu["round"]["accuracy"]) <= 1 / 80 + 1e-9
    assert gpu["adapter"] == pytest.approx(cpu["adapter"], rel=GPU_RTOL, abs=1e-6)
