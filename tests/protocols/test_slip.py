"""SLIP (spec 003): decomposition, the masked protocol, attention, the runtime run, bad input.

The fast tests run on a randomly initialised two-block Llama of width 32 (transformers'
``LlamaForCausalLM``, the shared decoder's architecture): what they check (exactness of the
masked arithmetic, what David receives, refusals) does not depend on training. The slow tests
use the packaged MiniLM on the docstring task and the micro decoder trained for a few steps.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fedfm.data.stdlib_text import stdlib_root
from fedfm.errors import ConfigError, ProtocolError
from fedfm.models.decoder import DecoderSource, DecoderTraining, train_decoder
from fedfm.protocols.slip.decomposition import build_plan, parse_blocks, split_weight
from fedfm.protocols.slip.hybrid import (
    ATTENTIONS,
    COMPOSITIONS,
    Charlie,
    CharlieShare,
    David,
    decompose,
    linear_layers,
)
from fedfm.protocols.slip.pads import PadStore
from fedfm.protocols.slip.protocol import (
    Parties,
    example_inputs,
    open_report,
    settings_from_config,
    slip,
)
from fedfm.protocols.slip.ring import (
    PRODUCT_BITS,
    decode,
    encode_activations,
    encode_weights,
    ring_matmul,
    uniform_pads,
)
from fedfm.runtime import run_in_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 2.0**-12  # the acceptance bound on the relative output error
TOKENS = 12


@pytest.fixture(scope="module")
def model() -> Any:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
        )
        return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(1).integers(3, 320, (1, TOKENS)))


def _parties(
    model: Any, *, rank: int = 4, composition: str = "safe", attention: str = "single-step"
) -> tuple[Charlie, David]:
    plan = build_plan(linear_layers(model), rank=rank)
    decomposition = decompose(model, plan)
    charlie = Charlie(
        copy.deepcopy(model),
        decomposition.charlie_share(),
        example_inputs(),
        composition=composition,
        attention=attention,
    )
    david = decomposition.david_share()
    charlie.precompute_pads(david, rows=2 * TOKENS)
    return charlie, david


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# -- decomposition -------------------------------------------------------------------------------


def test_svd_split_keeps_the_top_singular_part_and_refuses_k_above_the_rank() -> None:
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(12, 8))
    split = split_weight(weight, 3)
    assert np.allclose(split.charlie() + split.david, weight, atol=1e-12)
    assert np.linalg.matrix_rank(split.charlie()) == 3
    # David's remainder has exactly the other singular values
    s = np.linalg.svd(weight, compute_uv=False)
    assert np.allclose(np.linalg.svd(split.david, compute_uv=False)[:5], s[3:])
    assert split.charlie_parameters == 3 * (12 + 8)  # k (m + n): factored
    with pytest.raises(ConfigError, match="larger than the rank"):
        split_weight(weight, 9)
    low_rank = rng.normal(size=(12, 2)) @ rng.normal(size=(2, 8))
    with pytest.raises(ConfigError, match=r"rank of its 12x8 weight \(2\)"):
        split_weight(low_rank, 3)


def test_plan_names_blocks_and_types_and_refuses_what_the_model_lacks(model: Any) -> None:
    layers = linear_layers(model)
    plan = build_plan(layers, blocks="first-last", rank=4)
    assert len(plan) == 14 and "lm_head" not in plan  # 7 linear layers in each of 2 blocks
    only = build_plan(layers, blocks="last", types="mlp.up_proj", rank=2)
    assert only == {"model.layers.1.mlp.up_proj": 2}
    assert parse_blocks("-1", 4) == (3,)
    with pytest.raises(ConfigError, match=re.escape("blocks 0..1")):
        build_plan(layers, blocks="5")
    with pytest.raises(ConfigError, match="no layer of type"):
        build_plan(layers, types="mlp.fc1")
    with pytest.raises(
        ConfigError, match=re.escape("no linear layer 'model.layers.7.mlp.up_proj'")
    ):
        decompose(model, {"model.layers.7.mlp.up_proj": 2})
    with pytest.raises(ConfigError, match="larger than the rank"):
        decompose(model, {"model.layers.0.mlp.up_proj": 33})


def test_settings_refuse_rank_one_and_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=re.escape("App. A.1")):
        settings_from_config({"rank": 1})
    with pytest.raises(ConfigError, match="unknown slip run config keys"):
        settings_from_config({"ranks": 4})
    with pytest.raises(ConfigError, match="composition must be one of"):
        settings_from_config({"composition": "clear"})


# -- the ring --------------------------------------------------------------------------------------


def test_masked_product_is_exact_in_the_ring() -> None:
    rng = np.random.default_rng(2)
    weight, rows = rng.normal(size=(6, 5)), rng.normal(size=(3, 5)) * 4
    encoded_weight = encode_weights(weight)
    pads = uniform_pads(rows.shape)
    masks = ring_matmul(pads, encoded_weight)
    with np.errstate(over="ignore"):
        masked = encode_activations(rows) + pads
        unmasked = ring_matmul(masked, encoded_weight) - masks
    # exactly the unmasked fixed-point product (Lemma 2), within fixed-point error of floats
    assert np.array_equal(unmasked, ring_matmul(encode_activations(rows), encoded_weight))
    assert np.abs(decode(unmasked) - rows @ weight.T).max() < 2.0**-16
    assert PRODUCT_BITS == 40


# -- hybrid inference ------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_hybrid_output_equals_the_model_within_fixed_point_error(
    model: Any, ids: torch.Tensor, composition: str, attention: str
) -> None:
    charlie, david = _parties(model, composition=composition, attention=attention)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    output, traffic = charlie.run({"input_ids": ids}, david)
    assert _relative(output.logits, expected) <= TOLERANCE
    assert output.logits[0].argmax(-1).tolist() == expected[0].argmax(-1).tolist()
    # one request per group of layers sharing an input; double-step adds one per attention
    assert traffic.round_trips == charlie.requests == (11 if attention == "double-step" else 9)
    masked = traffic.masked_items
    if composition == "safe":
        assert traffic.clear_items == 0
    elif composition == "faithful":
        assert traffic.clear_items == 1 and masked > 0  # lm_head's input: not split
    else:
        assert masked == 0


def test_one_flipped_pad_bit_breaks_the_output(model: Any, ids: torch.Tensor) -> None:
    charlie, david = _parties(model)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    key = "model.layers.0.mlp.down_proj"
    charlie.pads.layers[key].pads[3, 5] ^= np.uint64(1 << 40)
    output, _ = charlie.run({"input_ids": ids}, david)
    assert _relative(output.logits, expected) > 0.1


def test_pads_are_never_reused_nor_missing(model: Any, ids: torch.Tensor, tmp_path: Any) -> None:
    charlie, david = _parties(model)
    charlie.run({"input_ids": ids}, david)
    charlie.run({"input_ids": ids}, david)  # 2 x TOKENS rows precomputed: both fit
    with pytest.raises(ProtocolError, match="missing pad for layer"):
        charlie.run({"input_ids": ids}, david)
    store = PadStore.precompute({"w": encode_weights(np.eye(3))}, ["w"], 4)
    store.take("w", 2)
    with pytest.raises(ProtocolError, match="never reused"):
        store.take_rows("w", 1, 1)
    with pytest.raises(ProtocolError, match="no pad for layer 'v'"):
        store.take("v", 1)
    store.save(tmp_path / "pads")
    again = PadStore.load(tmp_path / "pads")  # a second run from the same files
    assert again.remaining("w") == 2
    with pytest.raises(ProtocolError, match="never reused"):
        again.take_rows("w", 0, 2)
    other = PadStore.load(tmp_path / "pads")  # another process holding the same store
    again.take("w", 1)
    assert other.take("w", 1)[0] == 3  # it sees the row the first one took


def test_pads_come_from_the_os_and_cover_the_ring() -> None:
    pads = uniform_pads((4096,))
    assert pads.dtype == np.uint64 and len(np.unique(pads)) == 4096
    top = (pads >> np.uint64(60)).astype(np.int64)  # the top 4 bits: all 16 values appear
    assert set(np.bincount(top, minlength=16).nonzero()[0]) == set(range(16))


def test_mismatched_shapes_between_the_parties_are_refused(model: Any, ids: torch.Tensor) -> None:
    charlie, david = _parties(model)
    name = "model.layers.0.mlp.up_proj"
    with pytest.raises(ProtocolError, match=r"takes \(rows, 32\) uint64 inputs"):
        david.answer({name: np.zeros((2, 31), dtype=np.uint64)})
    with pytest.raises(
        ProtocolError, match=re.escape("David holds no layer 'model.layers.9.mlp.up_proj'")
    ):
        david.answer({"model.layers.9.mlp.up_proj": np.zeros((2, 32), dtype=np.uint64)})
    with pytest.raises(ProtocolError, match="has shape"):
        charlie.unmask({name: np.zeros((2, 64), np.uint64)}, {name: np.zeros((3, 64), np.uint64)})
    wrong = CharlieShare({name: (np.zeros((64, 2)), np.zeros((16, 2)))}, {})
    with pytest.raises(ConfigError, match=re.escape("factors for model.layers.0.mlp.up_proj")):
        Charlie(copy.deepcopy(model), _bounded(wrong, model), example_inputs())


def _bounded(share: CharlieShare, model: Any) -> CharlieShare:
    return CharlieShare(share.factors, {name: 1.0 for name in linear_layers(model)})


def test_an_activation_that_would_overflow_the_ring_is_refused(model: Any) -> None:
    charlie, _ = _parties(model)
    name = "model.layers.0.mlp.up_proj"
    huge = np.full((1, 32), 2.0**24)
    with pytest.raises(ProtocolError, match="overflow the ring"):
        charlie.mask({name: huge}, charlie_traffic())


def charlie_traffic() -> Any:
    from fedfm.protocols.slip.hybrid import Traffic

    return Traffic()


def test_what_david_receives(model: Any, ids: torch.Tensor) -> None:
    """Safe: every word differs from the activation's encoding; faithful: non-split layers'
    inputs arrive as their plain encodings (what Fig. 10 hands David)."""
    seen: dict[str, list[dict[str, np.ndarray]]] = {}
    for composition in ("safe", "faithful"):
        charlie, david = _parties(model, composition=composition)
        log: list[dict[str, np.ndarray]] = []
        original = david.answer

        def spy(request: Any, log: Any = log, original: Any = original) -> Any:
            log.append(dict(request))
            return original(request)

        david.answer = spy  # type: ignore[method-assign]
        charlie.run({"input_ids": ids}, david)
        seen[composition] = log
    safe_head = seen["safe"][-1]["lm_head"]
    faithful_head = seen["faithful"][-1]["lm_head"]
    assert not np.array_equal(safe_head, faithful_head)
    decoded = decode(faithful_head, 20)
    assert np.abs(decoded).max() < 100  # a plain activation (after the final norm)
    assert np.abs(decode(safe_head, 20)).max() > 1e6  # uniform ring words


# -- the runtime -----------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_runtime_run_equals_the_in_process_hybrid_and_seals_the_output(
    model: Any, ids: torch.Tensor, attention: str
) -> None:
    charlie, david = _parties(model, attention=attention)
    protocol = slip({"rank": 4, "attention": attention}, parties=Parties(charlie, david))
    assert protocol.parameters["requests"] == charlie.requests
    key = os.urandom(32)
    result = run_in_process(
        protocol,
        {"charlie": {"input_ids": ids[0].numpy(), "report_key": np.frombuffer(key, np.uint8)}},
    )
    published = result.outputs["charlie"]
    assert set(published) == {"report"}  # the relay sees only the sealed report
    report = open_report(key, published["report"])
    with torch.no_grad():
        expected = model(input_ids=ids).logits[0, -1].double().numpy()
    assert np.abs(report["logits"] - expected).max() / np.abs(expected).max() <= TOLERANCE
    assert int(report["next_token"][0]) == int(expected.argmax())
    assert not result.outputs.get("david")


# -- the Flower app, real models (slow) ------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
MICRO_TRAINING = DecoderTraining(
    steps=16, batch_size=8, lr=1e-2, warmup_steps=2, eval_every=8, checkpoint_every=8
)


def test_the_app_toml_matches_the_defaults() -> None:
    import tomllib

    from fedfm.protocols.slip.defaults import DEFAULTS
    from fedfm.runtime.settings import RUN_CONFIG_DEFAULTS

    app = tomllib.loads((ROOT / "simulations" / "slip" / "pyproject.toml").read_text())
    # a round trip may include a node's first model load: the app allows 600 s, not 60
    assert app["tool"]["flwr"]["app"]["config"] == {
        **RUN_CONFIG_DEFAULTS,
        "timeout": 600.0,
        **DEFAULTS,
    }
    assert app["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "fedfm_strategies.slip:app",
        "clientapp": "fedfm_clients.slip:app",
    }


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> DecoderSource:
    """The shared decoder's micro variant, trained for a few steps (as tests/models do)."""
    source = DecoderSource(
        name="llama_fedfm_micro",
        cache_dir=tmp_path_factory.mktemp("slip-decoder"),
        training=MICRO_TRAINING,
        text_root=stdlib_root() / "importlib",
    )
    train_decoder(source, progress=False, log=lambda _: None)
    return source


@pytest.mark.slow
def test_minilm_top1_on_the_docstring_task_equals_the_model() -> None:
    from fedfm.experiments.slip_bench import accuracy_run
    from fedfm.experiments.slip_models import minilm_task

    task = minilm_task(train_per_class=10, queries_per_class=2)
    decomposition = decompose(task.model, build_plan(linear_layers(task.model), rank=16))
    found = accuracy_run(task, decomposition, "double-step", batch=14)
    assert found["max_rel_output_error"] <= TOLERANCE
    assert found["top1_agreement"] == 1.0


@pytest.mark.slow
def test_greedy_tokens_of_the_trained_decoder_equal_the_model(micro: DecoderSource) -> None:
    from fedfm.models.decoder import load_decoder

    model, _ = load_decoder(micro)
    charlie, david = _parties(model, rank=4)
    charlie.pads = PadStore()
    charlie.precompute_pads(david, rows=6 * 16)
    ids = torch.from_numpy(np.random.default_rng(4).integers(3, 320, (1, 8)))
    plain, hybrid = ids, ids
    for _ in range(6):
        with torch.no_grad():
            next_plain = model(input_ids=plain).logits[0, -1].argmax()
        output, _ = charlie.run({"input_ids": hybrid}, david)
        next_hybrid = output.logits[0, -1].argmax()
        plain = torch.cat([plain, next_plain.reshape(1, 1)], dim=1)
        hybrid = torch.cat([hybrid, next_hybrid.reshape(1, 1)], dim=1)
    assert torch.equal(plain, hybrid)


@pytest.mark.slow
def test_flwr_run_simulation_on_two_supernodes_equals_the_in_process_run(
    micro: DecoderSource, tmp_path: Path
) -> None:
    import json
    import subprocess
    import sys

    workspace = tmp_path / "workspace"
    command = [sys.executable, str(ROOT / "simulations" / "slip" / "run.py"), "--tokens", "8"]
    command += ["--model", str(micro.path), "--rank", "4", "--workspace", str(workspace)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "flwr run: finished:completed; SuperLink stopped" in output
    result = json.loads((workspace / "result.json").read_text())
    assert set(result["placement"]) == {"charlie", "david"}
    assert len(set(result["placement"].values())) == 2
    # both runs consumed their own pads: the ledger shows two inferences' rows taken
    ledger = json.loads((workspace / "owner" / "charlie" / "pads" / "ledger.json").read_text())
    assert set(ledger["used"].values()) == {16}
