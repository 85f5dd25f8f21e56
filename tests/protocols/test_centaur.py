"""CENTAUR (spec 004): the ring arithmetic, Θ', the protocol on the runtime against plaintext,
what the cloud sees, the baseline, and bad input.

Models: a small random BERT sequence classifier built from a ``BertConfig`` (no download; the
packaged MiniLM runs in the slow test and the benchmark) and the ``llama_fedfm_micro`` decoder
trained for a few steps, as FedRAG's tests do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedfm.data.stdlib_text import stdlib_root
from fedfm.errors import ConfigError, ProtocolError
from fedfm.models.decoder import DecoderSource, DecoderTraining, load_decoder, train_decoder
from fedfm.protocols.centaur import centaur, open_report
from fedfm.protocols.centaur.engine import check_tags, tags
from fedfm.protocols.centaur.local import run_locally
from fedfm.protocols.centaur.model import (
    Architecture,
    Permutations,
    Trace,
    extract,
    forward,
    permute_weights,
)
from fedfm.protocols.centaur.programs import Calibration
from fedfm.protocols.centaur.provisioning import Deployment, calibrate, prepare
from fedfm.protocols.sharing import (
    beaver_close,
    beaver_open,
    decode,
    encode,
    ring_matmul,
    share,
    truncate,
    truncation_failure_bound,
)
from fedfm.runtime import InProcessFederation

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MICRO_TRAINING = DecoderTraining(
    steps=12, batch_size=8, lr=1e-2, warmup_steps=2, eval_every=6, checkpoint_every=6
)


def tiny_bert(seed: int = 0) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)  # a public test model: its weights are no secret
    config = BertConfig(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        initializer_range=0.2,
    )
    return BertForSequenceClassification(config).eval()


@pytest.fixture(scope="module")
def bert() -> tuple[Architecture, dict[str, np.ndarray], Any]:
    model = tiny_bert()
    architecture, weights = extract(model)
    return architecture, weights, model


@pytest.fixture(scope="module")
def llama(
    tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None
) -> tuple[Architecture, dict[str, np.ndarray], Any]:
    source = DecoderSource(
        name="llama_fedfm_micro",
        cache_dir=tmp_path_factory.mktemp("centaur-decoder"),
        training=MICRO_TRAINING,
        text_root=stdlib_root() / "importlib",
    )
    train_decoder(source, progress=False, log=lambda _: None)
    model, _ = load_decoder(source)
    architecture, weights = extract(model)
    return architecture, weights, model


def token_ids(vocab: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, length)


def deployment(model: tuple[Architecture, dict[str, np.ndarray], Any], mode: str) -> Deployment:
    architecture, weights, _ = model
    sequences = [token_ids(architecture.vocab, 12, seed) for seed in range(3)]
    return prepare(
        architecture, weights, mode=mode, calibration=calibrate(architecture, weights, sequences)
    )


def role_inputs(plan: Deployment, ids: np.ndarray, key: bytes) -> dict[str, dict[str, np.ndarray]]:
    return {
        "developer": plan.developer.arrays(),
        "cloud": plan.cloud.arrays(),
        "client": {"tokens": ids, "report_key": np.frombuffer(key, np.uint8)},
    }


def run_runtime(plan: Deployment, ids: np.ndarray, **config: Any) -> dict[str, np.ndarray]:
    key = bytes(range(32))
    federation = InProcessFederation(
        centaur(plan.run_config(**config)), role_inputs(plan, ids, key)
    )
    result = federation.run()
    return open_report(key, result.outputs["client"]["report"])


def plaintext_generate(
    model: tuple[Architecture, dict[str, np.ndarray], Any], ids: np.ndarray, tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    architecture, weights, _ = model
    sequence, logits = list(ids), []
    for _ in range(tokens):
        last = forward(architecture, weights, np.asarray(sequence))[-1]
        logits.append(last)
        sequence.append(int(np.argmax(last)))
    return np.asarray(sequence[len(ids) :]), np.asarray(logits)


# -- the ring --------------------------------------------------------------------------------


def test_encoding_refuses_what_the_ring_cannot_hold() -> None:
    """A value past 2^(62 - f) or not finite is refused by name (numpy would cast it to an
    arbitrary word); just inside the limit it round-trips."""
    inside = np.array([-(2.0**45), 2.0**45 - 1.0, 0.5])
    assert np.array_equal(decode(encode(inside)), inside)
    for bad in (2.0**46, -(2.0**46), np.inf, np.nan):
        with pytest.raises(ProtocolError, match="a score is not finite or too large for the ring"):
            encode(np.array([1.0, bad]), 16, "a score")


def test_fixed_point_product_and_local_truncation_are_within_one_unit() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(0, 4, (64, 32)), rng.normal(0, 1, (32, 16))
    x0, x1 = share(encode(x))
    y0, y1 = share(encode(y))
    a0, a1 = share(encode(rng.normal(0, 1, x.shape)))  # any a, b: a dealer's uniform values
    b0, b1 = share(encode(rng.normal(0, 1, y.shape)))
    c0, c1 = share(ring_matmul(a0 + a1, b0 + b1))
    e0, f0 = beaver_open(x0, y0, a0, b0)
    e1, f1 = beaver_open(x1, y1, a1, b1)
    e, f = e0 + e1, f0 + f1
    z0 = truncate(beaver_close(0, e, f, a0, b0, c0), 0)
    z1 = truncate(beaver_close(1, e, f, a1, b1, c1), 1)
    exact = encode(x).view(np.int64).astype(object).dot(encode(y).view(np.int64).astype(object))
    got = decode(z0 + z1)
    # rounding of the inputs (2^-17 each) plus the truncation's one unit (2^-16)
    assert np.abs(got - x @ y).max() < 32 * 2.0**-16 * 5
    assert (
        np.abs(got * 2**16 - np.vectorize(lambda v: v // 2**16)(exact).astype(np.float64)).max()
        <= 1
    )
    assert truncation_failure_bound(100.0) == pytest.approx(2 * 100 * 2.0**32 / 2.0**64)


def test_local_truncation_wraps_with_about_the_stated_probability() -> None:
    """Shares of a huge value wrap often: the bound predicts the failure rate."""
    value = 2.0**25  # real size; with 2 f = 32 bits the product is 2^57
    x = np.full(20000, np.int64(value * 2**32)).view(np.uint64)  # a product at 2 f = 32 bits
    x0, x1 = share(x)
    result = decode(truncate(x0, 0, 16) + truncate(x1, 1, 16))
    failures = float(np.mean(np.abs(result - value) > 1.0))
    bound = truncation_failure_bound(value)
    assert 0.3 * bound < failures < 3 * bound


# -- models and Θ' -----------------------------------------------------------------------------


def test_layer_loop_equals_transformers(bert: Any, llama: Any) -> None:
    for architecture, weights, model in (bert, llama):
        ids = token_ids(architecture.vocab, 10, 1)
        with torch.no_grad():
            reference = model(torch.as_tensor(ids)[None]).logits[0].double().numpy()
        ours = forward(architecture, weights, ids)
        assert np.abs(ours - reference).max() < 1e-4


def test_permuted_weights_give_permuted_hidden_states(bert: Any) -> None:
    architecture, weights, _ = bert
    perms = Permutations.draw(architecture, fresh_ffn=True)
    permuted = permute_weights(architecture, weights, perms)
    ids = token_ids(architecture.vocab, 9, 2)
    plain, seen = Trace(), Trace()
    logits = forward(architecture, weights, ids, trace=plain)
    permuted_logits = forward(architecture, permuted, ids, trace=seen)
    assert np.allclose(logits, permuted_logits)
    p = perms.hidden
    assert np.allclose(seen.values["l1.ln1.input"], plain.values["l1.ln1.input"][:, p])
    assert np.allclose(seen.values["l0.up"], plain.values["l0.up"][:, perms.ffn[0]])
    assert not np.allclose(seen.values["l0.up"], plain.values["l0.up"])


# -- the protocol against plaintext --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["faithful", "hardened"])
def test_bert_logits_match_plaintext_on_the_runtime(bert: Any, mode: str) -> None:
    architecture, weights, _ = bert
    plan = deployment(bert, mode)
    for seed in range(2):
        ids = token_ids(architecture.vocab, 12, 10 + seed)
        report = run_runtime(plan, ids)
        expected = forward(architecture, weights, ids)
        assert np.abs(report["logits"][0] - expected).max() < 1e-2
        assert int(np.argmax(report["logits"][0])) == int(np.argmax(expected))


@pytest.mark.parametrize("mode", ["faithful", "hardened"])
def test_llama_greedy_tokens_are_identical_to_plaintext(llama: Any, mode: str) -> None:
    architecture, _, _ = llama
    ids = token_ids(architecture.vocab, 8, 3)
    report = run_runtime(deployment(llama, mode), ids, **{"max-new-tokens": 3})
    tokens, logits = plaintext_generate(llama, ids, 3)
    assert np.array_equal(report["tokens"], tokens)
    assert np.abs(report["logits"] - logits).max() < 1e-2


def test_local_executor_equals_the_runtime(bert: Any) -> None:
    architecture, _, _ = bert
    plan = deployment(bert, "faithful")
    ids = token_ids(architecture.vocab, 7, 5)
    runtime = run_runtime(plan, ids)["logits"]
    local = run_locally(plan.run_config(), role_inputs(plan, ids, bytes(32))).client["logits"]
    assert np.abs(runtime - local).max() < 1e-3


def test_full_secret_sharing_baseline_approximates_plaintext(bert: Any, llama: Any) -> None:
    for model in (bert, llama):
        architecture, weights, _ = model
        plan = deployment(model, "full-sharing")
        ids = token_ids(architecture.vocab, 8, 6)
        config = plan.run_config(**({"max-new-tokens": 1} if architecture.kind == "llama" else {}))
        got = run_locally(config, role_inputs(plan, ids, bytes(32))).client["logits"][0]
        expected = forward(architecture, weights, ids)
        expected = expected[-1] if architecture.kind == "llama" else expected
        assert np.corrcoef(got, expected)[0, 1] > 0.95


@pytest.mark.parametrize(
    ("stress", "names", "factor"),
    [
        # one head's scores spread wider than the mean-shifted exp's window (MiniLM's layer 0)
        ("score_spread", ("l0.q.w", "l0.q.b"), 8.0),
        # one norm's input 900 times the variance of the others (a Llama's layer 0 MLP norm)
        ("norm_scale", ("l1.down.w", "l1.down.b"), 30.0),
        # activations over [-26, 26] (MiniLM's layer 0 FFN)
        ("activation_bound", ("l0.up.w", "l0.up.b"), 8.0),
    ],
)
def test_full_secret_sharing_baseline_stays_in_its_domains_on_wide_models(
    bert: Any, stress: str, names: tuple[str, ...], factor: float
) -> None:
    """The tiny BERT with one layer scaled as trained encoders are: before the per-norm
    calibration, the sharpened softmax and the rectified GeLU, the first two wrapped the ring
    (logits off by 1e9) and the third erred by 0.24."""
    from fedfm.protocols.centaur.programs import EXP_CEILING, MAX_MARGIN

    architecture, weights, _ = bert
    scaled = dict(weights) | {name: weights[name] * factor for name in names}
    plan = deployment((architecture, scaled, None), "full-sharing")
    calibration = plan.developer.calibration
    variances = calibration.norm_variances.values()
    # the stress is real: outside what one public margin / one norm constant / a polynomial
    # of the whole GeLU covers
    assert {
        "score_spread": calibration.score_spread > EXP_CEILING + MAX_MARGIN,
        "norm_scale": max(variances) / min(variances) > 300,
        "activation_bound": calibration.activation_bound > 20,
    }[stress]
    ids = token_ids(architecture.vocab, 8, 6)
    got = run_locally(plan.run_config(), role_inputs(plan, ids, bytes(32))).client["logits"][0]
    expected = forward(architecture, scaled, ids)
    assert np.abs(got - expected).max() < 0.12


# -- what the cloud sees --------------------------------------------------------------------------


def test_the_cloud_sees_only_permuted_plaintext_and_hardened_hides_the_embedding(bert: Any) -> None:
    architecture, weights, _ = bert
    ids = token_ids(architecture.vocab, 10, 7)
    plain = Trace()
    forward(architecture, weights, ids, trace=plain)
    for mode in ("faithful", "hardened"):
        plan = deployment(bert, mode)
        assert plan.permutations is not None
        p = plan.permutations.hidden
        seen: dict[str, list[tuple[str, np.ndarray]]] = {}

        def observer(role: str, name: str, value: np.ndarray, seen: Any = seen) -> None:
            seen.setdefault(role, []).append((name.split("#")[0], value))

        run_locally(plan.run_config(), role_inputs(plan, ids, bytes(32)), observer=observer)
        assert set(seen) == {"cloud"}  # nobody else reconstructs anything
        names = [name for name, _ in seen["cloud"]]
        views = dict(seen["cloud"])
        assert np.abs(views["l0.ln1"] - plain.values["l0.ln1.input"][:, p]).max() < 1e-3
        assert not np.allclose(views["l0.ln1"], plain.values["l0.ln1.input"], atol=1e-2)
        if mode == "faithful":
            assert np.abs(views["embed.ln"] - plain.values["embed.input"][:, p]).max() < 1e-3
        else:
            assert "embed.ln" not in names


def test_hardened_draws_a_fresh_attention_permutation_per_layer(bert: Any) -> None:
    architecture, weights, _ = bert
    ids = token_ids(architecture.vocab, 10, 8)
    plain = Trace()
    forward(architecture, weights, ids, trace=plain)
    for mode, distinct in (("faithful", False), ("hardened", True)):
        plan = deployment(bert, mode)
        views: dict[str, np.ndarray] = {}

        def observer(role: str, name: str, value: np.ndarray, views: Any = views) -> None:
            views[name.split("#")[0]] = value

        run_locally(plan.run_config(), role_inputs(plan, ids, bytes(32)), observer=observer)
        orders = []
        for layer in range(architecture.layers):
            scores = plain.values[f"l{layer}.scores"][0]  # head 0, unpermuted
            seen = views[f"l{layer}.softmax"][0] / np.sqrt(architecture.head_dim)
            # which plaintext column each observed column is
            orders.append(
                tuple(int(np.argmin(np.abs(scores - seen[:, [j]]).sum(0))) for j in range(len(ids)))
            )
        assert sorted(orders[0]) == list(range(len(ids)))
        assert (orders[0] != orders[1]) == distinct


# -- bad input ---------------------------------------------------------------------------------


def test_two_roles_on_one_node_are_refused(bert: Any) -> None:
    architecture, _, _ = bert
    plan = deployment(bert, "faithful")
    inputs = role_inputs(plan, token_ids(architecture.vocab, 5, 0), bytes(32))
    for pair in (("developer", "cloud"), ("cloud", "client"), ("developer", "client")):
        rest = [role for role in ("developer", "cloud", "client") if role not in pair]
        placement = [frozenset(pair), *(frozenset({r}) for r in rest)]
        with pytest.raises(ConfigError, match="may not play both roles"):
            InProcessFederation(centaur(plan.run_config()), inputs, placement=placement).run()


def test_a_share_from_another_request_or_fraction_is_refused() -> None:
    message = tags("request-a", 0, 16) | {"x": np.zeros(2, np.uint64)}
    check_tags(message, "developer", "request-a", 0, 16)
    with pytest.raises(ProtocolError, match="belongs to request 'request-a' pass 0"):
        check_tags(message, "developer", "request-b", 0, 16)
    with pytest.raises(ProtocolError, match="pass 0"):
        check_tags(message, "developer", "request-a", 1, 16)
    with pytest.raises(ProtocolError, match="mismatched fixed-point settings"):
        check_tags(message, "developer", "request-a", 0, 18)


def test_mismatched_fixed_point_settings_are_refused(bert: Any) -> None:
    architecture, _, _ = bert
    ids = token_ids(architecture.vocab, 5, 0)
    plan = deployment(bert, "full-sharing")  # shares encoded with 16 bits
    with pytest.raises(ProtocolError, match="mismatched fixed-point settings"):
        run_locally(plan.run_config(**{"fraction-bits": 18}), role_inputs(plan, ids, bytes(32)))
    with pytest.raises(ConfigError, match="fractional bits must be in"):
        centaur(plan.run_config(**{"fraction-bits": 40}))
    # parties given different settings disagree on the signed protocol digest
    faithful = deployment(bert, "faithful")
    inputs = role_inputs(faithful, ids, bytes(32))
    federation = InProcessFederation(centaur(faithful.run_config()), inputs)
    other = centaur(faithful.run_config(**{"fraction-bits": 18}))
    federation.node_of("cloud").role.protocol = other  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError):
        federation.run()


def test_a_model_the_cloud_was_not_provisioned_for_is_refused(bert: Any) -> None:
    architecture, _, _ = bert
    plan, other = deployment(bert, "faithful"), deployment(bert, "faithful")
    inputs = role_inputs(plan, token_ids(architecture.vocab, 5, 0), bytes(32))
    inputs["cloud"] = other.cloud.arrays()
    with pytest.raises(ProtocolError, match=f"provisioned for model {other.model_id}"):
        InProcessFederation(centaur(plan.run_config()), inputs).run()
    inputs["cloud"] = {}
    with pytest.raises(ProtocolError, match="holds no provisioned CENTAUR model"):
        run_locally(plan.run_config(), inputs)


def test_unknown_or_missing_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="needs 'model-id'"):
        centaur({})
    with pytest.raises(ConfigError, match="unknown centaur run config keys"):
        centaur({"modes": "x"})
    with pytest.raises(ConfigError, match="mode must be one of"):
        centaur(
            {
                "mode": "fast",
                "model-id": "x",
                "architecture": Architecture("bert", 10, 4, 1, 2, 2, 8, 8, 1e-12, 2).to_json(),
            }
        )


def test_calibration_round_trips() -> None:
    calibration = Calibration(9.0, 0.5, 2.0, 6.0, 4.0, {"l0.ln1": 0.3, "l1.ln2": 40.0})
    assert Calibration.from_json(calibration.to_json()) == calibration
    assert calibration.norm_variance("l1.ln2") == 40.0
    assert calibration.norm_variance("l1.ln1") == 2.0  # the layers' typical variance


# -- the Flower app ------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def test_the_app_toml_matches_the_defaults() -> None:
    import tomllib

    from fedfm.protocols.centaur.defaults import DEFAULTS
    from fedfm.runtime.settings import RUN_CONFIG_DEFAULTS

    app = tomllib.loads((ROOT / "simulations" / "centaur" / "pyproject.toml").read_text())
    # a round trip may include a node's first model load: the app allows 600 s, not 60
    assert app["tool"]["flwr"]["app"]["config"] == {
        **RUN_CONFIG_DEFAULTS,
        "timeout": 600.0,
        **DEFAULTS,
    }
    assert app["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "fedfm_strategies.centaur:app",
        "clientapp": "fedfm_clients.centaur:app",
    }


def test_the_app_names_a_model_it_cannot_find_without_downloading(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fedfm_centaur_run", ROOT / "simulations" / "centaur" / "run.py"
    )
    assert spec is not None and spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    with pytest.raises(SystemExit, match="no model 'no-such/model' in a folder or the local"):
        run.load_model("no-such/model", tmp_path)


@pytest.mark.slow
def test_flwr_run_simulation_on_three_supernodes_equals_the_in_process_run(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    workspace = tmp_path / "workspace"
    command = [sys.executable, str(ROOT / "simulations" / "centaur" / "run.py")]
    command += ["--model", "tiny-bert", "--workspace", str(workspace)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=400, check=False)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "flwr run: finished:completed; SuperLink stopped" in output
    assert "identical to the in-process run" in output
    result = json.loads((workspace / "result.json").read_text())
    assert set(result["placement"]) == {"developer", "cloud", "client"}
    assert len(set(result["placement"].values())) == 3
    # the relay saw only the sealed report: no logits, no shares
    assert set(result["outputs"]) == {"client"}
    assert set(result["outputs"]["client"]) == {"report"}


def test_the_round_count_does_not_depend_on_the_calibration(bert: Any) -> None:
    """Every party, the relay included, counts the steps from public settings alone."""
    from fedfm.protocols.centaur.programs import build_forward

    architecture, _, _ = bert
    for mode in ("faithful", "hardened", "full-sharing"):
        rounds = {
            build_forward(architecture, 7, mode=mode, fraction=16, calibration=c).rounds()
            for c in (Calibration(), Calibration(40.0, 0.01, 50.0, 30.0, 2.0, {"l0.ln1": 900.0}))
        }
        assert len(rounds) == 1
