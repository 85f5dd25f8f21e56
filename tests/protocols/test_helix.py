"""HELIX: encrypted alignment and inference equal the plaintext maths; keys, views, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import Ridge

from fedfm.cli import main as cli_main
from fedfm.crypto.params import CKKS_8192, CkksParameters
from fedfm.data.stdlib_text import Docstring, build_splits, stdlib_docstrings
from fedfm.errors import ConfigError, CryptoParameterError, DataError, ModelError, ProtocolError
from fedfm.experiments.helix_evaluation import (
    PartyView,
    energy,
    evaluate_pair,
    membership_inference,
    ood_auroc,
)
from fedfm.models.text_encoders import LsaEncoder, build_encoder
from fedfm.protocols.helix import PROVIDER, client_role, fit_alignment, helix, open_report
from fedfm.protocols.helix.ckks import ClientKeys, ProviderEvaluator
from fedfm.protocols.helix.packing import FeatureMajor, ReplicatedRows, RowBlocks, inference_layout
from fedfm.protocols.helix.protocol import DEFAULTS
from fedfm.protocols.helix.ridge import AlignmentStatistics, fit_from_statistics
from fedfm.runtime import Protocol, RoleContext, Step, run_in_process
from fedfm.runtime.settings import RUN_CONFIG_DEFAULTS

pytestmark = pytest.mark.ckks  # HELIX runs under CKKS (TenSEAL); a few plaintext checks ride along

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "simulations" / "helix"
CLIENT = client_role(0)
TOLERANCE = 1e-3  # relative; CKKS at scale 2^40 gives about 1e-8 here
RIDGE = 0.1


def relative_error(found: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(found - expected).max() / np.abs(expected).max())


def parties(
    *,
    samples: int = 48,
    provider_dims: int = 12,
    client_dims: tuple[int, ...] = (8,),
    seed: int = 0,
) -> dict[str, dict[str, np.ndarray]]:
    """Correlated random embeddings, a head, queries and a report key per client."""
    rng = np.random.default_rng(seed)
    public = rng.normal(size=(samples, provider_dims))
    inputs = {
        PROVIDER: {
            "public": public,
            "head_weight": rng.normal(size=(provider_dims, 5)),
            "head_bias": rng.normal(size=5),
        }
    }
    for index, dims in enumerate(client_dims):
        mixing = rng.normal(size=(provider_dims, dims))
        inputs[client_role(index)] = {
            "public": public @ mixing + 0.1 * rng.normal(size=(samples, dims)),
            "queries": rng.normal(size=(3, dims)),
            "report_key": np.frombuffer(os.urandom(32), dtype=np.uint8),
        }
    return inputs


def report(result, inputs, role: str = CLIENT) -> dict[str, np.ndarray]:
    key = inputs[role]["report_key"].tobytes()
    return open_report(key, result.outputs[role]["report"], role)


def expected_logits(inputs, role: str = CLIENT) -> tuple[np.ndarray, object]:
    provider, client = inputs[PROVIDER], inputs[role]
    mapping = fit_alignment(client["public"], provider["public"], RIDGE)
    logits = mapping.apply(client["queries"]) @ provider["head_weight"] + provider["head_bias"]
    return logits, mapping


# -- the maths ----------------------------------------------------------------------------------


def test_alignment_minimises_the_ridge_objective_with_an_unpenalised_bias() -> None:
    inputs = parties(samples=64)
    client, provider = inputs[CLIENT]["public"], inputs[PROVIDER]["public"]
    mapping = fit_alignment(client, provider, 0.5)
    reference = Ridge(alpha=0.5, fit_intercept=True).fit(client, provider)
    np.testing.assert_allclose(mapping.weight, reference.coef_.T, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mapping.bias, reference.intercept_, rtol=1e-9, atol=1e-12)


def test_row_blocks_fold_to_the_cross_covariance_in_plaintext() -> None:
    """The provider's circuit on slot vectors (numpy rotations): exactly Z_A^T Z_B and zeros."""
    rng = np.random.default_rng(1)
    provider, client = rng.normal(size=(37, 11)), rng.normal(size=(37, 6))
    layout = RowBlocks(6, 64)  # blocks of 8: 8 samples per ciphertext, 2 groups
    uploads = layout.pack(client)
    outputs = []
    for g in range(layout.groups(11)):
        folded = np.zeros(64)
        for u in reversed(range(layout.per_ciphertext)):
            total = sum(
                upload * layout.provider_plaintexts(provider, t)[g, u]
                for t, upload in enumerate(uploads)
            )
            folded = total + np.roll(folded, -layout.block)  # SEAL's positive step: left
        outputs.append(folded)
    outputs = np.asarray(outputs)
    np.testing.assert_allclose(layout.unpack(outputs, 11), provider.T @ client, atol=1e-12)
    assert np.count_nonzero(outputs) <= provider.shape[1] * client.shape[1]


def test_auto_packing_takes_rows_for_few_queries_and_features_for_batches() -> None:
    assert isinstance(inference_layout("auto", 1, 384, 4096), ReplicatedRows)
    assert isinstance(inference_layout("auto", 256, 384, 4096), FeatureMajor)
    rows = ReplicatedRows(384, 4096)
    assert (rows.block, rows.copies, rows.rotation_steps()[:3]) == (512, 8, [8, 16, 32])
    with pytest.raises(ConfigError, match="do not fit"):
        RowBlocks(5000, 4096).pack(np.zeros((1, 5000)))


# -- the protocol: encrypted equals plaintext -------------------------------------------------


def test_encrypted_alignment_and_logits_equal_plaintext_for_two_clients() -> None:
    inputs = parties(client_dims=(8, 5))
    result = run_in_process(helix({"clients": 2, "ridge": RIDGE}), inputs)
    for role in (client_role(0), client_role(1)):
        found = report(result, inputs, role)
        logits, mapping = expected_logits(inputs, role)
        assert relative_error(found["alignment_weight"], mapping.weight) < TOLERANCE
        assert relative_error(found["alignment_bias"], mapping.bias) < TOLERANCE
        assert relative_error(found["logits"], logits) < TOLERANCE
    pairs = result.traffic.to_dict()["pairs"]
    assert set(pairs) == {f"{a}->{b}" for c in ("client_0", "client_1") for a, b in
                          ((c, PROVIDER), (PROVIDER, c))}  # fmt: skip
    assert all(pair["messages"] == 2 for pair in pairs.values())


@pytest.mark.parametrize(
    ("packing", "alignment"),
    [("features", "client"), ("rows", "client"), ("features", "provider"), ("rows", "provider")],
)
def test_inference_alone_equals_plaintext_logits(packing: str, alignment: str) -> None:
    inputs = parties()
    logits, mapping = expected_logits(inputs)
    client = inputs[CLIENT]
    client |= {"alignment_weight": mapping.weight, "alignment_bias": mapping.bias}
    client["allow_provider_alignment"] = np.asarray(alignment == "provider")
    config = {"mode": "infer", "packing": packing, "alignment": alignment}
    result = run_in_process(helix(config), inputs)
    assert relative_error(report(result, inputs)["logits"], logits) < TOLERANCE
    assert [step.name for step in helix(config).steps] == ["query", "classify", "reveal"]


def test_align_mode_publishes_only_the_sealed_map() -> None:
    inputs = parties()
    protocol = helix({"mode": "align"})
    assert [step.name for step in protocol.steps] == ["upload", "cross_covariance", "solve"]
    result = run_in_process(protocol, inputs)
    assert set(result.outputs) == {CLIENT} and set(result.outputs[CLIENT]) == {"report"}
    found = report(result, inputs)
    assert set(found) == {"alignment_weight", "alignment_bias"}
    assert relative_error(found["alignment_weight"], expected_logits(inputs)[1].weight) < TOLERANCE
    with pytest.raises(ProtocolError):
        open_report(os.urandom(32), result.outputs[CLIENT]["report"], CLIENT)


# -- keys and what each party sees ----------------------------------------------------------


def test_the_provider_never_holds_a_secret_key() -> None:
    keys = ClientKeys.generate()
    evaluator = ProviderEvaluator(keys.public_context([8]), CKKS_8192)
    assert not evaluator.context.is_private()
    assert evaluator.context.has_galois_keys()
    with pytest.raises(CryptoParameterError, match="secret key"):
        ProviderEvaluator(keys.secret_state(), CKKS_8192)


def windows(data: bytes, width: int = 32) -> set[bytes]:
    return {data[i : i + width] for i in range(0, max(1, len(data) - width + 1), 8)}


def spying(protocol: Protocol, seen: dict[str, list[dict[str, np.ndarray]]]) -> Protocol:
    """``protocol`` with every role's delivered messages recorded (what that party sees)."""

    def record(step: Step):
        def action(context: RoleContext) -> None:
            seen.setdefault(context.role, []).extend(m.arrays for m in context.inbox)
            step.action(context)

        return replace(step, action=action)

    return replace(protocol, steps=tuple(record(step) for step in protocol.steps))


def test_the_provider_sees_only_ciphertexts_and_the_client_never_v_or_c() -> None:
    inputs = parties()
    seen: dict[str, list[dict[str, np.ndarray]]] = {}
    result = run_in_process(spying(helix(), seen), inputs)
    logits, mapping = expected_logits(inputs)
    client, provider = inputs[CLIENT], inputs[PROVIDER]

    to_provider = b"".join(a.tobytes() for m in seen[PROVIDER] for a in m.values())
    assert {name.split(".")[0] for m in seen[PROVIDER] for name in m} == {
        "context", "shape", "rows", "layout", "queries"
    }  # fmt: skip
    for secret in (client["public"], client["queries"], mapping.apply(client["queries"])):
        assert not windows(secret.tobytes()) & windows(to_provider, 32)
    to_client = b"".join(a.tobytes() for m in seen[CLIENT] for a in m.values())
    assert {name.split(".")[0] for m in seen[CLIENT] for name in m} == {
        "cross", "provider_sum", "logits", "classes"
    }  # fmt: skip
    for secret in (provider["head_weight"], provider["head_bias"], provider["public"], logits):
        data = secret.tobytes()
        assert data[:32] not in to_client and not windows(data) & windows(to_client, 32)
    # the relay: only what roles published, sealed
    assert set(result.outputs) == {CLIENT}
    sealed = result.outputs[CLIENT]["report"].tobytes()
    assert logits.tobytes()[:32] not in sealed and mapping.weight.tobytes()[:32] not in sealed


# -- bad input ------------------------------------------------------------------------------


def test_a_ciphertext_under_another_key_is_refused() -> None:
    ours, theirs = ClientKeys.generate(), ClientKeys.generate()
    evaluator = ProviderEvaluator(ours.public_context([]), CKKS_8192)
    foreign = theirs.encrypt(np.ones((1, theirs.slots)))
    with pytest.raises(CryptoParameterError, match="another data owner's key"):
        evaluator.load(foreign, 1)
    with pytest.raises(CryptoParameterError, match="another data owner's key"):
        ours.decrypt(foreign)
    assert evaluator.load(ours.encrypt(np.ones((1, ours.slots))), 1)


def test_the_parties_dimensions_and_sample_counts_must_match() -> None:
    inputs = parties()
    inputs[CLIENT]["public"] = inputs[CLIENT]["public"][:-1]
    with pytest.raises(
        ProtocolError, match="encrypted 47 public samples; the provider embedded 48"
    ):
        run_in_process(helix({"mode": "align"}), inputs)

    inputs = parties()
    _, mapping = expected_logits(inputs)
    inputs[CLIENT] |= {
        "alignment_weight": mapping.weight[:, :-1],
        "alignment_bias": mapping.bias[:-1],
    }
    with pytest.raises(
        ProtocolError, match="sent 11-dimensional aligned queries; the provider's head takes 12"
    ):
        run_in_process(helix({"mode": "infer"}), inputs)


def test_too_few_public_samples_are_refused() -> None:
    inputs = parties(samples=9, client_dims=(8,))  # needs 8 + 2
    with pytest.raises(ProtocolError, match="needs at least 10 public samples, got 9"):
        run_in_process(helix({"mode": "align"}), inputs)


@pytest.mark.parametrize("ridge", [0, -1.0, float("nan")])
def test_the_ridge_coefficient_must_be_positive(ridge: float) -> None:
    with pytest.raises(ConfigError, match="lambda must be > 0"):
        helix({"ridge": ridge})
    inputs = parties()
    with pytest.raises(ConfigError, match="lambda must be > 0"):
        fit_alignment(inputs[CLIENT]["public"], inputs[PROVIDER]["public"], ridge)


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown helix run config keys"):
        helix({"rigde": 1.0})
    with pytest.raises(ConfigError, match="mode must be one of"):
        helix({"mode": "train"})
    with pytest.raises(ConfigError, match="clients must be a positive integer"):
        helix({"clients": 0})
    assert helix().digest() != helix({"ridge": 0.2}).digest()


def test_insecure_parameters_need_the_unsafe_switch() -> None:
    insecure = CkksParameters(8192, (60, 60, 60, 60), 40)  # 240 bits > 218
    with pytest.raises(CryptoParameterError, match="below 128-bit security"):
        helix(ckks=insecure)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        helix(ckks=insecure, allow_insecure=True)
    assert any("INSECURE" in str(w.message) for w in caught)
    with pytest.warns(UserWarning), pytest.raises(CryptoParameterError, match="SEAL refused"):
        ClientKeys.generate(insecure, allow_insecure=True)  # TenSEAL's SEAL has its own check


def test_provider_alignment_needs_the_clients_consent() -> None:
    inputs = parties()
    _, mapping = expected_logits(inputs)
    inputs[CLIENT] |= {"alignment_weight": mapping.weight, "alignment_bias": mapping.bias}
    with pytest.raises(ProtocolError, match="refuses alignment='provider'"):
        run_in_process(helix({"mode": "infer", "alignment": "provider"}), inputs)


def test_statistics_of_mismatched_parties_are_refused() -> None:
    with pytest.raises(ProtocolError, match="expected \\(4, 3\\)"):
        AlignmentStatistics.from_client(np.ones((5, 3)), np.ones((4, 2)), np.ones(4))
    stats = AlignmentStatistics.from_client(np.ones((1, 3)), np.ones((4, 3)), np.ones(4))
    with pytest.raises(ConfigError, match="at least 2 public samples"):
        fit_from_statistics(stats, 1.0)


# -- data, encoders, metrics ----------------------------------------------------------------


def fake_docstrings() -> list[Docstring]:
    modules = [
        "os",
        "http",
        "asyncio",
        "fractions",
        "csv",
        "unittest",
        "heapq",
        "tkinter",
        "logging",
    ]
    return [
        Docstring(module, f"f{i}", f"{module} docstring number {i} about {module} things")
        for module in modules
        for i in range(12)
    ]


def test_splits_are_disjoint_labelled_by_family_and_seeded() -> None:
    kwargs = {"public_size": 10, "train_per_class": 5, "queries_per_class": 4, "ood_size": 6}

    def draw(seed: int) -> tuple[list[str], ...]:
        data = build_splits(seed=seed, docstrings=fake_docstrings(), **kwargs)
        return data.public, data.train.texts, data.queries.texts, data.ood

    assert draw(3) == draw(3) and draw(3) != draw(4)
    data = build_splits(seed=3, docstrings=fake_docstrings(), **kwargs)
    assert len(data.classes) == 7 and np.bincount(data.train.labels).tolist() == [5] * 7
    groups = [set(data.public), set(data.train.texts), set(data.queries.texts), set(data.ood)]
    assert sum(map(len, groups)) == len(set().union(*groups))
    assert all("logging" in t for t in data.public) and all("tkinter" in t for t in data.ood)
    family_modules = ["os", "http", "asyncio", "fractions", "csv", "unittest", "heapq"]
    for text, label in zip(data.queries.texts, data.queries.labels, strict=True):
        assert text.split()[0] == family_modules[label]
    with pytest.raises(DataError, match="family files has 12 docstrings, 20 requested"):
        build_splits(docstrings=fake_docstrings(), train_per_class=15, queries_per_class=5)


def test_docstrings_come_from_sources_without_importing_them(tmp_path) -> None:
    (tmp_path / "os.py").write_text('"""Operating system interfaces for the whole module."""\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        'raise SystemExit\ndef f():\n    """Return the answer to the question  asked\n here."""\n'
    )
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text('"""Tests are left out of every split here."""\n')
    found = stdlib_docstrings(tmp_path)
    assert [(d.module, d.name, d.text) for d in found] == [
        ("os", "<module>", "Operating system interfaces for the whole module."),
        ("pkg", "f", "Return the answer to the question asked here."),
    ]


def test_encoders_lsa_minilm_and_missing_models() -> None:
    corpus = [f"word{i % 7} text{i % 5} thing{i % 3} common" for i in range(40)]
    lsa = LsaEncoder(4)
    with pytest.raises(ModelError, match="must be fitted"):
        lsa.encode(corpus)
    lsa.fit(corpus)
    values = lsa.encode(corpus[:3])
    assert values.shape == (3, 4)
    np.testing.assert_allclose(np.linalg.norm(values, axis=1), 1.0)
    with pytest.raises(ModelError, match="does not download"):
        build_encoder("hf:/nonexistent/encoder-folder")
    with pytest.raises(ConfigError, match="unknown encoder"):
        build_encoder("word2vec")
    minilm = build_encoder("minilm")
    embedded = minilm.encode(["Return the list of files in a folder.", "Open a socket."])
    assert embedded.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(embedded, axis=1), 1.0, rtol=1e-6)


def test_energy_auroc_and_table_metrics_on_separable_data() -> None:
    confident, flat = np.array([[9.0, 0.0], [0.0, 9.0]]), np.zeros((2, 2))
    assert energy(confident)[0] < energy(flat)[0]
    assert ood_auroc(confident, flat) == 1.0
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 6)) * 4
    labels = np.repeat(np.arange(3), 50)  # FEW_SHOT draws up to 128

    def view(mixing: np.ndarray) -> PartyView:
        def points(n_labels, noise=0.3):
            return (centres[n_labels] + noise * rng.normal(size=(len(n_labels), 6))) @ mixing

        return PartyView(
            points(rng.integers(0, 3, 150)),
            points(labels),
            points(labels),
            3 * rng.normal(size=(30, mixing.shape[1])),
        )

    state = rng.bit_generator.state
    provider = view(np.eye(6))
    rng.bit_generator.state = state  # the same texts through the client's encoder
    client = view(rng.normal(size=(6, 5)))
    data = build_splits(docstrings=fake_docstrings(), public_size=4, train_per_class=1,
                        queries_per_class=1, ood_size=2)  # fmt: skip
    data = replace(
        data,
        train=replace(data.train, labels=labels),
        queries=replace(data.queries, labels=labels),
    )
    row = evaluate_pair(provider, client, data, ridge=RIDGE, seeds=[0, 1])
    assert row["baseline_accuracy"] > 0.95 and row["linmap_accuracy"] > 0.95
    assert row["public_id128_accuracy"] > 0.9
    mia = membership_inference(client, provider, ridge=RIDGE, shadows=20, shared=16, seed=0)
    assert 0.0 <= mia["mia_accuracy"] <= 1.0 and mia["mia_bound"] > 0


# -- Flower ---------------------------------------------------------------------------------


def test_app_declares_the_components_and_every_default() -> None:
    flwr = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]
    assert flwr["app"]["components"] == {
        "serverapp": "fedfm_strategies.helix:app",
        "clientapp": "fedfm_clients.helix:app",
    }
    assert flwr["app"]["config"] == {**RUN_CONFIG_DEFAULTS, "timeout": 600.0, **DEFAULTS}


@pytest.mark.slow
def test_flwr_run_simulation_aligns_and_classifies_two_clients(tmp_path) -> None:
    workspace = tmp_path / "workspace"
    command = [sys.executable, str(APP / "run.py"), "--synthetic", "--workspace", str(workspace)]
    command += ["--clients", "2", "--public-size", "40", "--queries", "3"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "flwr run: finished:completed; SuperLink stopped" in output
    assert output.count("logits match the plaintext computation") == 2
    result = json.loads((workspace / "result.json").read_text())
    assert set(result["outputs"]) == {"client_0", "client_1"}
    assert result["traffic"]["round_trips"] == 6  # hello and five steps


@pytest.mark.slow
def test_helix_commands_write_json_and_markdown(tmp_path, capsys) -> None:
    small = ["--public-size", "64", "--train-per-class", "20", "--queries-per-class", "4"]
    small += ["--ood-size", "8", "--results-dir", str(tmp_path), "--cache-dir", str(tmp_path)]
    bench = ["bench-helix", "--provider", "lsa:16", "--client", "lsa:8", "--batch-size", "32"]
    assert cli_main([*bench, "--repeats", "1", *small]) == 0
    payload = json.loads((tmp_path / "helix_bench.json").read_text())
    assert payload["command"].startswith("fedfm bench-helix --provider lsa:16")
    assert {row["path"] for row in payload["rows"]} == {"encrypted", "plaintext"}
    assert all(row["logits_max_relative_error"] < TOLERANCE for row in payload["rows"])
    assert payload["ms_per_query_batched"] < payload["ms_per_query_single"]
    assert payload["bytes_per_query_batched"] > payload["plaintext_bytes_per_query_batched"]
    assert payload["alignment"]["weight_max_relative_error"] < TOLERANCE
    assert "Regenerate: `fedfm bench-helix" in (tmp_path / "helix_bench.md").read_text()

    evaluate = ["helix-eval", "--pairs", "lsa:16,lsa:8", "--repeats", "1", "--shadows", "10"]
    assert cli_main([*evaluate, *small]) == 0
    (row,) = json.loads((tmp_path / "helix_eval.json").read_text())["rows"]
    assert (row["d_A"], row["d_B"]) == (16, 8)
    assert 0 <= row["public_id128_accuracy"] <= 1 and 0 <= row["linmap_auroc"] <= 1
    assert "regenerate with: fedfm helix-eval" in capsys.readouterr().out
    assert cli_main(["helix-eval", "--pairs", "minilm", *small]) == 2
