"""``fedfm paper-text`` (fedfm.experiments.text_adaptation) on a tiny random BERT: the methods
train, the table resumes cell by cell and writes its keys; the mean-pooling adapter reads only real
tokens; a kept student is read back, a foreign one refused."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedfm.approx import ApproxConfig
from fedfm.cli import main
from fedfm.data.partition import partition
from fedfm.data.text_task import TextSplits, TokenizedTexts
from fedfm.distillation import text as text_distillation
from fedfm.distillation.text import (
    TextDistillRun,
    kept_student_path,
    kept_text_student,
    weights_digest,
)
from fedfm.errors import ConfigError, ProtocolError
from fedfm.experiments import text_adaptation
from fedfm.experiments.paper import Setting, TableSpec, load_table
from fedfm.experiments.text_adaptation import (
    TextFeatures,
    block_features,
    finetune_text,
    round_draws,
    run_text_table,
    table_config,
    train_adapter,
)
from fedfm.models import fhe_text
from fedfm.models.fhe_text import to_fhe_text
from fedfm.protocols.double_blind.adapter import SideAdapterHead
from fedfm.protocols.double_blind.config import DoubleBlindConfig
from tests.models.test_fhe_text import PAD, tiny_bert

CLASSES = 3


def tiny_student() -> object:
    approx = ApproxConfig.exact()
    return to_fhe_text(tiny_bert(), approx, num_classes=CLASSES, pad_token_id=PAD).eval()


def tiny_texts(count: int, seed: int) -> TokenizedTexts:
    """Texts whose class decides their first real token (learnable), right-padded to 12."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 50, (count, 12), generator=generator)
    labels = torch.arange(count) % CLASSES
    ids[:, 0] = labels + 1
    for row in range(count):
        ids[row, 3 + row % 8 :] = PAD
    return TokenizedTexts([f"text {i}" for i in range(count)], ids, labels, CLASSES)


def tiny_splits() -> TextSplits:
    pool, test = tiny_texts(96, 1), tiny_texts(30, 2)
    return TextSplits(("a", "b", "c"), 12, pool, pool, test, pool)


def separable_features(count: int, seed: int) -> TextFeatures:
    """Block outputs (N, 2 blocks, 5 tokens, 8) whose real tokens carry the class."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % CLASSES
    blocks = torch.randn(count, 2, 5, 8, generator=generator)
    blocks[:, :, :, :CLASSES] += 3.0 * torch.nn.functional.one_hot(labels, 8)[:, None, None, :3]
    key_mask = torch.ones(count, 5, dtype=torch.bool)
    key_mask[::2, 3:] = False
    return TextFeatures(blocks, key_mask, labels)


def test_mean_pooling_reads_only_real_tokens_and_needs_the_key_mask() -> None:
    torch.manual_seed(0)
    adapter = SideAdapterHead(num_blocks=2, dim=8, num_classes=3, rank=2, pooling="mean")
    with torch.no_grad():
        for up in adapter.up:  # a non-zero adapter, so the side path matters too
            up.weight.normal_()
    features = separable_features(4, 0)
    blocks = list(features.blocks.unbind(1))
    order = torch.arange(4)
    logits = adapter(blocks, order, order.repeat(2, 1), features.key_mask)
    changed = [b.clone() for b in blocks]
    for b in changed:
        b[~features.key_mask] = 1e3  # padding positions: any value
    again = adapter(changed, order, order.repeat(2, 1), features.key_mask)
    torch.testing.assert_close(logits, again)
    with pytest.raises(ProtocolError, match="mean pooling needs a key mask of shape"):
        adapter(blocks, order, order.repeat(2, 1))
    with pytest.raises(ConfigError, match="unknown pooling 'max'"):
        SideAdapterHead(num_blocks=1, dim=8, num_classes=3, pooling="max")


def test_block_features_are_what_the_student_computes() -> None:
    student = tiny_student()
    texts = tiny_texts(10, 3)
    features = block_features(student, texts)
    assert features.blocks.shape == (10, 2, 12, 16)
    with torch.no_grad():
        pooled = student.pool(features.blocks[:, -1], features.key_mask)
        torch.testing.assert_close(student.classifier(pooled), student(texts.input_ids))


def test_hidden_lengths_make_the_blocks_attend_to_padding_and_pool_every_position() -> None:
    """With ``hide_text_lengths`` the block outputs are the student's with an all-real key mask
    (what the server computes for such a data owner), pooled over every position."""
    student = tiny_student()
    texts = tiny_texts(10, 3)
    shown, hidden = (
        block_features(student, texts),
        block_features(student, texts, hide_text_lengths=True),
    )
    assert hidden.key_mask.all() and not shown.key_mask.all()
    with torch.no_grad():
        everything = torch.ones_like(shown.key_mask)
        expected = student.embed(texts.input_ids)
        for index in range(student.num_blocks):
            expected = student.block(index, expected, everything)
            torch.testing.assert_close(hidden.blocks[:, index], expected)
    real = shown.key_mask
    # attending to padding changes the real tokens' outputs too: the hiding has a cost
    assert (hidden.blocks[:, -1][real] - shown.blocks[:, -1][real]).abs().max() > 1e-3


def test_round_draws_sit_out_small_clients_and_never_repeat_a_text() -> None:
    parts = [np.arange(0, 40), np.arange(40, 50), np.arange(50, 90)]
    draws = round_draws(np.random.default_rng(0), parts, batch_size=16, batches=4)
    assert [client for client, _ in draws] == [0, 2]  # client 1 holds 10 < 16 texts
    for client, batches in draws:
        assert len(batches) == 2 and all(len(b) == 16 for b in batches)  # 40 // 16
        chosen = np.concatenate(batches)
        assert len(set(chosen.tolist())) == 32 and set(chosen) <= set(parts[client].tolist())


def test_ours_and_linear_probing_learn_with_the_protocols_rule() -> None:
    pool, test = separable_features(120, 1), separable_features(30, 2)
    parts = [np.arange(0, 60), np.arange(60, 120)]
    spec = TableSpec("t", "t", ("linear-probe", "ours"), (), (0,), 8, False)
    setting = Setting("K=2", 2, "iid")
    results = {}
    for method in ("linear-probe", "ours"):
        config = table_config(spec, setting, method)
        results[method] = train_adapter(
            pool, test, parts, config, num_classes=CLASSES, seed=0, log=lambda _: None
        )
    probe, ours = results["linear-probe"], results["ours"]
    assert probe["trainable_parameters"] == 8 * 2 + 8 * 3 + 3  # LayerNorm and head
    assert ours["trainable_parameters"] > probe["trainable_parameters"]  # plus two adapters
    for result in (probe, ours):
        losses = result["train_loss_per_round"]
        assert losses[-1] < losses[0] and result["test_balanced_accuracy"] > 0.9
        assert result["clients_trained"] == [2] * 8
    again = train_adapter(
        pool,
        test,
        parts,
        table_config(spec, setting, "ours"),
        num_classes=CLASSES,
        seed=0,
        log=lambda _: None,
    )
    assert again["train_loss_per_round"] == ours["train_loss_per_round"]  # seeded


def test_texts_are_partitioned_with_flwr_datasets() -> None:
    texts = tiny_texts(60, 0)
    parts = partition(texts, num_partitions=3, scheme="dirichlet", alpha=0.5, seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(60))


def _patched_table(monkeypatch, student, splits) -> list[str]:
    loaded = []

    def fake_student(run, folder, **_):
        loaded.append(run.distill_data)
        report = {
            "teacher_balanced_accuracy": 0.5,
            "student_balanced_accuracy": 0.4,
            "weights_digest": weights_digest(student),  # as the student is now
        }
        return student, report

    monkeypatch.setattr(text_adaptation, "kept_text_student", fake_student)
    monkeypatch.setattr(text_adaptation, "text_splits", lambda run: splits)
    return loaded


def test_the_table_runs_every_method_resumes_and_writes_its_keys(tmp_path, monkeypatch) -> None:
    student, splits = tiny_student(), tiny_splits()
    loaded = _patched_table(monkeypatch, student, splits)
    spec = replace(
        load_table("text", seeds=[0, 1], rounds=2),
        settings=(Setting("K=2 alpha=1", 2, "dirichlet", 1.0, 16, "stdlib"),),
    )
    summary = run_text_table(
        spec, student_dir=tmp_path / "s", workdir=tmp_path / "cells", results_dir=tmp_path / "r"
    )
    report = json.loads((tmp_path / "r" / "text_adaptation.json").read_text())
    setting = report["settings"]["K=2 alpha=1"]
    assert set(setting) >= {"linear_probe", "ours", "full_finetune", "ours_beats_linear_probe"}
    for key in ("linear_probe", "ours", "full_finetune"):
        entry = setting[key]
        assert len(entry["balanced_accuracy_per_seed"]) == 2
        assert 0.0 <= entry["balanced_accuracy_mean"] <= 1.0 and entry["trainable_parameters"] > 0
    assert summary["K=2 alpha=1"]["ours"] == setting["ours"]
    assert "plaintext" in report["backend"] and (tmp_path / "r" / "text_adaptation.png").exists()
    assert loaded == ["stdlib"]

    def refuse(*_args, **_kwargs):
        raise AssertionError("a finished cell ran again")

    monkeypatch.setattr(text_adaptation, "train_adapter", refuse)
    monkeypatch.setattr(text_adaptation, "finetune_text", refuse)
    lines: list[str] = []
    run_text_table(
        spec,
        student_dir=tmp_path / "s",
        workdir=tmp_path / "cells",
        results_dir=tmp_path / "r2",
        log=lines.append,
    )
    assert sum("done before" in line for line in lines) == 6
    again = json.loads((tmp_path / "r2" / "text_adaptation.json").read_text())
    assert again["settings"] == report["settings"]
    with pytest.raises(AssertionError, match="a finished cell ran again"):
        # the same cells for another model's student do not count
        run_text_table(
            spec, student_dir=tmp_path / "s", workdir=tmp_path / "cells",
            results_dir=tmp_path / "r3", model="bert-base-uncased", log=lines.append,
        )  # fmt: skip


def test_kept_only_summarises_the_finished_cells_and_lists_the_rest(tmp_path, monkeypatch) -> None:
    student, splits = tiny_student(), tiny_splits()
    _patched_table(monkeypatch, student, splits)
    spec = replace(
        load_table("text", seeds=[0, 1], rounds=2),
        settings=(Setting("K=2 alpha=1", 2, "dirichlet", 1.0, 16, "stdlib"),),
    )
    with pytest.raises(ConfigError, match="no finished cells of table 'text'"):
        run_text_table(
            spec, student_dir=tmp_path, workdir=tmp_path / "cells", results_dir=tmp_path / "r",
            run_missing=False,
        )  # fmt: skip
    run_text_table(
        replace(spec, methods=("linear-probe", "ours"), seeds=(0,)),
        student_dir=tmp_path, workdir=tmp_path / "cells", results_dir=tmp_path / "r",
    )  # fmt: skip
    run_text_table(
        spec, student_dir=tmp_path, workdir=tmp_path / "cells", results_dir=tmp_path / "r",
        run_missing=False,
    )  # fmt: skip
    report = json.loads((tmp_path / "r" / "text_adaptation.json").read_text())
    setting = report["settings"]["K=2 alpha=1"]
    assert setting["ours"]["seeds"] == [0] and setting["linear_probe"]["seeds"] == [0]
    assert "full_finetune" not in setting
    assert "ours_beats_linear_probe" not in setting  # one seed: no standard deviation
    assert len(report["missing_cells"]) == 4 and "Not run yet: 4 of 6" in report["description"]


def test_cells_of_a_student_with_other_weights_are_never_mixed_into_a_table(
    tmp_path, monkeypatch
) -> None:
    student, splits = tiny_student(), tiny_splits()
    _patched_table(monkeypatch, student, splits)
    spec = replace(
        load_table("text", seeds=[0, 1], rounds=2),
        methods=("linear-probe",),
        settings=(Setting("K=2 alpha=1", 2, "dirichlet", 1.0, 16, "stdlib"),),
    )
    options = {"student_dir": tmp_path / "s", "workdir": tmp_path / "cells"}
    run_text_table(replace(spec, seeds=(0,)), results_dir=tmp_path / "r", **options)
    cell = json.loads(next((tmp_path / "cells" / "text").glob("*.json")).read_text())
    assert cell["student_weights"] == weights_digest(student)
    results = json.loads((tmp_path / "r" / "text_adaptation.json").read_text())
    assert results["students"]["stdlib"]["weights_digest"] == weights_digest(student)
    # the same settings distilled again elsewhere: the kept student's name, other weights
    with torch.no_grad():
        next(student.parameters()).add_(1e-3)
    with pytest.raises(ConfigError, match=r"1 finished cells .* other weights"):
        run_text_table(spec, results_dir=tmp_path / "r", **options)
    assert len(list((tmp_path / "cells" / "text").glob("*.json"))) == 1  # nothing ran or was lost
    run_text_table(spec, results_dir=tmp_path / "r", run_missing=False, **options)  # summarised
    # cells from before cells named their weights cannot show their student either
    path = next((tmp_path / "cells" / "text").glob("*.json"))
    path.write_text(json.dumps({k: v for k, v in cell.items() if k != "student_weights"}))
    with pytest.raises(ConfigError, match="weights not recorded"):
        run_text_table(spec, results_dir=tmp_path / "r", **options)


def test_the_weights_digest_names_values_not_settings() -> None:
    first, second = tiny_student(), tiny_student()
    assert weights_digest(first) == weights_digest(second)
    with torch.no_grad():
        next(second.parameters())[0] += 1e-6
    assert weights_digest(first) != weights_digest(second)


def test_the_hidden_lengths_table_is_kept_apart_and_refuses_full_finetuning(
    tmp_path, monkeypatch
) -> None:
    student, splits = tiny_student(), tiny_splits()
    _patched_table(monkeypatch, student, splits)
    spec = replace(
        load_table("text", seeds=[0], rounds=2),
        settings=(Setting("K=2 alpha=1", 2, "dirichlet", 1.0, 16, "stdlib"),),
    )
    with pytest.raises(ConfigError, match="run it with methods linear-probe and ours"):
        run_text_table(
            spec, student_dir=tmp_path, workdir=tmp_path / "cells", results_dir=tmp_path / "r",
            hide_text_lengths=True,
        )  # fmt: skip
    assert not (tmp_path / "cells").exists()  # refused before any cell
    spec = replace(spec, methods=("linear-probe", "ours"))
    lines: list[str] = []
    run_text_table(
        spec, student_dir=tmp_path, workdir=tmp_path / "cells", results_dir=tmp_path / "r",
        log=lines.append,
    )  # fmt: skip
    run_text_table(
        spec, student_dir=tmp_path, workdir=tmp_path / "cells", results_dir=tmp_path / "r",
        hide_text_lengths=True, log=lines.append,
    )  # fmt: skip
    assert not any("done before" in line for line in lines)  # the default cells do not count
    shown = json.loads((tmp_path / "r" / "text_adaptation.json").read_text())
    hidden = json.loads((tmp_path / "r" / "text_adaptation_hidden_lengths.json").read_text())
    assert hidden["hide_text_lengths"] and not shown["hide_text_lengths"]
    assert "hide their texts" not in shown["description"]
    assert "hides its texts' lengths" in hidden["description"]
    assert "full fine-tuning: not run in this table" in hidden["description"]
    assert all(cell["hide_text_lengths"] for cell in hidden["cells"])
    assert (tmp_path / "cells" / "text-hidden-lengths").is_dir()
    for method in ("ours", "linear-probe"):
        (one,) = [c for c in shown["cells"] if c["method"] == method]
        (other,) = [c for c in hidden["cells"] if c["method"] == method]
        # the same draws and initialisation on other block outputs: other losses
        assert one["train_loss_per_round"] != other["train_loss_per_round"]
        # the cost beside it, computed from both tables' cells
        key = text_adaptation.TEXT_METHODS[method]
        entry = hidden["lengths_shown_comparison"]["K=2 alpha=1"][key]
        assert entry["lengths_shown_mean"] == one["test_balanced_accuracy"]
        assert entry["lengths_hidden_mean"] == other["test_balanced_accuracy"]
        assert entry["cost_points"] == pytest.approx(
            100 * (one["test_balanced_accuracy"] - other["test_balanced_accuracy"])
        )
    table = (tmp_path / "r" / "text_adaptation_hidden_lengths.md").read_text()
    assert "with lengths shown (%)" in table and "cost (points)" in table
    # without the default table's cells the cost is named as not run, not invented
    shutil.rmtree(tmp_path / "cells" / "text")
    run_text_table(
        spec, student_dir=tmp_path, workdir=tmp_path / "cells", results_dir=tmp_path / "r",
        hide_text_lengths=True, log=lines.append,
    )  # fmt: skip
    alone = json.loads((tmp_path / "r" / "text_adaptation_hidden_lengths.json").read_text())
    assert alone["lengths_shown_comparison"] == {}
    assert "not run" in (tmp_path / "r" / "text_adaptation_hidden_lengths.md").read_text()


def test_table1_distills_in_and_out_of_distribution_and_writes_its_own_files() -> None:
    """Spec 001 Table 1 on text: D_aux in distribution (labelled, ``aux``) and out of it
    (other modules' docstrings, ``public``), centralized and K = 5; its own results files."""
    spec = load_table("text_table1")
    assert {s.distill_data for s in spec.settings} == {"aux", "public"}
    assert sorted(s.clients for s in spec.settings) == [1, 1, 5, 5]
    assert spec.methods == ("linear-probe", "ours")
    name = text_adaptation.results_name
    assert name(spec, protocol=False, hide_text_lengths=False) == "text_adaptation_table1"
    text = load_table("text")
    assert name(text, protocol=False, hide_text_lengths=False) == "text_adaptation"
    assert (
        name(text, protocol=True, hide_text_lengths=True)
        == "text_adaptation_protocol_hidden_lengths"
    )


def test_unknown_method_is_refused_before_any_cell(tmp_path) -> None:
    spec = replace(load_table("text"), methods=("ours", "prompt-tuning"))
    with pytest.raises(ConfigError, match="unknown method 'prompt-tuning'"):
        run_text_table(spec, student_dir=tmp_path, workdir=tmp_path, results_dir=tmp_path)
    assert not (tmp_path / "text").exists()


def test_the_command_filters_methods_and_rounds(monkeypatch, tmp_path) -> None:
    seen = []
    monkeypatch.setattr(
        text_adaptation, "run_text_table", lambda spec, **kw: seen.append((spec, kw))
    )
    assert main(["paper-text", "--methods", "ours", "linear-probe", "--rounds", "3",
                 "--seeds", "4", "--results-dir", str(tmp_path)]) == 0  # fmt: skip
    spec, options = seen[0]
    assert spec.methods == ("linear-probe", "ours") and spec.rounds == 3 and spec.seeds == (4,)
    assert [s.label for s in spec.settings] == [
        "K=5 alpha=100", "K=5 alpha=1", "K=5 alpha=0.1", "K=20 alpha=1"
    ]  # fmt: skip
    assert options["results_dir"] == tmp_path and options["run_missing"]
    assert main(["paper-text", "--kept-only"]) == 0
    assert not seen[1][1]["run_missing"] and not seen[1][1]["protocol"]
    assert main(["paper-text", "--protocol", "--settings", "K=5 alpha=1", "K=20 alpha=1"]) == 0
    spec, options = seen[2]
    assert [s.label for s in spec.settings] == ["K=5 alpha=1", "K=20 alpha=1"]
    assert options["protocol"]
    assert main(["paper-text", "--settings", "K=7"]) != 0  # named, nothing run
    assert len(seen) == 3
    assert main(["paper-text", "--hide-text-lengths"]) == 0
    spec, options = seen[3]
    assert options["hide_text_lengths"] and spec.methods == ("linear-probe", "ours")
    assert not seen[0][1]["hide_text_lengths"]


def test_a_kept_student_is_read_back_and_a_foreign_one_refused(tmp_path, monkeypatch) -> None:
    run = TextDistillRun()
    student = to_fhe_text(tiny_bert(), run.approx.build(), num_classes=3, pad_token_id=PAD)
    with torch.no_grad():
        student.classifier.weight.add_(1.0)  # differs from a fresh build
        for module in student.modules():
            if hasattr(module, "input_bound"):
                module.input_bound.fill_(7.0)  # calibrated buffers travel with the weights
    report = {"classes": ["a", "b", "c"], "student_accuracy": np.float64(0.5)}
    calls = []

    def fake_distillation(run, **_):
        calls.append(run)
        return report, student

    tokenizer = SimpleNamespace(pad_token_id=PAD)
    monkeypatch.setattr(text_distillation, "run_text_distillation", fake_distillation)
    # the kept file is read back by fedfm.models.student.read_text_student
    monkeypatch.setattr(fhe_text, "load_text_encoder", lambda _m: (tiny_bert(), tokenizer))
    kept_text_student(run, tmp_path, log=lambda _: None)
    assert kept_student_path(run, tmp_path).exists() and len(calls) == 1
    second, read = kept_text_student(run, tmp_path, log=lambda _: None)
    assert len(calls) == 1
    # the digest names the weights read back, which are the weights kept
    digest = weights_digest(student)
    assert read == {"classes": ["a", "b", "c"], "student_accuracy": 0.5, "weights_digest": digest}
    expected, loaded = student.state_dict(), second.state_dict()
    assert set(expected) == set(loaded)
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, equal_nan=True, msg=name)
    assert kept_student_path(replace(run, seed=1), tmp_path) != kept_student_path(run, tmp_path)
    saved = torch.load(kept_student_path(run, tmp_path), weights_only=True)
    saved["state"]["classifier.weight"] = torch.zeros(5, 16)  # five classes: not this model
    torch.save(saved, kept_student_path(run, tmp_path))
    with pytest.raises(ConfigError, match="does not hold this run's student"):
        kept_text_student(run, tmp_path, log=lambda _: None)
    kept_student_path(run, tmp_path).write_bytes(b"truncated")
    with pytest.raises(ConfigError, match="is not a kept text student"):
        kept_text_student(run, tmp_path, log=lambda _: None)
    assert len(calls) == 1  # a bad file is reported, never silently distilled over


def test_the_protocol_table_runs_ours_and_probing_through_the_protocol(
    tmp_path, monkeypatch
) -> None:
    """``--protocol``: ours and linear probing run the double-blind protocol (messages,
    permutations, secure aggregation) and learn; the protocol's own evaluation on the clients'
    shares of the test texts is the table's metric; the cells and results are kept apart from
    the plaintext table's."""
    student = to_fhe_text(
        tiny_bert(), ApproxConfig.exact(), num_classes=CLASSES, pad_token_id=PAD, max_tokens=12
    ).eval()
    pool, test = tiny_texts(96, 1), tiny_texts(40, 2)
    _patched_table(monkeypatch, student, TextSplits(("a", "b", "c"), 12, pool, pool, test, pool))
    spec = replace(
        load_table("text", seeds=[0], rounds=4),
        methods=("linear-probe", "ours"),
        settings=(Setting("K=2 iid", 2, "iid", 1.0, 16, "stdlib"),),
    )
    summary = run_text_table(
        spec,
        student_dir=tmp_path / "s",
        workdir=tmp_path / "cells",
        results_dir=tmp_path / "r",
        protocol=True,
        log=lambda _: None,
    )
    report = json.loads((tmp_path / "r" / "text_adaptation_protocol.json").read_text())
    assert (
        report["backend"].startswith("simulate")
        and not (tmp_path / "r" / "text_adaptation.json").exists()
    )
    cells = {cell["method"]: cell for cell in report["cells"]}
    assert cells["ours"]["reveal"] == "all" and cells["linear-probe"]["reveal"] == "last"
    for cell in cells.values():
        assert cell["runner"] == "protocol" and cell["secure_aggregation"] and not cell["failures"]
        losses = cell["train_loss_per_round"]
        assert losses[-1] < losses[0] and cell["clients_trained"] == [2] * 4
        assert 0.0 <= cell["test_balanced_accuracy"] <= 1.0
    probe = summary["K=2 iid"]["linear_probe"]["trainable_parameters"]
    assert probe == 16 * 2 + 16 * 3 + 3  # LayerNorm and head, as the plaintext path counts
    assert (tmp_path / "cells" / "text-protocol").is_dir()


def test_the_apps_task_is_the_split_the_adapted_students_were_distilled_beside() -> None:
    """`adaptation_task` (what the double-blind apps' data owners load) and `task_splits` of
    `student_run` (what the kept student was distilled beside) are the same texts."""
    from fedfm.data.text_task import adaptation_task
    from fedfm.models.fhe_text import load_text_encoder

    _, tokenizer = load_text_encoder("minilm")
    apps = adaptation_task(tokenizer)
    kept = text_distillation.task_splits(text_distillation.student_run(), tokenizer)
    for name in ("aux", "pool", "test", "public"):
        assert torch.equal(getattr(apps, name).input_ids, getattr(kept, name).input_ids)
        assert torch.equal(getattr(apps, name).labels, getattr(kept, name).labels)


def test_distill_text_keep_student_only_keeps_the_adapted_student(monkeypatch, tmp_path) -> None:
    calls = []
    monkeypatch.setattr(
        text_distillation,
        "kept_text_student",
        lambda run, folder, **kw: calls.append((run, folder)) or (None, {}),
    )
    assert main(["distill-text", "--keep-student", str(tmp_path), "--model", "m"]) == 0
    run, folder = calls[0]
    assert folder == tmp_path and run == text_distillation.student_run("m")
    assert not (tmp_path / "text_distillation.json").exists()


def test_full_finetuning_clips_each_steps_gradient_to_the_norm_it_is_given() -> None:
    student, splits = tiny_student(), tiny_splits()
    parts = [np.arange(0, 48), np.arange(48, 96)]
    config = replace(DoubleBlindConfig(), rounds=3, batch_size=16, batches_per_round=2)
    common = {"seed": 0, "lr": 0.1, "log": lambda _line: None}
    free = finetune_text(student, splits.pool, splits.test, parts, config, **common)
    held = finetune_text(
        student, splits.pool, splits.test, parts, config, max_grad_norm=1e-9, **common
    )
    assert free["clipped_steps"] == 0 and held["clipped_steps"] == held["steps"] == 12
    # the norms are recorded before clipping: the held run's are the untrained model's
    assert held["gradient_norm"]["median"] > 1e-3 and free["gradient_norm"]["max"] > 1e-3
    assert held["gradient_norm"]["not_finite_steps"] == 0
    # steps of norm <= lr * 1e-9 leave the fresh model's predictions as they were; the same
    # texts (one seed) are fitted where the steps are free
    assert len(set(held["test_balanced_accuracy_per_round"])) == 1
    assert free["train_loss_per_round"][-1] < held["train_loss_per_round"][-1] - 0.05
    with pytest.raises(ConfigError, match="max_grad_norm must be > 0"):
        finetune_text(student, splits.pool, splits.test, parts, config, max_grad_norm=0, **common)


def test_a_buffer_left_nan_by_design_is_not_taken_for_divergence() -> None:
    """The tiny student's approximations are not calibrated (NaN input bounds): its weights,
    not its buffers, say whether full fine-tuning diverged."""
    student, splits = tiny_student(), tiny_splits()
    assert not all(torch.isfinite(value).all() for value in student.state_dict().values())
    config = replace(DoubleBlindConfig(), rounds=2, batch_size=16, batches_per_round=1)
    record = finetune_text(
        student, splits.pool, splits.test, [np.arange(96)], config, seed=0, lr=0.1,
        log=lambda _line: None,
    )  # fmt: skip
    assert "diverged_at_round" not in record and None not in record["train_loss_per_round"]
