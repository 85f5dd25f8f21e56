"""Masked client-assisted refresh of CKKS ciphertexts, and the raw SEAL access beneath it."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import tenseal as ts
import tenseal.sealapi as sealapi
from scipy import stats

from fedfm.crypto import CKKS_16384, seal_memory, seal_raw
from fedfm.crypto.refresh import (
    FRESH_NOISE_PER_DEGREE,
    RUN_DISTANCE_BUDGET,
    ZERO_NOISE_ETA,
    MaskedCiphertext,
    RefreshBound,
    RefreshBudget,
    RefreshClient,
    RefreshServer,
    _Chain,
    observe_masked,
    sample_centered_binomial,
    sample_ternary,
    sample_uniform_mask,
    sample_uniform_residues,
    seal_deserialize,
    seal_serialize,
    secure_random_bytes,
)
from fedfm.crypto.seal_raw import (
    RawCiphertext,
    SealIO,
    crt_lift,
    crt_lift_many,
    dumps,
    mulmod,
    primes_of,
    read_ciphertext,
    read_plaintext,
    seal_bytes,
    write_ciphertext,
    write_plaintext,
)
from fedfm.errors import CryptoParameterError, ProtocolError

pytestmark = pytest.mark.ckks  # real TenSEAL/SEAL encryption throughout

SMALL = (60, 58, 40, 60)  # N = 8192: top [q0, q1, q2], refresh [q0, q1], one level between
DEEP = (60, 60, 40, 40, 40, 40, 40, 40, 60)  # N = 16384, 420 bits, six levels between
SCALE = 2.0**40


def _contexts(degree: int, bits: tuple[int, ...]) -> tuple[ts.Context, ts.Context]:
    """A private context and its public counterpart, serialized as ``fedfm.crypto.ckks`` does."""
    private = ts.context(ts.SCHEME_TYPE.CKKS, degree, coeff_mod_bit_sizes=list(bits))
    private.global_scale = SCALE
    data = private.serialize(
        save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )
    return private, ts.context_from(data)


@pytest.fixture(scope="module")
def keys() -> tuple[ts.Context, ts.Context]:
    return _contexts(8192, SMALL)


@pytest.fixture(scope="module")
def server(keys: tuple[ts.Context, ts.Context]) -> RefreshServer:
    return RefreshServer(keys[1])


@pytest.fixture(scope="module")
def client(keys: tuple[ts.Context, ts.Context]) -> RefreshClient:
    return RefreshClient(keys[0])


def _seal(context: ts.Context):
    return context.seal_context().data


def _encrypt(context: ts.Context, values: np.ndarray, scale: float = SCALE) -> sealapi.Ciphertext:
    seal_context = _seal(context)
    plain = sealapi.Plaintext()
    sealapi.CKKSEncoder(seal_context).encode(
        values.tolist(), seal_context.first_parms_id(), scale, plain
    )
    ciphertext = sealapi.Ciphertext(seal_context)
    sealapi.Encryptor(seal_context, context.public_key().data).encrypt(plain, ciphertext)
    return ciphertext


def _decrypt(context: ts.Context, ciphertext: sealapi.Ciphertext, count: int) -> np.ndarray:
    seal_context = _seal(context)
    plain = sealapi.Plaintext()
    sealapi.Decryptor(seal_context, context.secret_key().data).decrypt(ciphertext, plain)
    return np.asarray(sealapi.CKKSEncoder(seal_context).decode_double(plain))[:count]


def _times(context: ts.Context, ciphertext: sealapi.Ciphertext, factor: float):
    """``ciphertext * factor`` rescaled: one level down (the server's public context suffices)."""
    seal_context = _seal(context)
    plain = sealapi.Plaintext()
    sealapi.CKKSEncoder(seal_context).encode(factor, ciphertext.parms_id(), SCALE, plain)
    evaluator = sealapi.Evaluator(seal_context)
    out = sealapi.Ciphertext(seal_context)
    evaluator.multiply_plain(ciphertext, plain, out)
    evaluator.rescale_to_next_inplace(out)
    return out


def _chain_of(context: ts.Context) -> _Chain:
    return _Chain(context)


def _wire(context: ts.Context, ciphertext) -> sealapi.Ciphertext:
    return seal_deserialize(context, seal_serialize(ciphertext))


def _level(context: ts.Context, ciphertext) -> int:
    return _seal(context).get_context_data(ciphertext.parms_id()).chain_index()


# --- raw SEAL access -----------------------------------------------------------------------


@pytest.fixture(params=["memory", "files"])
def access(request, monkeypatch):
    """Both ways into SEAL: its objects' memory (the default here) and save/load files."""
    if request.param == "memory":
        assert seal_raw.direct_memory_available(), "direct SEAL memory access failed its probe"
    else:
        monkeypatch.setattr(seal_raw, "direct_memory_available", lambda: False)
    return request.param


def test_ciphertext_layout_matches_seal(keys, access):
    private, _ = keys
    assert SealIO(private).direct is (access == "memory")
    ciphertext = _encrypt(private, np.linspace(-1, 1, 100))
    raw = read_ciphertext(ciphertext)
    assert raw.parms_id == tuple(ciphertext.parms_id())
    assert raw.is_ntt_form == ciphertext.is_ntt_form()
    assert raw.scale == ciphertext.scale
    assert raw.data.shape == (ciphertext.size(), ciphertext.coeff_modulus_size(), 8192)
    flat = raw.data.ravel()
    for index in (0, 1, 8192 * 2 + 5, flat.size - 1):
        assert int(flat[index]) == ciphertext[index]
    primes = primes_of(_seal(private), raw.parms_id)
    assert all((raw.data[:, j] < p).all() for j, p in enumerate(primes))

    copy = write_ciphertext(private, raw)
    assert np.array_equal(read_ciphertext(copy).data, raw.data)
    assert np.allclose(_decrypt(private, copy, 100), np.linspace(-1, 1, 100), atol=1e-6)
    bad = RawCiphertext(raw.parms_id, True, raw.scale, raw.data + np.uint64(primes[-1]))
    with pytest.raises(ProtocolError, match=r"SEAL refused|not reduced modulo prime"):
        write_ciphertext(private, bad)  # every word is checked against its prime


def test_compact_wire_format_round_trips_and_refuses_damage(keys, access):
    private, _ = keys
    ciphertext = _encrypt(private, np.linspace(-1, 1, 100))
    io = SealIO(private)
    blob = dumps(ciphertext)
    primes = primes_of(_seal(private), tuple(ciphertext.parms_id()))
    # residues take the bytes of their prime (58 -> 8, 40 -> 5): smaller than SEAL's zstd file
    widths = [-(-p.bit_length() // 8) for p in primes]
    header = 4 + 32 + 4 + 8 + 8  # magic, parms_id, four bytes, scale, correction factor
    assert len(blob) == header + len(primes) + 2 * 8192 * sum(widths)
    assert len(blob) < len(seal_bytes(ciphertext))
    for source in (blob, seal_bytes(ciphertext)):  # both formats load
        copy = io.load_ciphertext(source)
        assert np.array_equal(read_ciphertext(copy).data, read_ciphertext(ciphertext).data)
        assert copy.scale == ciphertext.scale and copy.parms_id() == ciphertext.parms_id()
    with pytest.raises(ProtocolError, match="truncated"):
        io.load_ciphertext(blob[:-1])
    with pytest.raises(ProtocolError, match="widths"):
        io.load_ciphertext(blob[:header] + b"\x09" + blob[header + 1 :])
    foreign = bytearray(blob)
    foreign[4:12] = b"\x01" * 8  # a parms_id that is not in this context's chain
    with pytest.raises(ProtocolError, match="not in this context's modulus chain"):
        io.load_ciphertext(bytes(foreign))
    unreduced = bytearray(blob)
    start = header + 3 + 2 * 8192 * widths[0]  # prime 1's residues: set one to 2^40 - 1
    unreduced[start : start + widths[1]] = b"\xff" * widths[1]
    with pytest.raises(ProtocolError, match=r"SEAL refused|not reduced modulo prime"):
        io.load_ciphertext(bytes(unreduced))
    io.close()


def test_memory_access_can_be_switched_off(monkeypatch):
    seal_raw.direct_memory_available.cache_clear()
    monkeypatch.setenv(seal_memory.SWITCH_VARIABLE, "0")
    try:
        assert not seal_raw.direct_memory_available()
    finally:
        seal_raw.direct_memory_available.cache_clear()
    monkeypatch.delenv(seal_memory.SWITCH_VARIABLE)
    assert seal_raw.direct_memory_available()


def test_plaintext_layout_and_ntt_round_trip(keys, access):
    private, _ = keys
    seal_context = _seal(private)
    plain = sealapi.Plaintext()
    sealapi.CKKSEncoder(seal_context).encode(
        [0.5, -2.0], seal_context.first_parms_id(), SCALE, plain
    )
    raw = read_plaintext(private, plain)
    assert raw.parms_id == tuple(plain.parms_id()) and raw.scale == plain.scale
    assert raw.data.shape == (3, 8192) and raw.data.size == plain.coeff_count()
    assert int(raw.data[1, 3]) == plain[8192 + 3]
    copy = write_plaintext(private, raw)
    assert copy.is_ntt_form() and np.array_equal(read_plaintext(private, copy).data, raw.data)

    # The inverse NTT through SEAL gives the encoded integer polynomial: small coefficients.
    io = SealIO(private)
    coefficients = io.from_ntt(raw.parms_id, raw.data[None])[0]
    primes = primes_of(seal_context, raw.parms_id)
    lifted = crt_lift(coefficients[0], coefficients[1], primes[0], primes[1])
    assert np.abs(lifted.to_float()).max() <= 2.0 * SCALE
    assert np.array_equal(lifted.residues(primes), coefficients)
    assert np.array_equal(io.to_ntt(raw.parms_id, coefficients[None])[0], raw.data)

    # SEAL refuses a ciphertext whose c1 is zero ("transparent") in the transforms; the helpers
    # append a guard polynomial, so even all-zero inputs go through.
    transparent = io.write_ciphertext(
        RawCiphertext(raw.parms_id, False, 1.0, np.stack([coefficients, 0 * coefficients]))
    )
    with pytest.raises(Exception, match="transparent"):
        sealapi.Evaluator(seal_context).transform_to_ntt_inplace(transparent)
    zeros = np.zeros((20, 3, 8192), dtype=np.uint64)  # more than one scratch ciphertext holds
    assert not io.to_ntt(raw.parms_id, zeros).any()

    # A residue row's transform depends on its prime only: the refresh mask's material takes the
    # refresh level's rows from one top-level transform.
    lower = seal_context.get_context_data(raw.parms_id).next_context_data().parms_id()
    assert np.array_equal(io.to_ntt(tuple(lower), coefficients[None, :2])[0], raw.data[:2])
    io.close()


def test_mulmod_and_crt_lift_match_python_integers():
    generator = random.Random(5)
    primes = [288230376150876161, 1099510890497, 1099511480321, 97, (1 << 60) - 93]
    for p in primes:
        a = [generator.randrange(p) for _ in range(500)] + [0, p - 1]
        for b in (0, 1, p - 1, generator.randrange(p), generator.randrange(1 << 90)):
            got = mulmod(np.array(a, dtype=np.uint64), b, p)
            assert got.tolist() == [x * b % p for x in a]
    q0, q1 = primes[:2]
    half = q0 * q1 // 2
    xs = [generator.randrange(-half, half + 1) for _ in range(2000)] + [half, -half, 0, 1, -1]
    r0 = np.array([x % q0 for x in xs], dtype=np.uint64)
    r1 = np.array([x % q1 for x in xs], dtype=np.uint64)
    lifted = crt_lift(r0, r1, q0, q1)
    assert lifted.to_int().tolist() == xs
    assert lifted.residues(primes).tolist() == [[x % p for x in xs] for p in primes]


def test_mask_sampler_is_uniform_on_the_closed_interval():
    rng = np.random.default_rng(11)
    q0, q1 = 288230376150876161, 1099510890497
    small = sample_uniform_mask(17_000, 3, [q0, q1, 97], rng.bytes)
    values = crt_lift(small[0], small[1], q0, q1).to_int().astype(np.int64)
    counts = np.bincount(values + 8, minlength=17)
    assert counts.size == 17 and values.min() == -8 and values.max() == 8
    assert np.abs(counts / 1000 - 1).max() < 0.15  # 17 values, 1000 expected each
    assert np.array_equal(small[2], values % 97)
    for bits in (61, 62, 63, 95):  # both limb layouts and the switch between them
        limbs = sample_uniform_mask(4096, bits, [q0, q1, 1099511480321], rng.bytes)
        lifted = crt_lift(limbs[0], limbs[1], q0, q1)
        drawn = lifted.to_float() / 2.0**bits
        assert np.abs(drawn).max() <= 1.0 and drawn.max() > 0.99 and drawn.min() < -0.99
        assert np.array_equal(lifted.residues([1099511480321])[0], limbs[2])
    # three limbs, lifted over three primes (the 178-bit refresh level)
    primes = [1152921504606584833, 1152921504606748673, 288230376151388161]  # 178 bits
    limbs = sample_uniform_mask(4096, 175, [*primes, 97], rng.bytes)
    lifted = crt_lift_many(limbs[:3], primes)
    drawn = np.array([float(x) for x in lifted.to_int()]) / 2.0**175
    assert np.abs(drawn).max() <= 1.0 and drawn.max() > 0.99 and drawn.min() < -0.99
    assert abs(drawn.mean()) < 0.05 and drawn.std() == pytest.approx(1 / np.sqrt(3), rel=0.05)
    assert np.array_equal(lifted.residues([97])[0], limbs[3])


def test_crt_lift_many_and_its_range_test_match_python_integers():
    primes = [1152921504606584833, 1152921504606748673, 288230376151388161]
    modulus = math.prod(primes)
    rng = random.Random(5)
    values = [rng.randrange(-(modulus // 2), modulus // 2) for _ in range(500)]
    values += [modulus // 2, -(modulus // 2) + 1, 0, 1, -1, 2**116 + 5, -(2**116) - 5, 2**116]
    residues = [np.array([v % p for v in values], dtype=np.uint64) for p in primes]
    lifted = crt_lift_many(residues, primes)
    assert list(lifted.to_int()) == values
    assert list(lifted.residues([97])[0]) == [v % 97 for v in values]
    for bound in (0, 5, 2**116, 2**116 + 4, modulus // 2 - 1):
        assert list(lifted.within(bound)) == [abs(v) <= bound for v in values]


# --- the protocol --------------------------------------------------------------------------


def test_samplers_of_the_encryption_of_zero():
    ternary = sample_ternary(30_000, secure_random_bytes)
    counts = np.bincount(ternary + 1, minlength=3)
    assert counts.size == 3 and np.abs(counts / 10_000 - 1).max() < 0.05
    noise = sample_centered_binomial(50_000, ZERO_NOISE_ETA, secure_random_bytes)
    assert np.abs(noise).max() <= ZERO_NOISE_ETA
    assert abs(noise.mean()) < 0.05 and abs(noise.var() / (ZERO_NOISE_ETA / 2) - 1) < 0.05
    assert secure_random_bytes(32) != secure_random_bytes(32)
    primes = [97, 1099510890497]
    uniform = sample_uniform_residues(3, 9700, primes, secure_random_bytes)
    assert uniform.shape == (3, 2, 9700) and (uniform[:, 1] < primes[1]).all()
    counts = np.bincount(uniform[:, 0].ravel().astype(np.int64), minlength=97)
    assert counts.size == 97 and np.abs(counts / 300 - 1).max() < 0.35  # 300 expected each
    assert abs(float(uniform[:, 1].mean()) / (primes[1] / 2) - 1) < 0.01
    with pytest.raises(CryptoParameterError, match="eta"):
        sample_centered_binomial(8, 40, secure_random_bytes)


def test_mask_material_decrypts_to_the_mask_plus_small_noise(keys, server):
    private, _ = keys
    material = server.prepare()
    observed = _client_view(private, material.offset)  # decryption of Enc(0) + (r, 0)
    r = -_lift_plaintext(private, material.negated)  # the server's own r
    noise = observed - r
    degree = 8192
    assert np.abs(noise).max() <= FRESH_NOISE_PER_DEGREE * degree
    assert np.abs(noise).max() > 0  # an encryption, not a bare r
    # divided down from the level above: the rounding's spread (about 0.3 sqrt(2N/3) = 21), not
    # that of u e_pk + e1 s (about 3.2 sqrt(4N/3) = 330)
    assert float(np.std(noise.astype(np.float64))) < 60
    other = server.prepare()
    first_c1 = read_ciphertext(material.offset).data[1]
    assert not np.array_equal(first_c1, read_ciphertext(other.offset).data[1])


def _client_view(private: ts.Context, ciphertext) -> np.ndarray:
    """The centered integer coefficients the secret key decrypts ``ciphertext`` to."""
    return RefreshClient(private).observe(ciphertext).astype(object)


def _lift_plaintext(private: ts.Context, plaintext) -> np.ndarray:
    """Centered integer coefficients (modulo q0 q1) of a top-level NTT-form plaintext."""
    io = SealIO(private)
    raw = read_plaintext(private, plaintext)
    coefficients = io.from_ntt(raw.parms_id, raw.data[None])[0]
    primes = primes_of(_seal(private), raw.parms_id)
    return crt_lift(coefficients[0], coefficients[1], primes[0], primes[1]).to_int()


@pytest.fixture
def fresh_pair(keys, access):
    """A server and client built under ``access`` (SEAL's memory or its files)."""
    return RefreshServer(keys[1]), RefreshClient(keys[0])


def test_round_trip_refreshes_to_the_top_level(keys, fresh_pair):
    private, public = keys
    server, client = fresh_pair
    values = np.random.default_rng(0).uniform(-300, 300, 4096)
    ciphertext = _times(public, _wire(public, _encrypt(private, values)), 0.5)
    assert (
        _level(public, ciphertext) == 1 and tuple(ciphertext.parms_id()) == server.refresh_parms_id
    )

    masked, mask = server.mask(ciphertext)
    masked = MaskedCiphertext.from_bytes(private, masked.to_bytes())  # over the wire
    fresh = _wire(public, client.refresh(masked))
    result = server.unmask(fresh, mask)

    assert tuple(result.parms_id()) == server.top_parms_id == client.top_parms_id
    assert result.scale == ciphertext.scale
    assert np.abs(_decrypt(private, result, 4096) - 0.5 * values).max() < 1e-6
    again = _times(public, result, 0.25)  # a level to spend again
    assert np.abs(_decrypt(private, again, 4096) - 0.125 * values).max() < 1e-6


def test_refresh_many_and_masking_from_the_top_level(keys, server, client):
    private, _ = keys
    rng = np.random.default_rng(1)
    batches = [rng.uniform(-5, 5, 100) for _ in range(3)]
    ciphertexts = [_encrypt(private, values) for values in batches]  # top level: mod-switched
    pairs = [server.mask(ciphertext) for ciphertext in ciphertexts]
    fresh = client.refresh_many([masked for masked, _ in pairs])
    for values, (_, mask), refreshed in zip(batches, pairs, fresh, strict=True):
        result = server.unmask(refreshed, mask)
        assert np.abs(_decrypt(private, result, 100) - values).max() < 1e-6
    assert client.refresh_many([]) == []


def test_server_needs_only_the_public_key(keys, server):
    private, public = keys
    assert not public.is_private() and private.is_private()
    with pytest.raises(CryptoParameterError, match="secret key"):
        RefreshServer(private)
    with pytest.raises(CryptoParameterError, match="secret key"):
        RefreshClient(public)
    # The mask re-randomises c1: it no longer equals the (server-computed) input's c1.
    ciphertext = _times(public, _encrypt(private, np.ones(8)), 2.0)
    masked, _ = server.mask(ciphertext)
    assert not np.array_equal(
        read_ciphertext(masked.ciphertext).data[1], read_ciphertext(ciphertext).data[1]
    )


def test_deep_chain_at_16384():
    """Two refresh levels at N = 16384: two primes (120 bits, six levels between refreshes) and
    the backend's three (178 bits, five levels): the mask, lift and range check work on both."""
    for bits, primes, mask_bits, levels in (
        (DEEP, 2, 117, 6),
        (CKKS_16384.coeff_mod_bit_sizes, 3, 175, 5),
    ):
        private, public = _contexts(16384, bits)
        server = RefreshServer(public, refresh_primes=primes)
        client = RefreshClient(private, refresh_primes=primes)
        assert server.mask_bits == mask_bits  # 2B + T < q_ref / 2
        assert server.bound == client.bound and server.refresh_index == primes - 1
        assert server.bound.per_ciphertext == pytest.approx(16384 * server.bound.per_coefficient)
        values = np.random.default_rng(2).uniform(-300, 300, 8192)
        ciphertext = _encrypt(private, values)
        for _ in range(levels):  # spend every level above the refresh level
            ciphertext = _times(public, ciphertext, 1.0)
        assert tuple(ciphertext.parms_id()) == server.refresh_parms_id
        masked, mask = server.mask(ciphertext)
        view = np.asarray(client.observe(masked), dtype=object)
        assert max(abs(int(x)) for x in view) > 2 ** (mask_bits - 1)  # the mask's full width
        result = server.unmask(client.refresh(masked), mask)
        assert _level(public, result) == levels + primes - 1
        assert np.abs(_decrypt(private, result, 8192) - values).max() < 1e-6
    assert RefreshServer(public, refresh_primes=3, value_bits=20).bound.rated_ciphertexts() >= 2**62


def test_client_view_is_statistically_independent_of_the_message(keys, client):
    private, public = keys
    server = RefreshServer(public, rng=np.random.default_rng(3))  # reproducible masks
    assert server.bound.per_coefficient <= 2.0**-59  # 2^57 / (2^116 + 1)
    big = 2.0**server.mask_bits

    first = np.random.default_rng(4).uniform(-300, 300, 4096)
    second = np.full(4096, 1000.0)
    views, plains = [], []
    for values in (first, second):
        ciphertext = _times(public, _encrypt(private, values), 1.0)
        plain = observe_masked(client, ciphertext).astype(np.float64)  # unmasked m + e
        # Coefficients are bounded by scale * max |slot| (canonical embedding), far below B.
        assert np.abs(plain).max() <= ciphertext.scale * np.abs(values).max() * (1 + 1e-9)
        assert np.abs(plain).max() < server.bound.value_bound
        plains.append(plain)
        views.append(observe_masked(client, server.mask(ciphertext)[0]).astype(np.float64))

    for view, plain in zip(views, plains, strict=True):
        scaled = view / big
        assert np.abs(scaled).max() <= 1.0 + 2.0**-60 and np.abs(scaled).max() > 0.5
        assert abs(scaled.mean()) < 0.05  # standard error 1 / sqrt(3 * 8192) ~ 0.006
        assert scaled.std() == pytest.approx(1 / np.sqrt(3), rel=0.05)
        assert abs(np.corrcoef(view, plain)[0, 1]) < 0.05
    # Two very different messages (spread slots vs. a constant): indistinguishable views.
    assert stats.ks_2samp(views[0], views[1]).pvalue > 1e-3


# --- errors --------------------------------------------------------------------------------


def test_ciphertext_below_the_refresh_level_is_refused(keys, server, client):
    private, public = keys
    ciphertext = _times(public, _times(public, _encrypt(private, np.ones(4)), 1.0), 1.0)
    assert _level(public, ciphertext) == 0
    with pytest.raises(ProtocolError, match=r"level 0 .* below the refresh level"):
        server.mask(ciphertext)
    with pytest.raises(ProtocolError, match="refusing to refresh a ciphertext at level 0"):
        client.refresh(ciphertext)


def test_client_refuses_a_ciphertext_not_at_the_refresh_level(keys, client):
    private, _ = keys
    with pytest.raises(ProtocolError, match=r"refusing to refresh a ciphertext at level 2"):
        client.refresh(_encrypt(private, np.ones(4)))


def test_unmask_refuses_wrong_level_or_scale(keys, server, client):
    private, public = keys
    masked, mask = server.mask(_encrypt(private, np.ones(4)))
    fresh = client.refresh(masked)
    lower = sealapi.Ciphertext(_seal(public))
    sealapi.Evaluator(_seal(public)).mod_switch_to_next(fresh, lower)
    with pytest.raises(ProtocolError, match="expected the top level"):
        server.unmask(lower, mask)
    fresh.scale = 2.0 * fresh.scale
    with pytest.raises(ProtocolError, match="scale"):
        server.unmask(fresh, mask)


def test_unrelinearised_ciphertext_and_garbage_bytes_are_refused(keys, server):
    private, public = keys
    ciphertext = _encrypt(private, np.ones(4))
    square = sealapi.Ciphertext(_seal(public))
    sealapi.Evaluator(_seal(public)).square(ciphertext, square)
    with pytest.raises(ProtocolError, match="size 2"):
        server.mask(square)
    with pytest.raises(ProtocolError):
        seal_deserialize(public, b"\x5e\xa1 not a ciphertext")


@pytest.mark.parametrize(
    ("bits", "options", "message"),
    [
        ((60, 40, 60), {}, "at least 3 data primes"),
        ((30, 20, 40, 60), {}, "no room for the mask"),
        # the chain before the per-run budget: one ciphertext alone is 2^-33 from the mask
        ((58, 40, 40, 60), {}, "no room for the mask"),
        (SMALL, {"mask_bits": 116}, "does not fit"),
        (SMALL, {"mask_bits": 60}, "no room for the mask"),
    ],
)
def test_parameters_without_room_for_the_mask(bits, options, message):
    _, public = _contexts(8192, bits)
    with pytest.raises(CryptoParameterError, match=message):
        RefreshServer(public, **options)


# --- the run's budget and the key holder's range check (issue 19, defect 4) ----------------


def test_before_the_budget_a_run_was_far_from_2_to_the_minus_40():
    """The attack's condition, computed: the chain the refresh had before (q0 q1 of 98 bits,
    B = 2^95) hides a calibrated value (2^10 at scale 2^40) to 2^-46 per coefficient but 2^-33
    per ciphertext, so one block of the embedded model (1,797 refreshed ciphertexts at N = 8192)
    is 2^-22 from masks alone and 20 rounds are far worse: the refresh level now refuses it."""
    _, public = _contexts(8192, (58, 40, 40, 60))
    chain = _chain_of(public)
    old = RefreshBound.for_modulus(8192, chain.refresh_modulus, 2**50, mask_bits=95)
    assert math.log2(old.per_coefficient) == pytest.approx(-46, abs=0.01)
    assert math.log2(old.per_ciphertext) == pytest.approx(-33, abs=0.01)
    assert old.run_bound(1797) > 2.0**-23 > RUN_DISTANCE_BUDGET
    assert old.rated_ciphertexts() == 0
    with pytest.raises(CryptoParameterError, match="no room for the mask"):
        RefreshServer(public)


def test_bound_and_accountant_arithmetic(server, client):
    bound = server.bound
    assert bound == client.bound  # both sides derive it from the parameter set
    assert bound.value_bound == 2**57 and bound.mask_bits == 115  # q0 q1 of 118 bits
    assert 2 * 2**bound.mask_bits + bound.value_bound < bound.refresh_modulus // 2
    assert 2 * 2 ** (bound.mask_bits + 1) + bound.value_bound >= bound.refresh_modulus // 2
    assert bound.per_coefficient == 2.0**57 / (2.0**116 + 1)
    assert bound.per_ciphertext == 8192 * bound.per_coefficient
    rated = bound.rated_ciphertexts()
    assert rated == 64  # 2^-40 / 2^-46: N = 8192 leaves no room for long runs at 2^-40
    assert bound.run_bound(rated) <= RUN_DISTANCE_BUDGET < bound.run_bound(rated + 1)
    assert bound.rated_ciphertexts(2.0**-30) == 2**16  # what ckks-8192 is rated for
    described = bound.describe()
    assert described["rated_refreshed_ciphertexts"] == rated
    assert described["log2_distance_per_ciphertext"] == pytest.approx(-46, abs=1e-6)

    budget = RefreshBudget(bound, budget=3.5 * bound.per_ciphertext)
    assert budget.rated == 3
    budget.charge(2)
    with pytest.raises(
        CryptoParameterError, match=r"budget exhausted: .* 2 refreshed .* rated for 3"
    ):
        budget.charge(2)
    assert budget.charged == 2 and budget.remaining == 1  # a refused charge changes nothing
    budget.charge(1)
    assert budget.spent == pytest.approx(3 * bound.per_ciphertext)
    with pytest.raises(CryptoParameterError, match="budget must be in"):
        RefreshBudget(bound, budget=0.0)


def test_server_refuses_to_mask_past_the_rated_run(keys):
    private, public = keys
    server = RefreshServer(public)
    server.budget = RefreshBudget(server.bound, budget=2.5 * server.bound.per_ciphertext)
    ciphertexts = [_times(public, _encrypt(private, np.ones(4)), 1.0) for _ in range(3)]
    server.mask_many(ciphertexts[:2])
    with pytest.raises(CryptoParameterError, match="refresh budget exhausted"):
        server.mask(ciphertexts[2])
    assert server.budget.charged == 2


def test_key_holder_refuses_exactly_the_views_outside_b_plus_t(keys):
    """Detection: the client refuses a refresh iff a coefficient it sees lies outside
    [-(B + T), B + T]. A value far beyond the bound (a constant, so its one coefficient is
    scale * value) is refused whatever the mask; the old client (no check) answered it."""
    private, public = keys
    server = RefreshServer(public, rng=np.random.default_rng(7))
    client = RefreshClient(private)
    bound = server.bound
    unchecked = RefreshClient(private)
    unchecked._check_range = lambda lifted: None  # the client before this check

    def refresh_constant(value: float, who: RefreshClient):
        ciphertext = _times(public, _encrypt(private, np.full(4096, value)), 1.0)
        masked, _ = server.mask(ciphertext)
        view = np.asarray(who.observe(masked), dtype=object)
        try:
            who.refresh(masked)
        except ProtocolError as error:
            return view, str(error)
        return view, None

    within = 2.0**server.value_bits / 2  # inside the calibration: never refused
    view, error = refresh_constant(within, client)
    assert error is None and max(abs(int(x)) for x in view) <= bound.accepted
    # beyond 2B + T (at scale 2^40: slot values of 2^76): refused with certainty
    huge = (2.0 * 2**bound.mask_bits + 2.0 * bound.value_bound) / SCALE
    view, error = refresh_constant(huge, client)
    assert error is not None and "refusing a refresh" in error and "calibrated bound" in error
    assert abs(int(view[0])) > bound.accepted
    _, error = refresh_constant(huge, unchecked)
    assert error is None  # the old behaviour: silently answered
    # in between, the rule is exactly "some |coefficient| > B + T"
    outcomes = set()
    for fraction in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5):
        value = fraction * 2.0**bound.mask_bits / SCALE
        view, error = refresh_constant(value, client)
        outside = max(abs(int(x)) for x in view) > bound.accepted
        assert (error is not None) == outside
        outcomes.add(outside)
    assert outcomes == {True, False}
