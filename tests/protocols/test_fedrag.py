"""FedRAG: the scrambler's algebra, the online-softmax merge, generation on the runtime equal to
plaintext RAG, what the compute node sees, and the bad inputs the issue lists.

The decoder is the ``llama_fedfm_micro`` variant (2 layers, width 32, 2 heads of 16, context 32)
trained for a few steps on ``importlib``'s docstrings in pytest's temporary folder (seconds).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfm.errors import ConfigError, ProtocolError
from fedfm.models.decoder import DecoderSource, train_decoder
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
from tests.helpers import micro_decoder_source

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> DecoderSource:
    source = micro_decoder_source(tmp_path_factory.mktemp("fedrag-decoder"))
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
    k, v = (
        torch.from_numpy(rng.normal(size=(2, 11, 8))),
        torch.from_numpy(rng.normal(size=(2, 11, 8))),
    )
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


@pytest.mark.parametrize("kind", KINDS)
def test_a_layers_key_set_gives_every_head_and_matrix_its_own_scrambler(kind: str) -> None:
    """One generator and one keystream per layer's key set, cut into 2 x heads shares: no two
    scramblers of the set (S and M of every head) coincide, and both parties get the same."""
    shared = os.urandom(32)
    keys = draw_attention_keys(LocalRandomness(shared), "layer", heads=4, head_dim=16, kind=kind)
    again = draw_attention_keys(LocalRandomness(shared), "layer", heads=4, head_dim=16, kind=kind)
    matrices = [key.matrix() for key in (*keys.qk, *keys.v)]
    for i, first in enumerate(matrices):
        assert np.array_equal(first, [k.matrix() for k in (*again.qk, *again.v)][i])
        for second in matrices[i + 1 :]:
            assert not np.allclose(first, second)


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
        out, _ = attention_with_lse(query["q"], kv["k"], kv["v"], scaling=0.5)
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
            Step(
                "scramble",
                ("alice", "bob"),
                lambda c: inquirer(c) if c.role == "alice" else owner(c),
            ),
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


Delivered = list[tuple[str, str, str, dict[str, np.ndarray]]]


def recording(protocol: Protocol) -> tuple[Protocol, Delivered]:
    """``protocol`` with every step action wrapped to note what each role received (receiver,
    step, sender, arrays), as opened on its node."""
    seen: Delivered = []

    def wrap(action: Callable[[RoleContext], None]) -> Callable[[RoleContext], None]:
        def act(context: RoleContext) -> None:
            for message in context.inbox:
                arrays = {name: np.array(value) for name, value in message.arrays.items()}
                seen.append((context.role, context.step, message.sender, arrays))
            action(context)

        return act

    steps = tuple(replace(step, action=wrap(step.action)) for step in protocol.steps)
    return replace(protocol, steps=steps), seen


def recorded_run(
    source: DecoderSource,
    segs: dict[str, np.ndarray],
    attention: str,
    tokens: int = 2,
) -> tuple[dict[str, np.ndarray], Delivered]:
    key = os.urandom(32)
    consent = {"allow_plaintext_attention": np.asarray(attention == "distributed")}
    inputs = {
        "owner_0": {"segment": segs["owner_0"], **consent},
        "owner_1": {"segment": segs["owner_1"], **consent},
        COORDINATOR: {"query": segs[COORDINATOR], "report_key": np.frombuffer(key, np.uint8)},
    }
    config = {"max-new-tokens": tokens, "attention": attention}
    protocol, seen = recording(fedrag(config, decoders=source))
    result = InProcessFederation(
        protocol, inputs, placement=RolePlan(2, "dedicated").placement(4)
    ).run()
    return open_report(key, result.outputs[COORDINATOR]["report"]), seen


def test_compute_node_sees_only_scrambled_tensors(micro: DecoderSource) -> None:
    """Every query, key and value the compute node receives (all layers, prefill and decoding)
    is scrambled and row-permuted: no row is a row of the plaintext tensor the same party sends
    under attention='distributed' (the ablation, where they travel in the clear)."""
    segs = segments(micro, seed=4)
    inbound = {}
    for mode in ("scrambled", "distributed"):
        _, seen = recorded_run(micro, segs, mode)
        inbound[mode] = {
            (step, sender, name): value
            for role, step, sender, arrays in seen
            if role == "compute"
            for name, value in arrays.items()
            if name.startswith(("q.", "kv."))
        }
    assert inbound["scrambled"].keys() == inbound["distributed"].keys()
    names = {name for _, _, name in inbound["scrambled"]}
    assert any(n.startswith("q.") for n in names)
    assert any(n.startswith("kv.") and n.endswith(".k") for n in names)
    assert any(n.startswith("kv.") and n.endswith(".v") for n in names)
    for where, scrambled in inbound["scrambled"].items():
        plain = inbound["distributed"][where]
        assert scrambled.shape == plain.shape
        # features mixed and rows permuted: no scrambled row is any plaintext row of its head
        distances = np.abs(scrambled[:, :, None, :] - plain[:, None, :, :]).max(-1)
        assert distances.min() > 1e-3, where


def test_the_coordinator_receives_attention_outputs_not_keys_or_values(
    micro: DecoderSource,
) -> None:
    """The coordinator gets the owners' segment lengths and model fingerprints, and from the
    compute node per owner the (scrambled, row-permuted) attention outputs and log-sum-exps of
    its own tokens: arrays with one row per coordinator token, never one per owner token."""
    segs = segments(micro, seed=5)
    runner, _ = runner_for(micro)
    g = runner.geometry
    query, owner_tokens = len(segs[COORDINATOR]), {len(segs["owner_0"]), len(segs["owner_1"])}
    report, seen = recorded_run(micro, segs, "scrambled", tokens=3)
    received = [
        (step, sender, arrays) for role, step, sender, arrays in seen if role == COORDINATOR
    ]
    assert {sender for _, sender, _ in received} == {"owner_0", "owner_1", "compute"}
    outputs = 0
    for _, sender, arrays in received:
        if sender != "compute":
            assert set(arrays) == {"length", "fp"}
            continue
        assert set(arrays) == {"out.owner_0", "lse.owner_0", "out.owner_1", "lse.owner_1"}
        # answers in order: the query's prefill (every layer), then one token per layer
        rows = query if outputs < g.layers else 1
        assert rows not in owner_tokens
        for owner in ("owner_0", "owner_1"):
            assert arrays[f"out.{owner}"].shape == (g.heads, rows, g.head_dim)
            assert arrays[f"lse.{owner}"].shape == (g.heads, rows)
        outputs += 1
    assert outputs == g.layers * 3  # one answer per layer per block (query prefill + 2 tokens)
    assert report["tokens"].shape == (3,)


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


@pytest.mark.parametrize("plan", ["dedicated", "rotating"])
def test_every_run_on_two_nodes_is_refused_before_anything_is_sent(
    micro: DecoderSource, plan: str
) -> None:
    """Not only RolePlan.placement: however the roles are put on two nodes, a node refuses to
    host them (two parties, or a compute role with a party it serves)."""
    roles = RolePlan(2, plan).roles
    for mask in range(1, 2 ** len(roles) - 1):
        first = frozenset(role for bit, role in enumerate(roles) if mask >> bit & 1)
        placement = [first, frozenset(roles) - first]
        with pytest.raises(ConfigError, match="may not play both roles"):
            run_generation(micro, segments(micro), plan=plan, placement=placement, tokens=1)


def test_the_flower_apps_refuse_a_run_on_two_nodes(micro: DecoderSource, tmp_path: Path) -> None:
    """The ServerApp's run (run_on_grid) with FedRAG's ClientApp on two nodes: the node asked
    to host the coordinator and both owners refuses at hello, the run stops naming why."""
    from flwr.app import Context, RecordDict

    from fedfm.runtime import create_identity_file, format_pins
    from fedfm.runtime.settings import identity_file
    from fedfm_clients.fedrag import app as fedrag_client
    from fedfm_strategies.aggregation import task_identity
    from fedfm_strategies.runtime import run_on_grid
    from tests.runtime.support import LoopbackGrid

    partitions = {COORDINATOR: 0, "owner_0": 0, "owner_1": 0, "compute": 1}
    keys = {k: create_identity_file(identity_file(tmp_path, k)) for k in (0, 1)}
    pins = {role: keys[k] for role, k in partitions.items()}
    own = {
        "role-partitions": ",".join(f"{role}={k}" for role, k in partitions.items()),
        "identity-dir": str(tmp_path),
        "pins": format_pins(pins),
    }
    run_config = {"num-nodes": 2, "decoder": str(micro.path), "max-new-tokens": 1}
    contexts = {
        7000 + k: Context(
            run_id=1,
            node_id=7000 + k,
            node_config={"partition-id": k, "num-partitions": 2, **own},
            state=RecordDict(),
            run_config=run_config,
        )
        for k in range(2)
    }
    grid = LoopbackGrid(contexts, client_app=fedrag_client)
    with task_identity(), pytest.raises(ProtocolError, match="may not play both roles") as refused:
        run_on_grid(grid, fedrag, run_config, log=lambda _: None)
    assert "hello failed" in str(refused.value)
    assert "coordinator" in str(refused.value) and "owner_0" in str(refused.value)


def test_mismatched_models_between_parties_are_refused(
    micro: DecoderSource, tmp_path: Path
) -> None:
    other = micro_decoder_source(tmp_path, seed=1)
    train_decoder(other, progress=False, log=lambda _: None)
    sources = {COORDINATOR: micro, "owner_0": micro, "owner_1": other, "compute": micro}
    with pytest.raises(ProtocolError, match="mismatched model configs"):
        run_generation(sources, segments(micro), tokens=1)


def test_a_prompt_past_the_context_is_refused(micro: DecoderSource) -> None:
    segs = segments(micro)
    segs[COORDINATOR] = np.full(30, 5)
    with pytest.raises(ProtocolError, match="past the model's context"):
        run_generation(micro, segs, tokens=2)


# -- retrieval, re-ranking, the rag stage, the Flower app -----------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def test_the_app_toml_matches_the_defaults() -> None:
    import tomllib

    from fedfm.protocols.fedrag.defaults import DEFAULTS
    from fedfm.runtime.settings import RUN_CONFIG_DEFAULTS

    app = tomllib.loads((ROOT / "simulations" / "fedrag" / "pyproject.toml").read_text())
    # a round trip may include a node's first model load: the app allows 600 s, not 60
    assert app["tool"]["flwr"]["app"]["config"] == {
        **RUN_CONFIG_DEFAULTS,
        "timeout": 600.0,
        **DEFAULTS,
    }
    assert app["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "fedfm_strategies.fedrag:app",
        "clientapp": "fedfm_clients.fedrag:app",
    }


@pytest.mark.ckks
def test_ckks_scores_equal_plaintext_and_hide_partial_sums() -> None:
    from fedfm.errors import CryptoParameterError
    from fedfm.protocols.fedrag.retrieval import IndexEvaluator, QueryKeys, plaintext_scores

    rng = np.random.default_rng(5)
    index = rng.normal(size=(19, 384))
    index /= np.linalg.norm(index, axis=1, keepdims=True)
    query = index[3] + 0.2 * rng.normal(size=384)
    keys = QueryKeys.generate()
    payload = IndexEvaluator(keys.public_context()).scores(keys.encrypt_query(query), index)
    assert np.abs(keys.decrypt_scores(payload, 19) - plaintext_scores(query, index)).max() < 1e-4
    # every slot but the block totals is masked to zero: no partial sums of the owner's rows
    from fedfm.crypto import load_list

    ciphertexts = load_list(payload, keys._io, keys.fingerprint)
    import tenseal.sealapi as sealapi

    plain = sealapi.Plaintext()
    keys._decryptor.decrypt(ciphertexts[0], plain)
    values = np.asarray(keys._encoder.decode_double(plain)).reshape(-1, 512)
    assert np.abs(values[:, 1:]).max() < 1e-4
    secret = keys.secret_state()
    with pytest.raises(CryptoParameterError, match="secret key"):
        IndexEvaluator(secret)


@pytest.mark.slow
def test_scrambled_reranking_equals_the_plaintext_cross_encoder() -> None:
    from fedfm.protocols.fedrag.attention import attention_with_lse
    from fedfm.protocols.fedrag.reranking import encoder_runner, features
    from fedfm.protocols.fedrag.scrambler import draw_attention_keys, token_permutation

    encoder = encoder_runner()
    query = encoder.query_ids("return the path joined with the given names")
    document = encoder.document_ids(
        "Join two or more pathname components, inserting '/' as needed."
    )
    expected = encoder.joint_features(query, document)
    hq, hd = encoder.embed(query, 0, 0), encoder.embed(document, 1, len(query))
    for layer in range(encoder.layers):
        parts = {}
        for mine, other in ((hq, hd), (hd, hq)):
            keys = draw_attention_keys(
                LocalRandomness(), f"l{layer}", heads=encoder.heads, head_dim=encoder.head_dim
            )
            q, _, _ = encoder.qkv(layer, mine)
            _, k, v = encoder.qkv(layer, other)
            order = token_permutation(q.shape[1])
            out, lse = attention_with_lse(
                keys.scramble_queries(q.astype(np.float64))[:, order],
                keys.scramble_keys(k.astype(np.float64)),
                keys.scramble_values(v.astype(np.float64)),
                scaling=encoder.scaling,
            )
            restored, restored_lse = np.empty_like(out.numpy()), np.empty_like(lse.numpy())
            restored[:, order], restored_lse[:, order] = out.numpy(), lse.numpy()
            parts[id(mine)] = [
                (
                    torch.from_numpy(keys.unscramble_outputs(restored).astype(np.float32)),
                    torch.from_numpy(restored_lse.astype(np.float32)),
                )
            ]
        hq, hd = encoder.finish(layer, hq, parts[id(hq)]), encoder.finish(layer, hd, parts[id(hd)])
    assert np.abs(features(hq) - expected).max() < 1e-4


@pytest.mark.slow
@pytest.mark.ckks
@pytest.mark.parametrize("retrieval", ["private", "faithful"])
def test_rag_stage_retrieves_reranks_and_generates(micro: DecoderSource, retrieval: str) -> None:
    from fedfm.experiments.fedrag_data import build_data, embed
    from fedfm.protocols.fedrag.rag import join_documents
    from fedfm.protocols.fedrag.retrieval import plaintext_scores, top_k

    data = build_data(per_owner=20, questions=2)
    question = data.questions[0]
    key = os.urandom(32)
    inputs: dict[str, dict[str, np.ndarray]] = {}
    indexes = []
    for number, documents in enumerate(data.owners):
        texts = [d.text for d in documents]
        indexes.append(embed(texts))
        inputs[f"owner_{number}"] = {"documents": join_documents(texts), "index": indexes[-1]}
    query = embed([question.query])[0]
    head = np.zeros(2 * 384)
    inputs[COORDINATOR] = {
        # the micro decoder's context is 32 tokens: a short prompt (retrieval uses the embedding)
        "query_text": np.frombuffer(" ".join(question.query.split()[:3]).encode(), np.uint8),
        "query_embedding": query,
        "reranker_weight": head,  # a constant head: the re-ranker keeps the retrieval order
        "reranker_bias": np.zeros(1),
        "report_key": np.frombuffer(key, np.uint8),
    }
    config = {"stage": "rag", "retrieval": retrieval, "max-new-tokens": 2, "top-k": 3, "top-m": 1}
    # a micro decoder has a 32-token context: cut the segments to fit
    from fedfm.protocols.fedrag import rag

    previous, rag.DOCUMENT_TOKENS = rag.DOCUMENT_TOKENS, 6
    try:
        result = InProcessFederation(
            fedrag(config, decoders=micro), inputs, placement=RolePlan(2, "dedicated").placement(4)
        ).run()
    finally:
        rag.DOCUMENT_TOKENS = previous
    report = open_report(key, result.outputs[COORDINATOR]["report"])
    scores = [
        (s, o, i)
        for o, idx in enumerate(indexes)
        for i, s in enumerate(plaintext_scores(query, idx))
    ]
    best = sorted(scores, key=lambda t: (-t[0], t[1], t[2]))[:3]
    assert np.allclose(report["retrieval_scores"], [s for s, _, _ in best], atol=1e-4)
    assert (int(report["selected_owner"][0]), int(report["selected_document"][0])) == best[0][1:]
    assert report["tokens"].shape == (2,)
    del top_k


@pytest.mark.slow
def test_flwr_run_simulation_on_four_supernodes_equals_plaintext(
    micro: DecoderSource, tmp_path: Path
) -> None:
    import subprocess
    import sys

    workspace = tmp_path / "workspace"
    command = [sys.executable, str(ROOT / "simulations" / "fedrag" / "run.py"), "--tokens", "3"]
    command += ["--decoder", str(micro.path), "--workspace", str(workspace)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=400, check=False)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "flwr run: finished:completed; SuperLink stopped" in output
    assert "tokens identical to plaintext RAG" in output
    import json

    result = json.loads((workspace / "result.json").read_text())
    assert set(result["placement"]) == {"coordinator", "owner_0", "owner_1", "compute"}
    assert len(set(result["placement"].values())) == 4
