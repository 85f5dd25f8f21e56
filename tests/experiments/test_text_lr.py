"""``fedfm paper-text --select-lr`` (fedfm.experiments.text_lr): each client holds out part of its
own partition, the grid trains on the rest, the test texts are never read, the best mean rate
wins; a table's learning rates reach its cells, and a cell run with another rate runs again."""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from fedfm.cli import main
from fedfm.distillation.text import weights_digest
from fedfm.errors import ConfigError
from fedfm.experiments import text_adaptation, text_lr
from fedfm.experiments.paper import Setting, default_lr, load_table
from fedfm.experiments.text_adaptation import run_text_table
from fedfm.experiments.text_lr import choose_rates, select_text_lr, validation_split
from tests.experiments.test_text_adaptation import tiny_splits, tiny_student

SETTING = Setting("K=2 alpha=1", 2, "dirichlet", 1.0, 16, "stdlib")
RESULTS = Path(__file__).resolve().parents[2] / "results"


def test_each_client_holds_out_its_own_share_and_trains_on_the_rest() -> None:
    parts = [np.arange(0, 50), np.arange(50, 60), np.arange(60, 62)]
    training, validation = validation_split(parts, 0.2, seed=3)
    for part, kept in zip(parts, training, strict=True):
        held = np.intersect1d(part, validation)
        assert len(held) == round(0.2 * len(part))  # its own share, from its own texts
        assert np.array_equal(np.sort(np.concatenate([kept, held])), part)  # nothing lost
        assert len(np.intersect1d(kept, validation)) == 0  # no text both ways
    again, _ = validation_split(parts, 0.2, seed=4)
    assert not np.array_equal(training[0], again[0])  # the seed draws the split
    with pytest.raises(ConfigError, match="validation fraction must be in"):
        validation_split(parts, 1.0, seed=0)
    with pytest.raises(ConfigError, match="no client holds out a text"):
        validation_split([np.arange(2)], 0.2, seed=0)


def test_the_best_mean_rate_wins_and_ties_go_to_the_smaller_rate() -> None:
    scores = {"ours": {0.01: [0.5, 0.7], 0.02: [0.65, 0.66], 0.05: [0.1, 0.9]}}
    assert choose_rates(scores) == {"ours": 0.02}
    assert choose_rates({"ours": {0.1: [0.6], 0.05: [0.6]}}) == {"ours": 0.05}


def _patched(monkeypatch) -> list[int]:
    student, splits = tiny_student(), tiny_splits()
    encoded: list[int] = []
    features = text_lr.block_features

    def recording(model, texts, **kwargs):
        assert texts is not splits.test, "the selection read the test texts"
        encoded.append(len(texts))
        return features(model, texts, **kwargs)

    report = {
        "teacher_balanced_accuracy": 0.5,
        "student_balanced_accuracy": 0.4,
        "weights_digest": weights_digest(student),
    }
    monkeypatch.setattr(text_lr, "kept_text_student", lambda run, folder, **_: (student, report))
    monkeypatch.setattr(text_lr, "text_splits", lambda run: splits)
    monkeypatch.setattr(text_lr, "block_features", recording)
    monkeypatch.setattr(text_adaptation, "kept_text_student", lambda run, f, **_: (student, report))
    monkeypatch.setattr(text_adaptation, "text_splits", lambda run: splits)
    return encoded


def _rates_of_table_cells(monkeypatch) -> list[float]:
    """The learning rate of every table cell that trains from now on, in order."""
    used: list[float] = []
    train = text_adaptation.train_adapter

    def recording(pool, test, parts, config, **kwargs):
        used.append(config.lr)
        return train(pool, test, parts, config, **kwargs)

    monkeypatch.setattr(text_adaptation, "train_adapter", recording)
    return used


def test_selection_runs_the_grid_on_held_out_pool_texts_and_resumes(tmp_path, monkeypatch) -> None:
    encoded = _patched(monkeypatch)
    spec = replace(load_table("text", rounds=3), settings=(SETTING,))
    progress: list[str] = []
    chosen = select_text_lr(
        spec,
        student_dir=tmp_path / "s",
        workdir=tmp_path / "cells",
        results_dir=tmp_path / "r",
        grid=(0.001, 0.5),
        seeds=(7, 8),
        log=progress.append,
    )
    assert encoded == [96]  # the pool once; never the test texts
    rounds = [line for line in progress if "round 3/3" in line]
    assert len(rounds) == 8 and all("held-out pool balanced accuracy" in line for line in rounds)
    report = json.loads((tmp_path / "r" / "text_lr_selection.json").read_text())
    assert len(report["cells"]) == 2 * 2 * 2 and len(report["rows"]) == 4
    for method in ("linear-probe", "ours"):
        rows = {row["lr"]: row for row in report["rows"] if row["method"] == method}
        best = max(rows, key=lambda rate: rows[rate]["validation_balanced_accuracy_mean"])
        assert chosen[method] == best and rows[best]["chosen"] == "yes"
    for cell in report["cells"]:
        # the held-out texts are a fifth of the pool, and training used the rest
        assert cell["validation_texts"] + cell["training_texts"] == 96
        assert abs(cell["validation_texts"] - 0.2 * 96) <= 2
    # a rate of 0.001 for 3 rounds barely moves a fresh head; 0.5 learns the separable task
    assert chosen == {"linear-probe": 0.5, "ours": 0.5}
    # the table's whole entry: the rates chosen here over the rest of what it sets
    entry = {**spec.lr, "linear-probe": 0.5, "ours": 0.5}
    assert report["config_entry"] == (
        "lr = { " + ", ".join(f'"{method}" = {rate:g}' for method, rate in entry.items()) + " }"
    )

    def refuse(*_args, **_kwargs):
        raise AssertionError("a finished selection cell ran again")

    monkeypatch.setattr(text_lr, "train_adapter", refuse)
    lines: list[str] = []
    again = select_text_lr(
        spec,
        student_dir=tmp_path / "s",
        workdir=tmp_path / "cells",
        results_dir=tmp_path / "r2",
        grid=(0.001, 0.5),
        seeds=(7, 8),
        log=lines.append,
    )
    assert again == chosen and sum("done before" in line for line in lines) == 8
    with pytest.raises(AssertionError, match="ran again"):  # another fraction: other cells
        select_text_lr(
            spec, student_dir=tmp_path / "s", workdir=tmp_path / "cells",
            results_dir=tmp_path / "r3", grid=(0.5,), seeds=(7,), fraction=0.3,
            log=lambda _line: None,
        )  # fmt: skip


def test_selection_never_mixes_cells_of_a_student_with_other_weights(tmp_path, monkeypatch) -> None:
    _patched(monkeypatch)
    spec = replace(load_table("text", rounds=2), settings=(SETTING,))
    options = {
        "student_dir": tmp_path / "s", "workdir": tmp_path / "cells", "results_dir": tmp_path / "r",
        "seeds": (7,), "methods": ("linear-probe",), "log": lambda _line: None,
    }  # fmt: skip
    select_text_lr(spec, grid=(0.5,), **options)
    student = tiny_student()
    other = {"teacher_balanced_accuracy": 0.5, "student_balanced_accuracy": 0.4}
    other["weights_digest"] = "0" * 16  # distilled again elsewhere: same name, other weights
    monkeypatch.setattr(text_lr, "kept_text_student", lambda run, folder, **_: (student, other))
    with pytest.raises(ConfigError, match=r"1 finished cells .* other weights"):
        select_text_lr(spec, grid=(0.5, 0.1), **options)
    assert len(list((tmp_path / "cells").rglob("*.json"))) == 1


def test_full_finetuning_is_selected_on_its_own_grid_and_held_out_texts(
    tmp_path, monkeypatch
) -> None:
    _patched(monkeypatch)

    def rows(texts):
        return {tuple(row) for row in texts.input_ids.tolist()}

    test_rows = rows(tiny_splits().test)
    finetune = text_lr.finetune_text
    seen: list[tuple[float, int]] = []

    def recording(student, pool, held_out, parts, config, *, lr, **kwargs):
        # evaluated on pool texts the clients hold out, never on the test texts
        assert rows(held_out) <= rows(pool) and not rows(held_out) & test_rows
        assert sum(len(p) for p in parts) + len(held_out) == len(pool)  # disjoint, all the pool
        seen.append((lr, len(held_out)))
        return finetune(student, pool, held_out, parts, config, lr=lr, **kwargs)

    monkeypatch.setattr(text_lr, "finetune_text", recording)
    monkeypatch.setattr(text_lr, "train_adapter", None)  # full fine-tuning trains no adapter
    spec = replace(load_table("text", rounds=2), settings=(SETTING,))
    chosen = select_text_lr(
        spec,
        student_dir=tmp_path / "s",
        workdir=tmp_path / "cells",
        results_dir=tmp_path / "r",
        seeds=(7,),
        methods=("full-finetune",),
        log=lambda _line: None,
    )
    assert [rate for rate, _ in seen] == list(text_lr.FINETUNE_LR_GRID)
    report = json.loads((tmp_path / "r" / "text_lr_selection_full_finetune.json").read_text())
    assert not (tmp_path / "r" / "text_lr_selection.json").exists()  # the adapters' stays
    assert set(chosen) == {"full-finetune"} and report["chosen"] == chosen
    assert [row["lr"] for row in report["rows"]] == list(text_lr.FINETUNE_LR_GRID)
    assert all(cell["method"] == "full-finetune" for cell in report["cells"])
    # the table's whole entry: the adapters' rates it sets, full fine-tuning's chosen here
    rate = chosen["full-finetune"]
    assert report["config_entry"] == (
        f'lr = {{ "linear-probe" = {spec.lr_of("linear-probe"):g}, '
        f'"ours" = {spec.lr_of("ours"):g}, "full-finetune" = {rate:g} }}'
    )
    assert "whole minilm student" in report["description"]
    clip = spec.max_grad_norm_of("full-finetune")  # the selection trains as the table does
    assert f"clipped to total norm {clip:g}" in report["description"]


def test_full_finetuning_that_diverges_stops_and_says_so(tmp_path, monkeypatch) -> None:
    _patched(monkeypatch)
    spec = replace(load_table("text", rounds=6), settings=(SETTING,))
    lines: list[str] = []
    select_text_lr(
        spec, student_dir=tmp_path / "s", workdir=tmp_path / "cells",
        results_dir=tmp_path / "r", grid=(1e30,), seeds=(7,), methods=("full-finetune",),
        log=lines.append,
    )  # fmt: skip
    (cell,) = json.loads((tmp_path / "r" / "text_lr_selection_full_finetune.json").read_text())[
        "cells"
    ]
    stopped = cell["diverged_at_round"]
    assert 1 <= stopped < 6 and any(f"diverged in round {stopped}" in line for line in lines)
    for key in ("validation_balanced_accuracy_per_round", "train_loss_per_round"):
        assert len(cell[key]) == 6 and cell[key][stopped:] == [None] * (6 - stopped)
    assert not any(f"round {stopped + 1}/6" in line for line in lines)  # the rest did not run
    # the cell's accuracy is the diverged model's
    final = cell["validation_balanced_accuracy_per_round"][stopped - 1]
    assert cell["validation_balanced_accuracy"] == final


def test_a_diverged_rate_is_read_back_as_it_was_written(tmp_path, monkeypatch) -> None:
    _patched(monkeypatch)
    spec = replace(load_table("text", rounds=2), settings=(SETTING,))
    options = {
        "student_dir": tmp_path / "s", "workdir": tmp_path / "cells", "grid": (0.5, 1e30),
        "seeds": (7,), "methods": ("ours",), "log": lambda _line: None,
    }  # fmt: skip
    select_text_lr(spec, results_dir=tmp_path / "r", **options)
    first = json.loads((tmp_path / "r" / "text_lr_selection.json").read_text())
    assert first["rows"][1]["final_train_loss_mean"] is None  # NaN: the rate diverged

    def refuse(*_args, **_kwargs):
        raise AssertionError("a finished selection cell ran again")

    monkeypatch.setattr(text_lr, "train_adapter", refuse)
    select_text_lr(spec, results_dir=tmp_path / "r2", **options)  # its NaN loss is a null now
    again = json.loads((tmp_path / "r2" / "text_lr_selection.json").read_text())
    assert again["rows"] == first["rows"] and again["chosen"] == {"ours": 0.5}


def test_selection_refuses_mixed_methods_and_bad_grids(tmp_path) -> None:
    spec = replace(load_table("text", rounds=3), settings=(SETTING,))
    options = {"student_dir": tmp_path, "workdir": tmp_path, "results_dir": tmp_path}
    with pytest.raises(ConfigError, match="full fine-tuning's rate on its own"):
        select_text_lr(spec, methods=("ours", "full-finetune"), **options)
    with pytest.raises(ConfigError, match="not \\['boosting'\\]"):
        select_text_lr(spec, methods=("boosting",), **options)
    with pytest.raises(ConfigError, match="rates > 0"):
        select_text_lr(spec, grid=(0.05, -1.0), **options)
    with pytest.raises(ConfigError, match="needs a method"):
        select_text_lr(spec, methods=(), **options)


def test_hidden_lengths_get_their_own_selection_and_their_rates_reach_hidden_cells(
    tmp_path, monkeypatch
) -> None:
    _patched(monkeypatch)
    masks: list[bool] = []
    features = text_lr.block_features

    def recording(model, texts, **kwargs):
        masks.append(kwargs.get("hide_text_lengths", False))
        return features(model, texts, **kwargs)

    monkeypatch.setattr(text_lr, "block_features", recording)
    spec = replace(load_table("text", seeds=[0], rounds=2), settings=(SETTING,))
    options = {
        "student_dir": tmp_path / "s", "workdir": tmp_path / "cells", "grid": (0.001, 0.5),
        "seeds": (7,), "methods": ("linear-probe",), "log": lambda _line: None,
    }  # fmt: skip
    chosen = select_text_lr(spec, results_dir=tmp_path / "r", hide_text_lengths=True, **options)
    assert masks == [True]  # all-real key masks, as such a data owner uploads them
    assert not (tmp_path / "r" / "text_lr_selection.json").exists()  # the shown selection stays
    report = json.loads((tmp_path / "r" / "text_lr_selection_hidden_lengths.json").read_text())
    assert report["hide_text_lengths"] and report["chosen"] == chosen
    assert all(cell["hide_text_lengths"] for cell in report["cells"])
    # the table's whole entry: the rate chosen here over what it sets for the other method
    entry = {**spec.lr_hidden_lengths, **chosen}
    assert report["config_entry"] == (
        "lr_hidden_lengths = { " + ", ".join(f'"{m}" = {r:g}' for m, r in entry.items()) + " }"
    )
    assert len(list((tmp_path / "cells" / "text-lr-selection-hidden-lengths").glob("*.json"))) == 2

    def refuse(*_args, **_kwargs):
        raise AssertionError("a selection cell ran")

    monkeypatch.setattr(text_lr, "train_adapter", refuse)
    assert (
        select_text_lr(spec, results_dir=tmp_path / "r", hide_text_lengths=True, **options)
        == chosen
    )
    with pytest.raises(AssertionError, match="cell ran"):  # lengths shown: cells of their own
        select_text_lr(spec, results_dir=tmp_path / "r", **options)
    with pytest.raises(ConfigError, match="no server to hide them from"):
        select_text_lr(spec, results_dir=tmp_path / "r", hide_text_lengths=True,
                       **{**options, "methods": ("full-finetune",)})  # fmt: skip

    # the table: hidden cells train at the hidden rate, compared with shown cells at theirs
    used = _rates_of_table_cells(monkeypatch)
    table = replace(
        spec,
        methods=("linear-probe",),
        lr={"linear-probe": 0.3},
        lr_hidden_lengths={"linear-probe": 0.02},
    )
    cells = {"student_dir": tmp_path / "s", "workdir": tmp_path / "t", "log": lambda _line: None}
    run_text_table(table, results_dir=tmp_path / "r", **cells)
    run_text_table(table, results_dir=tmp_path / "r", hide_text_lengths=True, **cells)
    assert used == [0.3, 0.02]
    hidden = json.loads((tmp_path / "r" / "text_adaptation_hidden_lengths.json").read_text())
    assert [cell["lr"] for cell in hidden["cells"]] == [0.02]
    assert hidden["lengths_shown_comparison"][SETTING.label]["linear_probe"]["seeds"] == [0]
    assert "--select-lr --hide-text-lengths" in hidden["description"]
    assert "texts' own masks (learning rates linear-probe 0.3)" in hidden["description"]
    run_text_table(table, results_dir=tmp_path / "r", hide_text_lengths=True, **cells)
    assert used == [0.3, 0.02]  # read back at its own rate: nothing runs again


def test_a_tables_rates_reach_its_cells_and_other_rates_run_again(tmp_path, monkeypatch) -> None:
    _patched(monkeypatch)
    spec = replace(
        load_table("text", seeds=[0], rounds=2),
        methods=("linear-probe", "ours"),
        settings=(SETTING,),
        lr={},
    )
    used = _rates_of_table_cells(monkeypatch)
    options = {"student_dir": tmp_path / "s", "workdir": tmp_path / "cells", "log": print}
    run_text_table(spec, results_dir=tmp_path / "r", **options)
    assert used == [default_lr("linear-probe"), default_lr("ours")]
    run_text_table(spec, results_dir=tmp_path / "r", **options)  # read back: nothing runs
    assert len(used) == 2
    tuned = replace(spec, lr={"ours": 0.02})
    run_text_table(tuned, results_dir=tmp_path / "r", **options)
    assert used[2:] == [0.02]  # only ours ran again, with its new rate
    report = json.loads((tmp_path / "r" / "text_adaptation.json").read_text())
    assert {c["method"]: c["lr"] for c in report["cells"]} == {
        "linear-probe": default_lr("linear-probe"),
        "ours": 0.02,
    }
    assert "ours 0.02" in report["description"] and "--select-lr" in report["description"]
    # a cell written before tables set rates (no "lr") counts as the method's default rate
    cell = next((tmp_path / "cells" / "text").glob("linear-probe__*.json"))
    record = json.loads(cell.read_text())
    del record["lr"]
    cell.write_text(json.dumps(record))
    run_text_table(tuned, results_dir=tmp_path / "r", **options)
    assert len(used) == 3


def test_the_config_reads_rates_and_refuses_bad_ones(tmp_path) -> None:
    config = tmp_path / "t.toml"
    base = (
        '[defaults]\nmethods = ["ours"]\nseeds = [0]\nrounds = 2\nlr_decay = true\n[t]\n'
        'title = "t"\nsettings = [{ label = "a", clients = 2, partition = "iid" }]\n'
    )
    config.write_text(f"{base}lr = {{ ours = 0.02 }}\n")
    spec = load_table("t", config)
    assert spec.lr_of("ours") == 0.02 and spec.lr_of("linear-probe") == default_lr("ours")
    config.write_text(f"{base}lr = {{ ours = 0.02 }}\nlr_hidden_lengths = {{ ours = 0.005 }}\n")
    spec = load_table("t", config)
    assert spec.lr_of("ours") == 0.02 and spec.hiding_lengths().lr_of("ours") == 0.005
    assert spec.hiding_lengths().lr_of("linear-probe") == default_lr("linear-probe")
    assert spec.max_grad_norm_of("full-finetune") is None  # not set: not clipped
    config.write_text(f"{base}finetune_max_grad_norm = 5\n")
    spec = load_table("t", config)
    assert spec.max_grad_norm_of("full-finetune") == 5.0
    assert spec.max_grad_norm_of("ours") is None  # the adapters never clip
    refused = {
        "lr = { ours = -0.1 }": "learning rate of ours must be > 0",
        "lr = { boosting = 0.1 }": "boosting",
        'lr = { ours = "fast" }': "missing or bad key",
        'lr_hidden_lengths = { "full-finetune" = 0.01 }': "no server to hide lengths from",
        "lr_hidden_lengths = { ours = 0 }": "learning rate of ours must be > 0",
        "finetune_max_grad_norm = 0": "finetune_max_grad_norm must be > 0",
        'finetune_max_grad_norm = "low"': "missing or bad key",
    }
    for line, message in refused.items():
        config.write_text(f"{base}{line}\n")
        with pytest.raises(ConfigError, match=message):
            load_table("t", config)


def test_the_text_tables_rates_are_the_committed_selections_choice() -> None:
    """One source: the config's ``lr`` entry is what the committed selection chose."""
    config = tomllib.loads((resources.files("fedfm.experiments") / "paper.toml").read_text())
    for table, name in (("text", "text_lr_selection"), ("text_table1", "text_lr_selection_table1")):
        path = RESULTS / f"{name}.json"
        if not path.exists():
            assert "lr" not in config[table], f"{table} sets rates no selection chose"
            continue
        chosen = json.loads(path.read_text())["chosen"]
        finetuning = RESULTS / f"{name}_full_finetune.json"
        if finetuning.exists():
            chosen |= json.loads(finetuning.read_text())["chosen"]
        else:
            assert "full-finetune" not in config[table].get("lr", {}), f"{table}: unchosen rate"
        assert config[table].get("lr") == chosen, f"paper.toml [{table}] lr != {path.name}"
        hidden = RESULTS / f"{name}_hidden_lengths.json"
        expected = json.loads(hidden.read_text())["chosen"] if hidden.exists() else None
        assert config[table].get("lr_hidden_lengths") == expected, f"[{table}] lr_hidden_lengths"


def test_the_command_selects_with_its_own_seeds_and_refuses_other_modes(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(text_lr, "select_text_lr", lambda spec, **kw: seen.append((spec, kw)))
    assert main(["paper-text", "--select-lr", "--settings", "K=5 alpha=1",
                 "--lr-grid", "0.02", "0.05", "--results-dir", str(tmp_path)]) == 0  # fmt: skip
    spec, options = seen[0]
    assert [s.label for s in spec.settings] == ["K=5 alpha=1"]
    assert options["grid"] == [0.02, 0.05] and tuple(options["seeds"]) == text_lr.SELECTION_SEEDS
    assert tuple(options["methods"]) == text_lr.SELECTABLE_METHODS and spec.seeds == (0, 1, 2)
    assert hash(spec) == hash(replace(spec, lr={"ours": 0.3}))  # a table is still hashable
    assert main(["paper-text", "--select-lr", "--seeds", "5"]) == 0
    assert seen[1][1]["seeds"] == [5] and seen[1][0].seeds == (0, 1, 2)
    assert main(["paper-text", "--select-lr", "--protocol"]) != 0
    assert main(["paper-text", "--select-lr", "--methods", "ours"]) == 0
    assert list(seen[2][1]["methods"]) == ["ours"] and seen[2][1]["grid"] is None
    assert main(["paper-text", "--select-lr", "--methods", "full-finetune"]) == 0
    assert list(seen[3][1]["methods"]) == ["full-finetune"]
    assert main(["paper-text", "--select-lr", "--hide-text-lengths"]) == 0
    assert seen[4][1]["hide_text_lengths"] and not seen[0][1]["hide_text_lengths"]
    assert main(["paper-text", "--lr-grid", "0.1"]) != 0
    assert main(["paper-text", "--select-lr", "--kept-only"]) != 0
    assert len(seen) == 5


def test_clipping_reaches_full_finetuning_cells_and_unclipped_cells_run_again(
    tmp_path, monkeypatch
) -> None:
    _patched(monkeypatch)
    clipped_to: list[float | None] = []
    finetune = text_adaptation.finetune_text

    def recording(*args, **kwargs):
        clipped_to.append(kwargs["max_grad_norm"])
        return finetune(*args, **kwargs)

    monkeypatch.setattr(text_adaptation, "finetune_text", recording)
    spec = replace(
        load_table("text", seeds=[0], rounds=2), methods=("full-finetune",), settings=(SETTING,)
    )
    options = {"student_dir": tmp_path / "s", "workdir": tmp_path / "cells", "log": print}
    for max_grad_norm in (None, 2.0, 2.0):
        clipping = replace(spec, finetune_max_grad_norm=max_grad_norm)
        run_text_table(clipping, results_dir=tmp_path / "r", **options)
    assert clipped_to == [None, 2.0]  # the unclipped cell ran again clipped, then was read back
    report = json.loads((tmp_path / "r" / "text_adaptation.json").read_text())
    (cell,) = report["cells"]
    assert cell["max_grad_norm"] == 2.0 and 0 <= cell["clipped_steps"] <= cell["steps"] > 0
    assert cell["gradient_norm"]["max"] >= cell["gradient_norm"]["median"] > 0
    (row,) = report["rows"]  # the table says how often clipping acted
    assert row["clipped_steps_fraction"] == cell["clipped_steps"] / cell["steps"]
    assert row["gradient_clipped"].startswith("norm 2: ") and row["diverged_seeds"] == []
    assert "gradient clipped" in (tmp_path / "r" / "text_adaptation.md").read_text()
