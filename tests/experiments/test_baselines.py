"""Baselines over the same data and model, ``fedfm adapt`` and the protocol benchmark (App. A, D).

Everything runs on 16x16 digits (at most 200 samples per split) with a small FHE-friendly ViT
(random weights, calibrated) saved as the student of a temporary work directory, two clients and
two or three rounds.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfm.approx.modules import calibrate
from fedfm.approx.specs import ApproxConfig
from fedfm.cli import main
from fedfm.crypto.randomness import ResearchStream
from fedfm.data import DataSplits
from fedfm.distillation.pipeline import ApproxSettings, DistillRun, load_data, save_student
from fedfm.errors import CheckpointError, ConfigError
from fedfm.experiments.baselines import (
    RESEARCHER_POLICY,
    FineTuneConfig,
    finetune_model,
    run_adaptation,
    run_full_finetune,
    run_linear_probe,
)
from fedfm.models.fhe_vit import FheViT, to_fhe_friendly
from fedfm.models.foundation import ModelSpec
from fedfm.protocols.double_blind.config import DoubleBlindConfig, revealed_blocks
from fedfm.protocols.double_blind.runner import Federation, federation_data, run_in_process

FEDERATION = Federation(num_clients=2, scheme="iid")
CONFIG = DoubleBlindConfig(rounds=2, batch_size=16, batches_per_round=2, reveal="all")
DATA = ["--image-size", "16", "--max-samples", "200", "--no-progress"]
SMALL = [
    "--rounds", "2", "--clients", "2", "--partition", "iid", "--batches-per-round", "2",
    "--reveal", "all",
]  # fmt: skip


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def splits() -> DataSplits:
    return load_data(DistillRun(image_size=16, max_samples=200))[0]


@pytest.fixture(scope="module")
def student(splits: DataSplits) -> FheViT:
    torch.manual_seed(0)
    model = to_fhe_friendly(ModelSpec("vit_fedfm_tiny", 10, 16).build(), ApproxConfig())
    calibrate(model, [splits.aux.images[i : i + 32] for i in range(0, 96, 32)])
    return model.eval()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, student: FheViT) -> Path:
    """A work directory holding the small student, as ``fedfm distill`` would leave it."""
    path = tmp_path_factory.mktemp("distill")
    save_student(
        path / "student.pt", student, ModelSpec("vit_fedfm_tiny", 10, 16), ApproxSettings()
    )
    return path


def test_linear_probe_is_the_protocol_with_rank_zero(
    student: FheViT, splits: DataSplits, tmp_path: Path
) -> None:
    probe, transport = run_linear_probe(
        student, splits, CONFIG, FEDERATION, checkpoint_dir=tmp_path / "probe", log=quiet
    )
    direct, _ = run_in_process(
        student,
        splits,
        replace(CONFIG, rank=0),
        FEDERATION,
        checkpoint_dir=tmp_path / "direct",
        policy=RESEARCHER_POLICY,
        randomness=ResearchStream(0),
        log=quiet,
    )
    # The same run up to secure aggregation's stochastic rounding (each aggregate within one
    # step 2c / (2**24 - 1) = 1.2e-7 of the exact average): the first loss comes before any
    # aggregation, the global arrays and later losses agree to float precision.
    assert probe[0].train_loss == direct[0].train_loss
    assert [r.train_loss for r in probe] == pytest.approx([r.train_loss for r in direct], rel=1e-5)
    with (
        np.load(tmp_path / "probe" / "global.npz") as a,
        np.load(tmp_path / "direct" / "global.npz") as b,
    ):
        for name in a.files:
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-5)
    # a near-tie of two logits may flip between the runs: one held-out sample at most
    accuracies = [r.balanced_accuracy for r in direct]
    assert [r.balanced_accuracy for r in probe] == pytest.approx(accuracies, abs=0.02)
    # R + 1 round trips to train and 4 SecAgg stages per round (R revealed blocks); one to
    # evaluate, on the held-out outputs kept from round 1 (they rode along); plus setup
    shown = len(revealed_blocks(CONFIG.reveal, student.num_blocks))
    assert transport.stats.round_trips == 1 + CONFIG.rounds * (shown + 6)


def test_full_finetune_is_fedavg_of_one_sgd_step_per_client(
    student: FheViT, splits: DataSplits
) -> None:
    """One round with ``local_steps="round"`` and no momentum, recomputed by hand: each client
    draws its batches as the protocol's server would, takes one SGD step on every weight of a
    copy of the student with a fresh head, and the server averages with weights N_k (Eq. 7)."""
    config = replace(CONFIG, rounds=1)
    federation = Federation(num_clients=2, scheme="dirichlet", alpha=1.0)
    finetune = FineTuneConfig(lr=0.01, momentum=0.0, local_steps="round")
    history, model = run_full_finetune(
        student, splits, config, federation, finetune=finetune, log=quiet
    )
    datasets = federation_data(splits, federation, config)
    rng = np.random.default_rng(0)  # run_full_finetune's default seed
    start = finetune_model(student, 10, seed=0)
    states, weights = [], []
    for data in datasets:
        count = min(config.batches_per_round, len(data.train_labels) // config.batch_size)
        chosen = rng.choice(len(data.train_labels), size=count * config.batch_size, replace=False)
        local = finetune_model(student, 10, seed=0).train()
        images = torch.from_numpy(data.train_images[chosen])
        labels = torch.from_numpy(data.train_labels[chosen]).long()
        torch.nn.functional.cross_entropy(local(images), labels).backward()
        with torch.no_grad():
            for parameter in local.parameters():
                parameter -= finetune.lr * parameter.grad
        states.append(local.state_dict())
        weights.append(count * config.batch_size)
    total = sum(weights)
    for name, value in model.state_dict().items():
        expected = sum(state[name] * (w / total) for state, w in zip(states, weights, strict=True))
        torch.testing.assert_close(value, expected.to(value.dtype), rtol=1e-5, atol=1e-6)
    assert history[0].clients_trained == len(datasets)
    moved = model.vit.blocks[0].mlp.fc1.weight - start.vit.blocks[0].mlp.fc1.weight
    assert moved.abs().max() > 0  # the backbone is trained, not only the head
    # the student is untouched and the baseline's head is a fresh one
    assert torch.equal(start.vit.blocks[0].mlp.fc1.weight, student.vit.blocks[0].mlp.fc1.weight)
    assert not torch.equal(start.vit.head.weight, student.vit.head.weight)


def test_full_finetune_resumes_from_its_checkpoint(
    student: FheViT, splits: DataSplits, tmp_path: Path
) -> None:
    class Stop(Exception):
        pass

    def stop_after_round_one(message: str) -> None:
        if message.startswith("[fedfm] round 1/"):
            raise Stop

    with pytest.raises(Stop):
        run_full_finetune(
            student, splits, CONFIG, FEDERATION, checkpoint_dir=tmp_path, log=stop_after_round_one
        )
    messages: list[str] = []
    history, _ = run_full_finetune(
        student, splits, CONFIG, FEDERATION, checkpoint_dir=tmp_path, log=messages.append
    )
    assert any("resuming after round 1" in m for m in messages)
    assert [r.round for r in history] == [1, 2]
    with pytest.raises(CheckpointError, match="other settings"):
        run_full_finetune(
            student, splits, CONFIG, FEDERATION, seed=5, checkpoint_dir=tmp_path, log=quiet
        )


def test_unknown_method_and_bad_settings_are_refused(student: FheViT, splits: DataSplits) -> None:
    with pytest.raises(ConfigError, match="unknown adaptation method"):
        run_adaptation("lora", student, splits, CONFIG, FEDERATION, log=quiet)
    with pytest.raises(ConfigError, match="local_steps"):
        FineTuneConfig(local_steps="epoch")
    with pytest.raises(ConfigError, match="below the minimum 16"):
        DoubleBlindConfig(batch_size=8)


# -- command line ------------------------------------------------------------------------------
def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_adapt_writes_a_history_per_method(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finals = {}
    for method in ("ours", "linear-probe", "full-finetune"):
        output = tmp_path / f"{method}.json"
        argv = ["adapt", "--method", method, *SMALL, *DATA, "--workdir", str(workdir)]
        code, out, err = run_cli([*argv, "--output", str(output)], capsys)
        assert code == 0, err
        assert out.count("balanced accuracy") >= 2
        payload = json.loads(output.read_text())
        assert payload["method"] == method
        assert [r["round"] for r in payload["history"]] == [1, 2]
        finals[method] = payload["final_balanced_accuracy"]
        params = payload["trainable_parameters"]
        if method == "linear-probe":
            assert payload["config"]["rank"] == 0
        if method == "full-finetune":
            assert payload["backend"].startswith("plaintext") and params > 100_000
    assert all(0 <= value <= 1 for value in finals.values())


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--batch-size", "8"], "batch size 8 is below the minimum 16"),
        (["--clients", "0"], "num_clients must be >= 1"),
        (["--partition", "shards"], "unknown partition 'shards'"),
        (["--alpha", "0"], "Dirichlet alpha must be > 0"),
        (["--rank", "-1"], "adapter rank must be >= 0"),
        (["--method", "full-finetune", "--lr", "0"], "learning rate must be > 0"),
    ],
)
def test_adapt_refuses_bad_input_in_one_line(
    options: list[str],
    expected: str,
    workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["adapt", *options, "--workdir", str(workdir), "--output", str(tmp_path / "o.json")]
    code, _, err = run_cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("fedfm: error: ") and expected in lines[0]


def test_bench_protocol_writes_the_round_table(
    workdir: Path, splits: DataSplits, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench-protocol", *SMALL, *DATA, "--workdir", str(workdir), "--repeats", "1"]
    code, _, err = run_cli([*argv, "--results-dir", str(tmp_path)], capsys)
    assert code == 0, err
    payload = json.loads((tmp_path / "double_blind_round.json").read_text())
    rows = {row["method"]: row for row in payload["rows"]}
    assert set(rows) == {"ours", "linear-probe", "full-finetune"}
    assert "simulate" in payload["description"] and "N=8192" in payload["description"]
    ours, probe = rows["ours"], rows["linear-probe"]
    blocks = 4
    # L + 1 to train, 4 SecAgg stages (secure aggregation is on by default), 1 to evaluate on
    # the outputs kept since the held-out set rode along round 1's training
    per_round = blocks + 6
    assert ours["round_trips_per_round"] == probe["round_trips_per_round"] == per_round
    # one N=8192 ciphertext (3 data primes: 393216 bytes) per feature (96) per set of batches:
    # a round's two batches of 16 share one set (up to 128 samples of 17 tokens) with, in
    # round 1, the client's held-out samples riding along
    clients = federation_data(splits, Federation(num_clients=2, scheme="iid"), CONFIG)
    held_out = sum(len(data.eval_labels) for data in clients)
    messages = 2 * 2  # train.block messages per block: 2 clients x 2 rounds, one set each
    per_sample = 96 * 393216 * messages / (messages * 32 + held_out)
    assert ours["block_bytes_down_per_sample_block"] == pytest.approx(per_sample)
    assert ours["block_bytes_up_per_sample_block"] == pytest.approx(per_sample)
    assert ours["seconds_ratio_vs_linear_probe"] == pytest.approx(
        ours["median_seconds_per_round"] / probe["median_seconds_per_round"]
    )
    assert ours["trainable_parameters"] > probe["trainable_parameters"]
    assert np.isfinite(rows["full-finetune"]["final_balanced_accuracy"])
    assert (tmp_path / "double_blind_round.md").read_text().count("\n| ") >= 4


def test_bench_extraction_writes_attack_metrics(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench-extraction", *SMALL, *DATA, "--workdir", str(workdir), "--no-mlp"]
    code, _, err = run_cli([*argv, "--results-dir", str(tmp_path)], capsys)
    assert code == 0, err
    rows = json.loads((tmp_path / "extraction.json").read_text())["rows"]
    value = {(row["metric"], row["permutations"]): row["mean"] for row in rows}
    assert value[("a_naive_r2", "off (debug)")] > 0.8
    assert value[("a_naive_r2", "on")] < 0.2
    assert value[("perm_absolute_hits", "on")] == 0
    assert value[("b2_r2_residual", "on")] > 0.5


def test_the_paper_schedule_divides_the_learning_rate_at_half_and_four_fifths() -> None:
    decayed = DoubleBlindConfig(rounds=20, lr_decay=True)
    assert [decayed.lr_factor(r) for r in range(1, 21)] == pytest.approx(
        [1.0] * 10 + [0.1] * 6 + [0.01] * 4
    )
    assert {DoubleBlindConfig(rounds=20).lr_factor(r) for r in range(1, 21)} == {1.0}
    assert DoubleBlindConfig.from_config(decayed.to_config()).lr_decay


@pytest.mark.parametrize("method", ["ours", "full-finetune"])
def test_every_method_steps_with_the_scheduled_learning_rate(
    method: str, student: FheViT, splits: DataSplits, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schedule that zeroes the second round's learning rate leaves the model as round 1 left
    it: the protocol's client and the fine-tuning baseline both take their step size from
    :meth:`DoubleBlindConfig.lr_factor` of the round they are in."""
    asked: list[int] = []

    def frozen_second_round(self: DoubleBlindConfig, server_round: int) -> float:
        asked.append(server_round)
        return 0.0 if server_round == 2 else 1.0

    monkeypatch.setattr(DoubleBlindConfig, "lr_factor", frozen_second_round)
    # plain replies: secure aggregation's stochastic rounding would move a zero update a little
    config = replace(CONFIG, lr_decay=True, secure_aggregation=False)
    history = run_adaptation(method, student, splits, config, FEDERATION, log=quiet).history
    assert set(asked) == {1, 2}
    first, second = history
    assert second.balanced_accuracy == first.balanced_accuracy
    assert second.accuracy == first.accuracy
