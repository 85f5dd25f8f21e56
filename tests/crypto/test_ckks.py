"""The TenSEAL CKKS backend: keys, packing, transport checks, encrypted ViT blocks and the loss.

Most tests use :data:`CKKS_8192_REFRESH` (N = 8192, one rescale between refreshes) on a tiny
ViT (width 8, 2 heads, 5 tokens): every code path runs, with many refreshes, in seconds.
Tolerances: fresh values decrypt to about 1e-9; an encrypted block matches the plaintext
polynomial model to about 1e-6 of its output range (the tests allow 1e-4 of the range).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import tenseal as ts
import torch

from fedfm.approx.modules import clamped_count, reset_clamped
from fedfm.approx.specs import ApproxConfig
from fedfm.crypto import (
    BACKENDS,
    CKKS_8192,
    CKKS_8192_REFRESH,
    CKKS_16384,
    CkksParameters,
    ModelGeometry,
    ckks_vit,
    run_locally,
)
from fedfm.crypto.backend import drive
from fedfm.crypto.ckks import CkksBackend, CkksEvaluator, CkksKeyOwner, _digest, patchify
from fedfm.crypto.packing import SlotLayout
from fedfm.crypto.simulate import SimulateBackend
from fedfm.errors import ConfigError, CryptoParameterError, ModelError, ProtocolError
from fedfm.models.fhe_vit import FheViT
from fedfm.protocols.double_blind.config import DoubleBlindConfig
from tests.helpers import tiny_fhe_vit

pytestmark = pytest.mark.ckks  # real TenSEAL/SEAL encryption throughout

GEOMETRY = ModelGeometry(tokens=5, patch_size=4)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def backend() -> CkksBackend:
    return CkksBackend(CKKS_8192_REFRESH)


@pytest.fixture(scope="module")
def owner(backend: CkksBackend) -> CkksKeyOwner:
    return backend.create_key_owner(geometry=GEOMETRY)


@pytest.fixture(scope="module")
def evaluator(backend: CkksBackend, owner: CkksKeyOwner) -> CkksEvaluator:
    return backend.create_evaluator(owner.public_context(), GEOMETRY)


@pytest.fixture(scope="module")
def tiny() -> tuple[FheViT, torch.Tensor]:
    """A calibrated FHE-friendly ViT on 8x8 images in 4x4 patches (5 tokens) and its images."""
    return tiny_fhe_vit()


def _values(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-5.0, 5.0, size=shape)


def test_backend_is_registered_and_parameters_are_checked() -> None:
    for name, params in (("ckks", CKKS_16384), ("ckks-8192", CKKS_8192_REFRESH)):
        registered = BACKENDS[name]()
        assert isinstance(registered, CkksBackend) and registered.params == params
        assert registered.name == name
    # refresh levels of 178 and 118 bits (room for the run's budget), within 128-bit security
    assert CKKS_16384.modulus_bits == 438 and CKKS_16384.secure_128
    assert CKKS_16384.refresh_primes == 3 and CKKS_16384.levels_between_refreshes == 5
    assert sum(CKKS_16384.coeff_mod_bit_sizes[:3]) == 178 and CKKS_16384.run_budget_bits == 40
    assert CKKS_8192_REFRESH.modulus_bits == 218 and CKKS_8192_REFRESH.secure_128
    assert sum(CKKS_8192_REFRESH.coeff_mod_bit_sizes[:2]) == 118
    assert CKKS_8192_REFRESH.run_budget_bits == 30  # N = 8192 has no room for 2^-40 per run
    with pytest.raises(ConfigError, match="unknown crypto backend"):
        DoubleBlindConfig(backend="ckk")
    with pytest.raises(CryptoParameterError, match="below 128-bit security"):
        CkksBackend(CkksParameters(8192, (60, 60, 60, 60), 40))
    with pytest.raises(CryptoParameterError, match="no level between refreshes"):
        CkksBackend(CkksParameters(8192, (60, 40, 60), 40))
    with pytest.warns(UserWarning, match="INSECURE"):
        insecure = CkksBackend(CkksParameters(8192, (60, 60, 60, 60), 40), allow_insecure=True)
    with pytest.raises(CryptoParameterError, match="SEAL refused"):
        insecure.create_key_owner()


def test_layout_packs_tokens_with_copies_and_unpacks() -> None:
    layout = SlotLayout.for_tokens(4096, 5)
    assert (layout.group, layout.capacity, layout.copies, layout.wraps) == (8, 512, 3, True)
    values = _values(600, 5, 3)
    slots = layout.pack(values)
    assert slots.shape == (3, 2, 4096)
    np.testing.assert_array_equal(layout.unpack(slots, 600), values)
    # sample 1's group starts at slot 8: tokens 0..4 then copies of tokens 0..2
    np.testing.assert_array_equal(slots[0, 0, 8:16], np.r_[values[1, :, 0], values[1, :3, 0]])
    # every token shift d < 5 stays in the group except token 4 shifted by 4 (taken as -1)
    np.testing.assert_array_equal(layout.last_token(600)[0, :16], np.eye(16)[4] + np.eye(16)[12])
    # token shifts 0..4 = baby step (0..2) + giant step (0 or 3)
    assert (layout.baby_steps, layout.giant_steps()) == (3, [3])
    assert layout.rotation_steps() == sorted(
        {1, 3, -3, -5, -1} | {s * 8 * 2**j for j in range(9) for s in (1, -1)}
    )
    # 17 tokens: 32 slots, 128 samples per ciphertext at N = 8192 (64 with 33-slot groups)
    assert (SlotLayout.for_tokens(4096, 17).group, SlotLayout.for_tokens(4096, 17).capacity) == (
        32,
        128,
    )
    two = SlotLayout.for_tokens(4096, 2)  # too few tokens to drop a copy
    assert (two.group, two.copies, two.wraps) == (3, 1, False)
    with pytest.raises(ProtocolError, match="5-token groups"):
        layout.pack(_values(2, 4, 3))
    with pytest.raises(ConfigError, match="at least 8 slots"):
        SlotLayout(4096, 5, 7, True)


def test_round_trip_and_public_context(owner: CkksKeyOwner, evaluator: CkksEvaluator) -> None:
    hidden, rows = _values(7, 5, 3), _values(7, 4, seed=1)
    for values in (hidden, rows):
        batch = evaluator.load(owner.encrypt(values).to_payload())
        np.testing.assert_allclose(owner.decrypt(batch), values, atol=1e-6)
    public = ts.context_from(owner.public_context())
    assert not public.is_private()
    batch = owner.encrypt(rows)
    with pytest.raises(ValueError):  # SEAL: the public context cannot decrypt
        ts.ckks_vector_from(public, ts.ckks_vector(public, [1.0]).serialize()).decrypt()
    assert not hasattr(evaluator, "decrypt")
    assert batch.nbytes > 100_000  # ciphertexts, not values


def test_payload_rejects_foreign_truncated_tampered_and_low_level(
    backend: CkksBackend, owner: CkksKeyOwner, evaluator: CkksEvaluator
) -> None:
    other = backend.create_key_owner(geometry=GEOMETRY)
    with pytest.raises(CryptoParameterError, match="another data owner"):
        evaluator.load(other.encrypt(_values(2, 4)).to_payload())
    payload = owner.encrypt(_values(2, 4)).to_payload()
    truncated = {**payload, "blob": payload["blob"][:-100]}
    with pytest.raises(ProtocolError, match="digest"):
        evaluator.load(truncated)
    blob = payload["blob"].copy()
    blob[len(blob) // 2] ^= 1
    with pytest.raises(ProtocolError, match="digest"):
        evaluator.load({**payload, "blob": blob})
    forged = bytes(blob)  # a forger who recomputes the digest still meets SEAL's validation
    digest = _digest(payload["context"].tobytes(), payload["shape"], payload["layout"], forged)
    with pytest.raises(ProtocolError):
        evaluator.load({**payload, "digest": np.frombuffer(digest, np.uint8)})
    lowered = drive(evaluator.take(evaluator.load(payload), np.array([1, 0])), lambda _: [])
    with pytest.raises(ProtocolError, match="top level"):
        evaluator.load(lowered.to_payload())  # an upload below the top level is refused
    assert owner.decrypt(owner.load(lowered.to_payload())).shape == (2, 4)


def test_take_selects_and_permutes(owner: CkksKeyOwner, evaluator: CkksEvaluator) -> None:
    values = _values(40, 5, 2)
    batch = owner.encrypt(values)
    for order in (np.array([3, 0, 39, 7]), np.random.default_rng(1).permutation(40)):
        taken = run_locally(evaluator.take(batch, order), evaluator, owner)
        assert taken.shape == (order.size, 5, 2)
        np.testing.assert_allclose(owner.decrypt(taken), values[order], atol=1e-5)
    with pytest.raises(ProtocolError, match="distinct"):
        run_locally(evaluator.take(batch, np.array([1, 1])), evaluator, owner)


@pytest.mark.parametrize(("first", "second"), [(500, 10), (500, 20)])
def test_join_puts_a_second_batch_where_take_selects_from_both(
    owner: CkksKeyOwner, evaluator: CkksEvaluator, first: int, second: int
) -> None:
    """512 samples fit a ciphertext here: 10 samples move into the 12 free ones of the first
    batch's last ciphertext (offset 500, one rotation and a sum), 20 do not (offset 512, the
    ciphertexts appended). Either way, one take selects from both, and the offset is the
    ``simulate`` backend's (one message flow)."""
    assert evaluator.samples_per_set == 512
    for shape in ((5, 2), (3,)):  # hidden states and (n, C) rows (labels)
        a, b = _values(first, *shape), _values(second, *shape, seed=1)
        joined, offset = evaluator.join(owner.encrypt(a), owner.encrypt(b))
        simulated = SimulateBackend().create_key_owner(geometry=GEOMETRY)
        plain = SimulateBackend().create_evaluator(simulated.public_context(), GEOMETRY)
        reference, expected = plain.join(simulated.encrypt(a), simulated.encrypt(b))
        assert offset == expected == (500 if second == 10 else 512)
        assert joined.shape == reference.shape == (offset + second, *shape)
        rows = np.array([offset + second - 1, 0, first - 1, offset, offset + 3])
        taken = run_locally(evaluator.take(joined, rows), evaluator, owner)
        both = np.concatenate([a, np.zeros((offset - first, *shape)), b])
        np.testing.assert_allclose(owner.decrypt(taken), both[rows], atol=1e-5)
    with pytest.raises(ProtocolError, match="cannot join"):
        evaluator.join(owner.encrypt(_values(4, 5, 2)), owner.encrypt(_values(4, 3)))


def test_embedding_and_blocks_match_the_plaintext_model(
    tiny: tuple[FheViT, torch.Tensor], owner: CkksKeyOwner, evaluator: CkksEvaluator
) -> None:
    model, images = tiny
    count = 6
    with torch.no_grad():
        hidden = model.embed(images[:count])
        first = model.block(0, hidden)
        second = model.block(1, first)
        reset_clamped(model)
        model.block(1, model.block(0, hidden))
    assert clamped_count(model) == 0  # the reference evaluates the same polynomials
    embedded = run_locally(
        evaluator.embed(model, owner.encrypt(images[:count].numpy())), evaluator, owner
    )
    np.testing.assert_allclose(owner.decrypt(embedded), hidden.numpy(), atol=1e-5)
    before = evaluator.circuit.stats.refreshes
    out = run_locally(evaluator.evaluate_block(model, 0, embedded), evaluator, owner)
    assert evaluator.circuit.stats.refreshes > before
    got = owner.decrypt(out)
    span = float(first.abs().max())
    assert np.abs(got - first.numpy()).max() <= TOLERANCE * span
    # chained without the client: the token copies are rebuilt on the server
    assert not out.copies
    out = run_locally(evaluator.evaluate_block(model, 1, out), evaluator, owner)
    assert np.abs(owner.decrypt(out) - second.numpy()).max() <= TOLERANCE * float(
        second.abs().max()
    )


def test_mlp_folds_two_features_per_ciphertext_at_half_the_capacity(
    tiny: tuple[FheViT, torch.Tensor], owner: CkksKeyOwner, evaluator: CkksEvaluator
) -> None:
    """Up to half the batch capacity the MLP's hidden layer is folded (two features per
    ciphertext), above it not; both match the plaintext block, folded with half the GELU's
    refreshed ciphertexts."""
    model, images = tiny
    unfolded = evaluator.layout.capacity // 2 + 1
    with torch.no_grad():
        hidden = model.embed(images[torch.arange(unfolded) % len(images)])
        reset_clamped(model)
        expected = model.block(0, hidden).numpy()
    assert clamped_count(model) == 0
    hidden_layer = {}
    for count in (unfolded, 6):
        assert evaluator.layout.folds(count) == (count == 6)
        stats = evaluator.circuit.stats
        before = len(stats.places)
        batch = owner.encrypt(hidden[:count].numpy())
        out = run_locally(evaluator.evaluate_block(model, 0, batch), evaluator, owner)
        got = owner.decrypt(out)
        span = float(np.abs(expected[:count]).max())
        assert np.abs(got - expected[:count]).max() <= TOLERANCE * span
        hidden_layer[count] = sum(
            int(place.rsplit(":", 1)[1])
            for place in stats.places[before:]
            if place.rsplit(":", 1)[0].endswith(("/gelu", "/fc2"))
        )
    assert hidden_layer[unfolded] > 0 and hidden_layer[6] * 2 == hidden_layer[unfolded]


def test_block_client_sees_only_masked_values(
    tiny: tuple[FheViT, torch.Tensor], owner: CkksKeyOwner, evaluator: CkksEvaluator
) -> None:
    """Every refresh the client answers holds coefficients spread over the mask's range."""
    model, images = tiny
    batch = owner.encrypt(torch.no_grad()(model.embed)(images[:4]).numpy())
    refresher, client = evaluator.circuit.refresher, owner._refresher
    smallest = []

    def refresh(items: list) -> list:
        for item in items:
            smallest.append(np.abs(client.observe(item).astype(float)).max())
        return evaluator.refreshed(owner.refresh(evaluator.refresh_payload(items)))

    charged = refresher.budget.charged
    drive(evaluator.evaluate_block(model, 0, batch), refresh)
    assert smallest and min(smallest) > 2.0 ** (refresher.mask_bits - 2)
    assert max(smallest) <= refresher.bound.accepted  # the client accepted every one
    # every refreshed ciphertext was charged to the run's budget (2^-30 for this set)
    assert refresher.budget.charged - charged == len(smallest)
    assert refresher.budget.spent <= refresher.budget.budget == 2.0**-30


def test_encrypted_loss_matches_simulate(owner: CkksKeyOwner, evaluator: CkksEvaluator) -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 3))
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    y = np.eye(3)[rng.integers(0, 3, size=6)]
    simulate = SimulateBackend()
    key = simulate.create_key_owner(seed=1)
    expected = drive(
        simulate.create_evaluator(key.public_context()).cross_entropy(
            key.encrypt(p), key.encrypt(np.log(p)), key.encrypt(y)
        ),
        lambda _: [],
    )
    loss, grad = run_locally(
        evaluator.cross_entropy(owner.encrypt(p), owner.encrypt(np.log(p)), owner.encrypt(y)),
        evaluator,
        owner,
    )
    np.testing.assert_allclose(owner.decrypt(loss)[0, 0], expected[0].values[0], atol=1e-4)
    np.testing.assert_allclose(owner.decrypt(grad), expected[1].values, atol=1e-5)


def test_models_that_are_not_polynomial_are_refused(
    tiny: tuple[FheViT, torch.Tensor], owner: CkksKeyOwner, evaluator: CkksEvaluator
) -> None:
    model, images = tiny
    exact = model.with_approx(ApproxConfig.exact())
    batch = owner.encrypt(images[:2].numpy())
    with pytest.raises(ModelError, match="polynomials only"):
        run_locally(evaluator.embed(exact, batch), evaluator, owner)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ("norm2", "not the approximated LayerNorm"),
        ("act", "not the approximated GELU"),
        ("ls1", "layer scale"),
    ],
)
def test_a_block_ckks_cannot_evaluate_is_refused_by_name(
    tiny: tuple[FheViT, torch.Tensor], part: str, message: str
) -> None:
    """Each block is checked part by part before any ciphertext is touched."""
    model, _ = tiny
    changed = copy.deepcopy(model)
    block = changed.vit.blocks[changed.num_blocks - 1]
    owner = block.mlp if part == "act" else block
    setattr(owner, part, torch.nn.GELU() if part == "act" else torch.nn.LayerNorm(8))
    ckks_vit.check_encryptable(model)  # the unchanged model passes
    with pytest.raises(ModelError, match=f"block {changed.num_blocks - 1}: .*{message}"):
        ckks_vit.check_encryptable(changed)


def test_restored_owner_decrypts_and_refreshes(
    backend: CkksBackend, owner: CkksKeyOwner, evaluator: CkksEvaluator
) -> None:
    restored = backend.restore_key_owner(owner.secret_state())
    values = _values(3, 5, 2)
    np.testing.assert_allclose(restored.decrypt(owner.encrypt(values)), values, atol=1e-6)
    with pytest.raises(ProtocolError, match="restored"):
        restored.public_context()
    with pytest.raises(CryptoParameterError, match="lacks"):
        backend.restore_key_owner({})
    with pytest.raises(CryptoParameterError):
        CkksBackend(CKKS_8192).restore_key_owner(owner.secret_state())


def test_patchify_matches_the_patch_embedding(tiny: tuple[FheViT, torch.Tensor]) -> None:
    model, images = tiny
    conv = model.vit.patch_embed.proj
    patches = patchify(images[:2].numpy(), 4, 5)
    weight = conv.weight.detach().numpy().reshape(conv.out_channels, -1)
    with torch.no_grad():
        expected = model.vit.patch_embed(images[:2]).numpy()
    np.testing.assert_allclose(
        patches[:, 1:] @ weight.T + conv.bias.detach().numpy(), expected, atol=1e-5
    )
    assert not patches[:, 0].any()
    with pytest.raises(ProtocolError, match="patch tokens"):
        patchify(images[:2].numpy(), 4, 17)


@pytest.mark.slow
def test_bench_ckks_writes_cost_error_and_the_headline_figure(tmp_path) -> None:
    """The benchmark on a micro student: one block per batch size and a full forward pass."""
    import json

    from fedfm.distillation.pipeline import DistillRun, load_data
    from fedfm.experiments.bench_ckks import run_ckks_benchmark
    from tests.helpers import save_micro_student

    run = DistillRun(model="vit_fedfm_micro", image_size=8, max_samples=60, workdir=tmp_path)
    splits, _ = load_data(run)
    save_micro_student(tmp_path, splits)
    rows = run_ckks_benchmark(
        run,
        backend_name="ckks-8192",
        batch_sizes=(2, 4),
        forward_batch=3,
        repeats=3,
        results_dir=tmp_path / "results",
        log=lambda _: None,
        command="fedfm bench-ckks --test",
    )
    report = json.loads((tmp_path / "results" / "ckks_block_ckks-8192.json").read_text())
    assert [row["batch_size"] for row in rows] == [2, 4]
    assert report["seconds_per_sample_per_block"] == rows[-1]["seconds_per_sample_per_block"]
    assert report["command"] == "fedfm bench-ckks --test" and report["repeats"] == 3
    for row in rows:
        runs = row["seconds_per_block_runs"]  # every run, sorted; the row is the median one
        assert len(runs) == 3 and runs == sorted(runs) and row["seconds_per_block"] == runs[1]
        assert row["refreshes"] > 0 and row["round_trips"] == row["refreshes"] + 1
        assert row["error_over_range"] < 1e-3 and row["bytes_per_sample_per_block"] > 0
        assert row["seconds_per_block_deployment"] > row["seconds_per_block_simulation"]
        # CPU of this process and of each worker the backend has (FEDFM_CKKS_WORKERS)
        assert row["cpu_seconds_this_process"] > 0
        assert len(row["cpu_seconds_per_worker"]) == report["worker_processes"]
        assert all(seconds >= 0 for seconds in row["cpu_seconds_per_worker"])
    spent = report["server_seconds_by_operation"]["4"]
    assert {"rotations", "plaintext products", "ciphertext products", "refresh masks"} <= set(spent)
    assert sum(spent.values()) <= rows[-1]["server_seconds"]
    forward = report["forward_pass"]
    assert forward["predictions_agree"] == forward["samples"] == 3
    # the refresh budget of the run and the releases' cost are recorded
    budget = report["refresh_budget"]
    per_block = rows[-1]["refreshed_ciphertexts"]
    assert budget["refreshed_ciphertexts_per_block"] == per_block
    assert budget["log2_run_budget"] == -30 and budget["rated_refreshed_ciphertexts"] == 2**19
    assert budget["blocks_per_rated_run"] == 2**19 // per_block
    assert budget["log2_bound_per_block"] == pytest.approx(
        budget["log2_distance_per_ciphertext"] + np.log2(per_block)
    )
    assert str(budget["rated_refreshed_ciphertexts"]) in budget["run_length_assumed"]
    privacy = report["circuit_privacy"]
    assert privacy["flood_bits"] == 20 and privacy["release_seconds_per_block"] > 0
    assert privacy["max_abs_error_after_release"] > privacy["max_abs_error_before_release"]
    assert report["refresh_calibration"] is None  # only with --calibrate
    run_ckks_benchmark(
        run,
        backend_name="ckks-8192",
        batch_sizes=(2,),
        calibrate=True,
        results_dir=tmp_path / "calibrated",
        log=lambda _: None,
    )
    calibration = json.loads((tmp_path / "calibrated" / "ckks_block_ckks-8192.json").read_text())[
        "refresh_calibration"
    ]
    # the GELU plans its output's level for fc2 (the look-ahead placement), so the MLP's
    # refreshes sit at fc1's input and inside the GELU, none at fc2 any more
    assert {"block*/exp", "block*/qkv", "block*/fc1", "block*/gelu"} <= set(calibration)
    # every refreshed value of the micro student stays inside the calibrated bound 2^14
    assert all(np.isfinite(v) and v < 14 for v in calibration.values())
    with pytest.raises(ConfigError, match="not 'simulate'"):
        run_ckks_benchmark(run, backend_name="simulate", results_dir=tmp_path)
    with pytest.raises(ConfigError, match="repeats must be >= 1"):
        run_ckks_benchmark(run, backend_name="ckks-8192", repeats=0, results_dir=tmp_path)
    with pytest.raises(ConfigError, match="batch sizes must be >= 1"):
        run_ckks_benchmark(run, backend_name="ckks-8192", batch_sizes=(0,))


def test_the_exponential_runs_scaled_down_so_refreshed_values_stay_in_the_bound() -> None:
    """The circuit evaluates ``p(x) / o`` as a polynomial in ``x / s``: the same values divided
    by ``o``, while the powers it refreshes are those of ``x / s`` (at logits of 17, ``x^6`` alone
    is 2^24.5, far beyond the refresh's calibrated 2^14)."""
    from fedfm.approx.evaluate import polyval
    from fedfm.approx.specs import taylor_exp
    from fedfm.crypto.ckks_vit import SOFTMAX_INPUT_SCALE, SOFTMAX_OUTPUT_SCALE, _scaled_exp

    spec = taylor_exp(6)
    scaled = _scaled_exp(spec)
    x = np.linspace(-17.0, 17.0, 101)
    np.testing.assert_allclose(
        polyval(scaled, x / SOFTMAX_INPUT_SCALE),
        polyval(spec, x) / SOFTMAX_OUTPUT_SCALE,
        rtol=1e-12,
    )
    assert np.abs(x / SOFTMAX_INPUT_SCALE).max() ** 6 < 2**13 < np.abs(x).max() ** 6
