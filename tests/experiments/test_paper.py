"""The paper's tables (``fedfm paper``): cells, resumption, summary, test-set metric."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfm.cli import main
from fedfm.data import DataSplits, load_splits
from fedfm.distillation.pipeline import load_student
from fedfm.errors import ConfigError, ProtocolError
from fedfm.experiments.paper import (
    adapter_test_accuracy,
    cell_file,
    default_lr,
    load_table,
    run_efficiency_table,
    run_table,
)
from fedfm.models.fhe_vit import FheViT
from fedfm.protocols.double_blind.adapter import SideAdapterHead
from fedfm.protocols.double_blind.config import DoubleBlindConfig
from tests.helpers import save_micro_student

CONFIG = """
[defaults]
methods = ["linear-probe", "ours"]
seeds = [0, 1]
rounds = 1
lr_decay = true

[tiny]
title = "a tiny table"
figure3 = "K=2 iid"
settings = [
    { label = "centralized", clients = 1, partition = "iid" },
    { label = "K=2 iid", clients = 2, partition = "iid" },
]
"""


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def splits() -> DataSplits:
    return load_splits("digits", image_size=8, max_samples=240, seed=0)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, splits: DataSplits) -> Path:
    return save_micro_student(tmp_path_factory.mktemp("micro"), splits)


@pytest.fixture(scope="module")
def student(workdir: Path) -> FheViT:
    return load_student(workdir / "student.pt")


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "paper.toml"
    path.write_text(CONFIG)
    return path


def test_the_shipped_tables_are_the_papers_settings() -> None:
    table2, table3 = load_table("table2"), load_table("table3")
    assert table2.methods == ("linear-probe", "full-finetune", "ours")
    assert table2.seeds == (0, 1, 2) and table2.lr_decay
    assert table2.figure_setting == "K=5 alpha=1"
    assert [(s.clients, s.partition, s.alpha) for s in table2.settings] == [
        (1, "iid", 1.0),
        (5, "dirichlet", 100.0),
        (5, "dirichlet", 1.0),
        (5, "dirichlet", 0.01),
    ]
    assert [(s.clients, s.alpha, s.batch_size) for s in table3.settings] == [
        (10, 1.0, 8),
        (20, 1.0, 8),
        (50, 1.0, 8),
    ]


def test_table1_distills_one_student_per_auxiliary_source() -> None:
    table1 = load_table("table1")
    assert {s.distill_data for s in table1.settings} == {"aux", "sample-photos"}
    assert {(s.clients, s.distill_data) for s in table1.settings} == {
        (1, "aux"),
        (5, "aux"),
        (1, "sample-photos"),
        (5, "sample-photos"),
    }


def test_a_table_without_the_student_it_needs_is_refused(
    config_file: Path, student: FheViT, splits: DataSplits, tmp_path: Path
) -> None:
    spec = load_table("tiny", config_file)
    spec = replace(spec, settings=(replace(spec.settings[0], distill_data="sample-photos"),))
    with pytest.raises(ConfigError, match=r"needs students distilled on \['sample-photos'\]"):
        run_table(spec, {"aux": student}, splits, workdir=tmp_path, results_dir=tmp_path)
    # clipping is the text tables' full fine-tuning's: a ViT table that sets it is refused
    clipping = replace(load_table("tiny", config_file), finetune_max_grad_norm=5.0)
    with pytest.raises(ConfigError, match="finetune_max_grad_norm, which only the text"):
        run_table(clipping, {"aux": student}, splits, workdir=tmp_path, results_dir=tmp_path)
    assert not (tmp_path / clipping.name).exists()  # refused before any cell


def test_bad_experiment_configs_are_refused_by_name(config_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no table 'table9'"):
        load_table("table9", config_file)
    with pytest.raises(ConfigError, match="no experiment config"):
        load_table("tiny", tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.replace('"ours"]', '"magic"]'))
    with pytest.raises(ConfigError, match="magic"):
        load_table("tiny", bad)
    bad.write_text(CONFIG.replace('figure3 = "K=2 iid"', 'figure3 = "K=3"'))
    with pytest.raises(ConfigError, match="figure3 names no setting"):
        load_table("tiny", bad)


def test_a_table_runs_every_cell_once_and_resumes_after_an_interruption(
    config_file: Path, student: FheViT, splits: DataSplits, tmp_path: Path
) -> None:
    spec = load_table("tiny", config_file)
    cells, results = tmp_path / "cells", tmp_path / "results"
    rows = run_table(spec, {"aux": student}, splits, workdir=cells, results_dir=results, log=quiet)

    files = sorted((cells / "tiny").glob("*.json"))
    assert len(files) == 2 * 2 * 2  # methods x settings x seeds
    records = [json.loads(path.read_text()) for path in files]
    assert {r["setting"]["label"] for r in records} == {"centralized", "K=2 iid"}
    assert all(r["lr_decay"] and r["rounds"] == 1 for r in records)
    # the summary is the mean and sample standard deviation of the cells
    assert [(r["method"], r["setting"]) for r in rows] == [
        (m, s) for m in ("linear-probe", "ours") for s in ("centralized", "K=2 iid")
    ]
    for row in rows:
        values = [
            r["test_balanced_accuracy"]
            for r in records
            if r["method"] == row["method"] and r["setting"]["label"] == row["setting"]
        ]
        assert row["balanced_accuracy_mean"] == pytest.approx(statistics.fmean(values))
        assert row["balanced_accuracy_std"] == pytest.approx(statistics.stdev(values))
    table = (results / "paper_tiny.md").read_text()
    assert "| ours | K=2 iid |" in table and "±" in table
    assert (results / "paper_figure3.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((results / "paper_tiny.json").read_text())["rows"] == json.loads(
        json.dumps(rows)
    )

    # lose one cell (an interruption before it finished): only that one runs again
    lost = cell_file(cells / "tiny", *_first(spec))
    lost.unlink()
    lines: list[str] = []
    again = run_table(
        spec, {"aux": student}, splits, workdir=cells, results_dir=results, log=lines.append
    )
    assert sum("done before" in line for line in lines) == 7
    assert lost.exists() and again == rows  # the same seeds give the same cell

    # a cell kept from other settings (here: other rounds) is not reused
    longer = replace(spec, rounds=2)
    lines.clear()
    run_table(
        longer, {"aux": student}, splits, workdir=cells, results_dir=results, log=lines.append
    )
    assert not any("done before" in line for line in lines)
    assert {json.loads(p.read_text())["rounds"] for p in files} == {2}

    # a table that sets a method's learning rate runs that method's cells again, at that rate
    lines.clear()
    run_table(
        replace(longer, lr={"ours": 0.02}), {"aux": student}, splits, workdir=cells,
        results_dir=results, log=lines.append,
    )  # fmt: skip
    assert sum("done before" in line for line in lines) == 4  # linear probing's, read back
    rates = {(r["method"], r["lr"]) for r in (json.loads(p.read_text()) for p in files)}
    assert rates == {("linear-probe", default_lr("linear-probe")), ("ours", 0.02)}


def _first(spec):
    return spec.methods[0], spec.settings[0], spec.seeds[0]


def test_the_test_metric_is_the_adapter_on_the_students_blocks(
    student: FheViT, splits: DataSplits
) -> None:
    """A head that always answers class 3 scores 1/num_classes of balanced accuracy; an adapter
    whose arrays do not fit the student is refused."""
    config = DoubleBlindConfig(rank=0)
    head = SideAdapterHead(
        num_blocks=student.num_blocks,
        dim=student.vit.embed_dim,
        num_classes=splits.test.num_classes,
        rank=0,
        alpha=1.0,
    )
    arrays = head.get_arrays()
    arrays = {k: np.zeros_like(v) for k, v in arrays.items()}
    arrays["head.bias"][3] = 1.0
    present = len(torch.unique(splits.test.labels))
    assert adapter_test_accuracy(student, arrays, config, splits.test) == pytest.approx(1 / present)
    with pytest.raises(ProtocolError, match="adapter arrays mismatch: missing"):
        adapter_test_accuracy(student, {"head.bias": arrays["head.bias"]}, config, splits.test)


def test_fedfm_paper_command_writes_the_table(
    config_file: Path, workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        [
            "paper",
            "tiny",
            "--config",
            str(config_file),
            "--seeds",
            "0",
            "--workdir",
            str(workdir),
            "--cells-dir",
            str(tmp_path / "cells"),
            "--results-dir",
            str(tmp_path / "results"),
            "--dataset",
            "digits",
            "--image-size",
            "8",
            "--max-samples",
            "240",
            "--model",
            "vit_fedfm_micro",
            "--no-progress",
        ]
    )
    assert status == 0
    assert len(list((tmp_path / "cells" / "tiny").glob("*.json"))) == 4
    out = capsys.readouterr().out
    assert "regenerate with: fedfm paper tiny" in out


def test_table4_compares_the_methods_training_steps(
    student: FheViT, splits: DataSplits, tmp_path: Path
) -> None:
    rows = run_efficiency_table(student, splits, repeats=2, results_dir=tmp_path)
    by_method = {row["method"]: row for row in rows}
    assert list(by_method) == ["linear-probe", "full-finetune", "ours"]
    lp, ft, ours = by_method["linear-probe"], by_method["full-finetune"], by_method["ours"]
    # linear probing trains the head (and its norm) only; full fine-tuning every weight
    classes = splits.pool.num_classes
    dim = student.vit.embed_dim
    assert lp["trainable_parameters"] == dim * classes + classes + 2 * dim
    assert ft["trainable_parameters"] > ours["trainable_parameters"] > lp["trainable_parameters"]
    assert ft["activation_mib"] > ours["activation_mib"] > lp["activation_mib"] > 0
    assert lp["parameters_x"] == lp["latency_x"] == 1.0
    assert all(row["ms_per_sample"] > 0 for row in rows)
    assert "| ours |" in (tmp_path / "paper_table4.md").read_text()
