"""FedRAG: the scrambler's algebra, the online-softmax merge, generation on the runtime equal to
plaintext RAG, what the compute node sees, and the bad inputs the issue lists.

The decoder is the ``llama_fedfm_micro`` variant (2 layers, width 32, 2 heads of 16, context 32)
trained for a few steps on ``importlib``'s docstrings in pytest's temporary folder (seconds).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfm.data.stdlib_text import stdlib_root
from fedfm.errors import ConfigError, ProtocolError
from fedfm.models.decoder import DecoderSource, DecoderTraining, train_decoder
from fedfm.protocols.fedrag import keys as keyring
from fedfm.protocols.fedrag.attention import attention_with_lse, causal_mask, merge_attention
from fedfm.protocols.fedrag.decoder import runner_for
from fedfm.protocols.fedrag.plan import COORDINATOR, RolePlan
from fedfm.protocols.fedrag.protocol import check_placement, fedrag, open_report
from fedfm.protocols.fedrag.reference import plaintext_generate
from fedfm.protocols.fedrag.scrambler import (
    KINDS,
    KeyLedger,
    LocalRandomness,
    ScramblerKeyReuse,
    draw_attention_keys,
    draw_scrambler,
    hadamard,
)
from fedfm.runtime import InProcessFederation, Protocol, RoleContext, Step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MICRO_TRAINING = DecoderTraining(
    steps=12, batch_size=8, lr=1e-2, warmup_steps=2, eval_every=6, checkpoint_every=6
)


def micro_source(cache: Path, *, seed: int = 0) -> DecoderSource:
    from dataclasses import replace

    return DecoderSource(
        name="llama_fedfm_micro",
        cache_dir=cache,
        training=replace(MICRO_TRAINING, seed=seed),
        text_root=stdlib_root() / "importlib",
    )


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> DecoderSource:
    source = micro_source(tmp_path_factory.mktemp("fedrag-decoder"))
    train_decoder(source, progress=False, log=lambda _: None)
    return source


def segments(source: DecoderSource, seed: int = 0) -> dict[str, np.ndarray]:
    """Random token ids (after <s> for owner_0): 6 + 5 context tokens, a 4-token query."""
    _, tokenizer = runner_for(source)
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    return {
        "owner_0": np.concatenate([[0], rng.integers(3, vocab, 5)]),
        "owner_1": rng.integers(3, vocab, 5),
        COORDINATOR: rng.integers(3, vocab, 4),
    }


def run_generation(
    source: DecoderSource | dict[str, DecoderSource],
    segs: dict[str, np.ndarray],
    *,
    plan: str = "dedicated",
    tokens: int = 6,
    extra: dict[str, object] | None = None,
    placement: list[frozenset[str]] | None = None,
    owner_inputs: dict[str, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], InProcessFederation, object]:
    key = os.urandom(32)
    inputs: dict[str, dict[str, np.ndarray]] = {
        "owner_0": {"segment": segs["owner_0"], **(owner_inputs or {})},
        "owner_1": {"segment": segs["owner_1"], **(owner_inputs or {})},
        COORDINATOR: {"query": segs[COORDINATOR], "report_key": np.frombuffer(key, np.uint8)},
    }
    config = {"max-new-tokens": tokens, "compute-plan": plan, **(extra or {})}
    protocol = fedrag(config, decoders=source)
    roles = RolePlan(2, plan)
    federation = InProcessFederation(
        protocol, inputs, placement=placement or roles.placement(3 if plan == "rotating" else 4)
    )
    result = federation.run()
    return open_report(key, result.outputs[COORDINATOR]["report"]), federation, result


# -- the maths -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_scrambler_maps_are_s_its_inverse_transpose_and_inverse(kind: str) -> None:
    key = draw_scrambler(LocalRandomness(), "p", 16, kind=kind, scaling_range=3.0)
    matrix = key.matrix()
    x = np.random.default_rng(0).normal(size=(7, 16))
    assert np.allclose(key.forward(x), x @ matrix, atol=1e-12)
    assert np.allclose(key.inverse_transpose(x), x @ np.linalg.inv(matrix).T, atol=1e-10)
    assert np.allclose(key.inverse(key.forward(x)), x, atol=1e-10)
    if kind == "structured":
        # Eq. 9: P1 D1 H D2 P2, scalings within [1/r, r] with random signs
        magnitudes = np.abs(np.concatenate([key.scale1, key.scale2]))
        assert magnitudes.min() >= 1 / 3.0 and magnitudes.max() <= 3.0
        assert (key.scale1 < 0).any() and (key.scale1 > 0).any()
        assert not np.allclose(np.abs(matrix), np.abs(matrix)[0, 0])  # not a bare Hadamard


def test_lemmas_scrambled_attention_equals_plaintext() -> None:
    """Lemma 1 (logits kept), Lemma 2 (values linear), Eqs. 10-12 with token permutations."""
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(2, 5, 16)), rng.normal(size=(2, 9, 16)), rng.normal(size=(2, 9, 16))
    keys = draw_attention_keys(LocalRandomness(), "pair", heads=2, head_dim=16)
    out, lse = attention_with_lse(q, k, v, scaling=0.25)
    pq, pk = rng.permutation(5), rng.permutation(9)
    s_out, s_lse = attention_with_lse(
        keys.scramble_queries(q)[:, pq],
        keys.scramble_keys(k)[:, pk],
        keys.scramble_values(v)[:, pk],
        scaling=0.25,
    )
    restored = np.empty_like(s_out.numpy())
    restored[:, pq] = s_out.numpy()
    assert np.allclose(keys.unscramble_outputs(restored), out.numpy(), atol=1e-10)
    assert np.allclose(s_lse.numpy()[:, np.argsort(pq)], lse.numpy(), atol=1e-10)
    # the scrambled tensors are not the plaintext ones
    assert not np.allclose(keys.scramble_keys(k), k, atol=0.1)


def test_online_softmax_merge_equals_full_causal_attention() -> None:
    rng = np.random.default_rng(2)
    q = torch.from_numpy(rng.normal(size=(2, 4, 8)))
    k, v = torch.from_numpy(rng.normal(size=(2, 11, 8))), torch.from_numpy(rng.normal(size=(2, 11, 8)))
    full, full_lse = attention_with_lse(q, k, v, scaling=0.3, allowed=causal_mask(4, 11, offset=7))
    parts = [
        attention_with_lse(q, k[:, :3], v[:, :3], scaling=0.3),
        attention_with_lse(q, k[:, 3:7], v[:, 3:7], scaling=0.3),
        attention_with_lse(q, k[:, 7:], v[:, 7:], scaling=0.3, allowed=causal_mask(4, 4, offset=0)),
    ]
    merged, merged_lse = merge_attention(parts)
    assert torch.allclose(merged, full, atol=1e-12)
    assert torch.allclose(merged_lse, full_lse, atol=1e-12)


def test_hadamard_and_scaling_range_checks() -> None:
    h = hadamard(8)
    assert np.allclose(h @ h, np.eye(8))
    with pytest.raises(ConfigError, match="power-of-two"):
        draw_scrambler(LocalRandomness(), "p", 12)
    with pytest.raises(ConfigError, match="scaling range"):
        draw_scrambler(LocalRandomness(), "p", 8, scaling_range=0.5)
    draw_scrambler(LocalRandomness(), "p", 12, kind="dense")  # any size


def test_keys_depend_on_purpose_and_secret_and_a_ledger_refuses_reuse() -> None:
    shared = os.urandom(32)
    one = draw_scrambler(LocalRandomness(shared), "fedrag/0/generate/a<-b/layer0", 16)
    same = draw_scrambler(LocalRandomness(shared), "fedrag/0/generate/a<-b/layer0", 16)
    other_layer = draw_scrambler(LocalRandomness(shared), "fedrag/0/generate/a<-b/layer1", 16)
    other_secret = draw_scrambler(LocalRandomness(), "fedrag/0/generate/a<-b/layer0", 16)
    assert np.array_equal(one.matrix(), same.matrix())
    assert not np.allclose(one.matrix(), other_layer.matrix())
    assert not np.allclose(one.matrix(), other_secret.matrix())
    ledger = KeyLedger()
    ledger.claim("fedrag/0/generate/a<-b/layer0")
    restored = KeyLedger.from_array(ledger.to_array())
    restored.claim("fedrag/0/generate/a<-b/layer1")
    with pytest.raises(ScramblerKeyReuse, match="already derived"):
        restored.claim("fedrag/0/generate/a<-b/layer0")


def _key_protocol(twice: bool) -> Protocol:
    """alice scrambles q, bob scrambles k and v under keys from their runtime pair randomness;
    carol computes; alice unscrambles. ``twice``: bob derives the same key again."""
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(1, 3, 8)), rng.normal(size=(1, 6, 8)), rng.normal(size=(1, 6, 8))
    options = {"heads": 1, "head_dim": 8, "kind": "structured", "scaling_range": 2.0}

    def owner(context: RoleContext) -> None:
        keys = keyring.derive(context, "alice", "purpose", **options)  # type: ignore[arg-type]
        if twice:
            keyring.derive(context, "alice", "purpose", **options)  # type: ignore[arg-type]
        context.send("carol", {"k": keys.scramble_keys(k), "v": keys.scramble_values(v)})

    def inquirer(context: RoleContext) -> None:
        keys = keyring.derive(context, "bob", "purpose", **options)  # type: ignore[arg-type]
        context.state.update(keyring.keys_to_arrays("keys", keys))
        context.send("carol", {"q": keys.scramble_queries(q)})

    def compute(context: RoleContext) -> None:
        kv, query = context.receive("bob"), context.receive("alice")
        out, lse = attention_with_lse(query["q"], kv["k"], kv["v"], scaling=0.5)
        context.send("alice", {"out": out.numpy()})

    def reveal(context: RoleContext) -> None:
        keys = keyring.keys_from_state(context.state, "keys", "structured")
        out = keys.unscramble_outputs(context.receive("carol")["out"])
        expected, _ = attention_with_lse(q, k, v, scaling=0.5)
        context.publish("error", np.asarray(np.abs(out - expected.numpy()).max()))

    return Protocol(
        name="keys",
        roles=("alice", "bob", "carol"),
        channels=(("alice", "bob"), ("alice", "carol"), ("bob", "carol")),
        separated=(("alice", "carol"), ("bob", "carol")),
        steps=(
            Step("scramble", ("alice", "bob"), lambda c: inquirer(c) if c.role == "alice" else owner(c)),
            Step("compute", ("carol",), compute),
            Step("reveal", ("alice",), reveal),
        ),
    )


def test_runtime_pair_randomness_gives_both_parties_the_same_keys() -> None:
    result = InProcessFederation(_key_protocol(twice=False)).run()
    assert float(result.outputs["alice"]["error"]) < 1e-10


def test_a_reused_scrambling_key_is_refused() -> None:
    with pytest.raises(ProtocolError, match="already derived and used"):
        InProcessFederation(_key_protocol(twice=True)).run()


# -- generation on the runtime ---------------------------------------------------------------


@pytest.mark.parametrize("plan", ["dedicated", "rotating"])
def test_generation_equals_plaintext_rag(micro: DecoderSource, plan: str) -> None:
    segs = segments(micro)
    report, _, result = run_generation(micro, segs, plan=plan)
    runner, _ = runner_for(micro)
    tokens, logits = plaintext_generate(
        runner, [segs["owner_0"], segs["owner_1"], segs[COORDINATOR]], 6
    )
    assert np.array_equal(report["tokens"], tokens)
    assert np.abs(report["logits"] - logits).max() <= 1e-4
    # one compute exchange (two relay round trips) per layer per decoded token
    layers = runner.geometry.layers
    assert result.traffic.round_trips == 1 + 1 + 2 * layers * (1 + 6) + 1


def test_compute_node_sees_only_scrambled_tensors(micro: DecoderSource) -> None:
    """The compute node's inbound keys/values/queries are not the plaintext ones, and differ
    from what the same owner sends under attention='distributed' (the ablation)."""
    segs = segments(micro, seed=4)
    seen: dict[str, list[np.ndarray]] = {}
    for mode, owner_inputs in (("scrambled", {}), ("distributed", {"allow_plaintext_attention": np.asarray(True)})):
        _, federation, _ = run_generation(
            micro, segs, extra={"attention": mode}, tokens=2, owner_inputs=owner_inputs
        )
        node = federation.node_of("compute")
        state = node.state.role_state["compute"]
        seen[mode] = [state[name] for name in sorted(state) if name.endswith(".k")]
    for scrambled, plain in zip(seen["scrambled"], seen["distributed"], strict=True):
        assert scrambled.shape == plain.shape
        # rows permuted and features mixed: no row of the scrambled keys is a plaintext row
        distances = np.abs(scrambled[:, :, None, :] - plain[:, None, :, :]).max(-1)
        assert distances.min() > 1e-3


def test_distributed_ablation_needs_the_owners_consent(micro: DecoderSource) -> None:
    with pytest.raises(ProtocolError, match="allow_plaintext_attention"):
        run_generation(micro, segments(micro), extra={"attention": "distributed"}, tokens=1)


# -- bad inputs --------------------------------------------------------------------------------


def test_compute_node_may_not_be_an_owner_of_the_same_computation(micro: DecoderSource) -> None:
    plan = RolePlan(2, "dedicated")
    bad = [frozenset({COORDINATOR}), frozenset({"owner_0", "compute"}), frozenset({"owner_1"})]
    with pytest.raises(ProtocolError, match="could unscramble"):
        check_placement(plan, bad)
    with pytest.raises(ConfigError, match="may not play both roles"):
        run_generation(micro, segments(micro), placement=bad, tokens=1)


def test_fewer_than_three_nodes_and_too_few_owners_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least three nodes"):
        RolePlan(2, "rotating").placement(2)
    with pytest.raises(ConfigError, match="needs 4 nodes"):
        RolePlan(2, "dedicated").placement(3)
    with pytest.raises(ConfigError, match="at least 2 context owners"):
        RolePlan(1, "dedicated")
    with pytest.raises(ConfigError, match="unknown fedrag run config"):
        fedrag({"owner": 2})


def test_mismatched_models_between_parties_are_refused(
    micro: DecoderSource, tmp_path: Path
) -> None:
    other = micro_source(tmp_path, seed=1)
    train_decoder(other, progress=False, log=lambda _: None)
    sources = {COORDINATOR: micro, "owner_0": micro, "owner_1": other, "compute": micro}
    with pytest.raises(ProtocolError, match="mismatched model configs"):
        run_generation(sources, segments(micro), tokens=1)


def test_a_prompt_past_the_context_is_refused(micro: DecoderSource) -> None:
    segs = segments(micro)
    segs[COORDINATOR] = np.full(30, 5)
    with pytest.raises(ProtocolError, match="past the model's context"):
        run_generation(micro, segs, tokens=2)
