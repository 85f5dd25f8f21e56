"""Cost of one encrypted FHE-friendly block under CKKS, against the ``simulate`` backend.

For each batch size the data owner encrypts a batch of real hidden states (the distilled
student's embedding of digits test images), the server evaluates one block on the ciphertexts,
and every refresh is answered in process by the data owner (masked refreshes, the real
cryptography; only the network is absent). Measured in the same run: server and client seconds,
refreshes and round trips, bytes both ways, the error against the plaintext polynomial block
(what the ``simulate`` backend computes) and its time.

Round trips per block = refreshes + 1 (the block's output going to the client and its fresh
encryption coming back, as in the protocol). Bytes per block count the output, the client's
re-encryption and every refresh request and answer, as serialized for a message. Wall time on a
transport adds round trips x RTT (:data:`ROUND_TRIP_SECONDS`): a parameter set with more levels
between refreshes costs more per operation but wins when round trips are slow.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.approx.modules import clamped_count, reset_clamped
from fedfm.crypto import get_backend
from fedfm.crypto.backend import ModelGeometry, Work, drive
from fedfm.crypto.ckks import CkksBackend, CkksBatch, CkksEvaluator
from fedfm.crypto.params import CkksParameters
from fedfm.crypto.refresh import RefreshBound
from fedfm.crypto.workers import WorkerPool, shared_pool
from fedfm.distillation.pipeline import DistillRun, load_data, load_student
from fedfm.errors import ConfigError
from fedfm.experiments.results import write_results
from fedfm.models.fhe_vit import FheViT
from fedfm.protocols.double_blind.server import model_geometry

# Round-trip times to project a block's wall time onto a transport: Flower simulation (about
# 0.1 s) and the Deployment Engine (6-10 s measured; 8 s here).
ROUND_TRIP_SECONDS = {"simulation": 0.1, "deployment": 8.0}


# The columns of a block's table (results/ckks_block*.md), ViT and text alike.
BLOCK_COLUMNS = [
    ("batch_size", "batch"),
    ("samples_per_ciphertext", "samples/ct"),
    ("seconds_per_block", "s/block"),
    ("seconds_per_sample_per_block", "s/sample/block"),
    ("server_seconds", "server s"),
    ("client_seconds", "client s"),
    ("cpu_seconds_this_process", "CPU s main process"),
    ("refreshes", "refreshes"),
    ("round_trips", "round trips"),
    ("bytes_per_sample_per_block", "bytes/sample/block"),
    ("ratio_vs_simulate", "x simulate"),
    ("seconds_per_block_deployment", "s/block at 8 s RTT"),
    ("error_over_range", "max error / range"),
    ("release_seconds", "release s"),
]


def _cores_used(backend: CkksBackend) -> int:
    """Cores the run could use: BLAS threads and worker processes, or one without workers."""
    return (os.cpu_count() or 1) if backend.workers >= 2 else 1


def _cores_description(backend: CkksBackend) -> str:
    if backend.workers < 2:
        return "Server and data owner in one process (FEDFM_CKKS_WORKERS below 2: one core)"
    return (
        f"Server and data owner on this machine's {_cores_used(backend)} cores: attention heads "
        f"past the first, mask material and the data owner's refreshes in {backend.workers} "
        "worker processes (FEDFM_CKKS_WORKERS), the rest of the server in its own"
    )


def _cpu_seconds(pool: WorkerPool | None) -> tuple[float, dict[int, float]]:
    """CPU seconds (user + system) so far of this process and of each of ``pool``'s workers,
    these read from ``/proc`` (Linux; none elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    workers = {}
    for pid in pool.process_ids() if pool is not None else []:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        workers[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return time.process_time(), workers


def _payload_bytes(payload: dict[str, np.ndarray]) -> int:
    return sum(array.nbytes for array in payload.values())


def measure_block(
    model: FheViT,
    backend: CkksBackend,
    images: torch.Tensor,
    *,
    block: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One encrypted block on ``images`` (already at the model's size); a result row."""
    with torch.no_grad():
        hidden = model.embed(images)
        for index in range(block):
            hidden = model.block(index, hidden)
        reset_clamped(model)
        started = time.perf_counter()
        expected = model.block(block, hidden)
        simulate_seconds = time.perf_counter() - started
        clamped = clamped_count(model)
    return measure_encrypted_block(
        backend,
        model_geometry(model),
        hidden.numpy(),
        expected.numpy(),
        lambda evaluator, batch: evaluator.evaluate_block(model, block, batch),
        simulate_seconds=simulate_seconds,
        reference_clamped=clamped,
        log=log,
    )


def measure_encrypted_block(
    backend: CkksBackend,
    geometry: ModelGeometry,
    hidden: np.ndarray,
    expected: np.ndarray,
    evaluate: Callable[[CkksEvaluator, CkksBatch], Work[CkksBatch]],
    *,
    simulate_seconds: float,
    reference_clamped: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Fresh keys, ``hidden`` encrypted by the data owner, ``evaluate`` on the server with every
    refresh answered in process, the output released and decrypted; a result row against
    ``expected`` (the plaintext block, which took ``simulate_seconds``)."""
    started = time.perf_counter()
    owner = backend.create_key_owner(geometry=geometry)
    public = owner.public_context()
    evaluator = backend.create_evaluator(public, geometry)
    keygen = time.perf_counter() - started
    started = time.perf_counter()
    batch = owner.encrypt(hidden)
    encrypt_seconds = time.perf_counter() - started
    upload = batch.nbytes
    batch = evaluator.load(batch.to_payload())
    traffic = {"bytes": 0, "client_seconds": 0.0, "refreshes": 0}

    def refresh(items: list[Any]) -> list[Any]:
        request = evaluator.refresh_payload(items)
        started = time.perf_counter()
        answer = owner.refresh(request)
        traffic["client_seconds"] += time.perf_counter() - started
        traffic["bytes"] += _payload_bytes(request) + _payload_bytes(answer)
        traffic["refreshes"] += 1
        return evaluator.refreshed(answer)

    stats = evaluator.circuit.stats
    before = (stats.rotations, stats.products, stats.plain_products, len(stats.places))
    seconds_before = dict(stats.seconds)
    pool = shared_pool(backend.workers)
    cpu_before = _cpu_seconds(pool)
    started = time.perf_counter()
    output = drive(evaluate(evaluator, batch), refresh)
    total = time.perf_counter() - started
    cpu_after = _cpu_seconds(pool)
    worker_cpu = sorted(
        (spent - cpu_before[1].get(pid, 0.0) for pid, spent in cpu_after[1].items()), reverse=True
    )
    # What the protocol sends: the output released (re-randomised and flooded), then decrypted.
    started = time.perf_counter()
    released = evaluator.release(output)
    release_seconds = time.perf_counter() - started
    total += release_seconds
    download = released.nbytes
    started = time.perf_counter()
    decrypted = owner.decrypt(released)
    decrypt_seconds = time.perf_counter() - started
    error = float(np.abs(decrypted - expected).max())
    unreleased_error = float(np.abs(owner.decrypt(output) - expected).max())
    span = float(np.abs(expected).max())
    agree = float(
        (decrypted.argmax(axis=-1) == expected.argmax(axis=-1)).mean()
    )  # per token, the largest feature: a coarse check that nothing flipped
    n = len(hidden)
    server_seconds = total - traffic["client_seconds"]
    client_seconds = traffic["client_seconds"] + encrypt_seconds + decrypt_seconds
    seconds = server_seconds + client_seconds
    row = {
        "batch_size": n,
        "samples_per_ciphertext": evaluator.layout.capacity,
        "ciphertexts_per_feature": evaluator.layout.ciphertexts_for(n),
        "seconds_per_block": seconds,
        "seconds_per_sample_per_block": seconds / n,
        "server_seconds": server_seconds,
        "client_seconds": client_seconds,
        "refreshes": traffic["refreshes"],
        "round_trips": traffic["refreshes"] + 1,
        "refreshed_ciphertexts": sum(int(p.rsplit(":", 1)[1]) for p in stats.places[before[3] :]),
        "rotations": stats.rotations - before[0],
        "ciphertext_products": stats.products - before[1],
        "plaintext_products": stats.plain_products - before[2],
        "bytes_per_sample_per_block": (upload + download + traffic["bytes"]) / n,
        "simulate_seconds": simulate_seconds,
        "ratio_vs_simulate": seconds / simulate_seconds,
        "max_abs_error": error,
        "error_over_range": error / span,
        "max_abs_error_before_release": unreleased_error,
        "release_seconds": release_seconds,
        "refresh_bound_object": evaluator.circuit.refresher.bound,
        "refresh_run_bound": evaluator.circuit.refresher.bound.run_bound(
            sum(int(p.rsplit(":", 1)[1]) for p in stats.places[before[3] :])
        ),
        "token_argmax_agreement": agree,
        "reference_clamped": reference_clamped,
        **{
            f"seconds_per_block_{transport}": seconds + (traffic["refreshes"] + 1) * rtt
            for transport, rtt in ROUND_TRIP_SECONDS.items()
        },
        # CPU of the block's evaluation and its refreshes: this process (the server and the
        # data owner's in-process share) and each worker process
        "cpu_seconds_this_process": cpu_after[0] - cpu_before[0],
        "cpu_seconds_per_worker": worker_cpu,
        "keygen_seconds": keygen,
        "public_context_bytes": len(public),
        "refresh_places": stats.places[before[3] :],
        "server_seconds_by_operation": {
            what: spent - seconds_before.get(what, 0.0) for what, spent in stats.seconds.items()
        },
    }
    log(
        f"[fedfm] bench-ckks batch {n}: {seconds:.1f} s per block "
        f"({seconds / n:.3f} s/sample; server {server_seconds:.1f} s, client "
        f"{client_seconds:.1f} s), {row['refreshes']} refreshes, error {error:.2e} "
        f"({error / span:.1e} of the range)"
    )
    return row


def _refresh_budget(
    params: CkksParameters, bound: RefreshBound, headline: dict[str, Any]
) -> dict[str, Any]:
    """The masked refreshes' statistical-distance budget (per run, ``2^-40``) and what it means
    for this block: the bound of one block and how many such blocks a run is rated for."""
    per_block = headline["refreshed_ciphertexts"]
    budget = 2.0**-params.run_budget_bits
    rated = bound.rated_ciphertexts(budget)
    return {
        **bound.describe(budget),
        "refresh_primes": params.refresh_primes,
        "value_bits": params.refresh_value_bits,
        "refreshed_ciphertexts_per_block": per_block,
        "log2_bound_per_block": math.log2(bound.run_bound(per_block)),
        "blocks_per_rated_run": rated // per_block,
        "run_length_assumed": (
            f"{rated} refreshed ciphertexts per key (one data owner, one run): "
            f"{rated // per_block} blocks like this one at batch {headline['batch_size']}"
        ),
        "log2_run_bound_at_rated_length": math.log2(bound.run_bound(rated)),
    }


def measure_refresh_values(
    model: FheViT, backend: CkksBackend, images: torch.Tensor, *, log: Callable[[str], None]
) -> dict[str, float]:
    """Calibration of the refresh's value bound: every block on ``images`` (the data owner
    re-encrypting the released outputs between blocks), each ciphertext the server is about to
    mask decrypted first (only a harness holding both parties can), and the largest unmasked
    coefficient per refresh place (``block3/exp``, ...) as ``log2(max |x| / scale)``, the maximum
    over the blocks under ``block*/<place>``. Untimed: the decryptions cost more than the block."""
    geometry = model_geometry(model)
    owner = backend.create_key_owner(geometry=geometry)
    evaluator = backend.create_evaluator(owner.public_context(), geometry)
    refresher, client = evaluator.circuit.refresher, owner._refresher
    largest: list[float] = []
    mask_many = refresher.mask_many

    def spy(ciphertexts: Sequence[Any]) -> Any:
        pairs = mask_many(ciphertexts)
        # the masked view minus nothing: decrypt the unmasked ciphertext at the refresh level
        largest.append(max(float(np.abs(client.unmasked(ct)).max()) for ct in ciphertexts))
        return pairs

    refresher.mask_many = spy

    def refresh(items: list[Any]) -> list[Any]:
        return evaluator.refreshed(owner.refresh(evaluator.refresh_payload(items)))

    batch = drive(evaluator.embed(model, owner.encrypt(images.numpy())), refresh)
    for index in range(model.num_blocks):
        output = drive(evaluator.evaluate_block(model, index, batch), refresh)
        batch = evaluator.load(owner.encrypt(owner.decrypt(evaluator.release(output))).to_payload())
        log(f"[fedfm] bench-ckks calibration: block {index + 1} done")
    scale = math.log2(evaluator.circuit.scale)
    places: dict[str, float] = {}
    for place, value in zip(evaluator.circuit.stats.places, largest, strict=True):
        name = place.rsplit(":", 1)[0]
        name = "block*/" + name.split("/", 1)[1] if name.startswith("block") else name
        places[name] = max(places.get(name, -math.inf), math.log2(max(value, 1.0)) - scale)
    return places


def measure_forward(
    model: FheViT, backend: CkksBackend, images: torch.Tensor, *, log: Callable[[str], None]
) -> dict[str, Any]:
    """Embedding and every block under CKKS with the client re-encrypting between blocks (as in
    the protocol); per-block errors and the model head's predictions against plaintext."""
    geometry = model_geometry(model)
    owner = backend.create_key_owner(geometry=geometry)
    evaluator = backend.create_evaluator(owner.public_context(), geometry)

    def refresh(items: list[Any]) -> list[Any]:
        return evaluator.refreshed(owner.refresh(evaluator.refresh_payload(items)))

    started = time.perf_counter()
    batch = drive(evaluator.embed(model, owner.encrypt(images.numpy())), refresh)
    errors = []
    with torch.no_grad():
        expected = model.embed(images)
        for index in range(model.num_blocks):
            expected = model.block(index, expected)
            output = drive(evaluator.evaluate_block(model, index, batch), refresh)
            hidden = owner.decrypt(evaluator.release(output))  # as the protocol sends it
            errors.append(float(np.abs(hidden - expected.numpy()).max() / expected.abs().max()))
            log(f"[fedfm] bench-ckks forward: block {index + 1} error/range {errors[-1]:.1e}")
            batch = evaluator.load(owner.encrypt(hidden).to_payload())
        seconds = time.perf_counter() - started
        encrypted = model.head(torch.from_numpy(hidden)).argmax(dim=1)
        plain = model.head(expected).argmax(dim=1)
    return {
        "batch_size": len(images),
        "seconds": seconds,
        "seconds_per_sample": seconds / len(images),
        "block_error_over_range": errors,
        "predictions_agree": int((encrypted == plain).sum()),
        "samples": len(images),
    }


def median_run(measure: Callable[[], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """``measure()`` ``repeats`` times (fresh keys each time): the row with the median seconds
    per block, with every run's seconds under ``seconds_per_block_runs``."""
    runs = sorted((measure() for _ in range(repeats)), key=lambda row: row["seconds_per_block"])
    median = runs[(len(runs) - 1) // 2]
    median["seconds_per_block_runs"] = [row["seconds_per_block"] for row in runs]
    return median


def setting_sentence(backend_name: str, backend: CkksBackend) -> str:
    """The parameter set, the cores and how refreshes were answered (a table's description)."""
    params = backend.params
    return (
        f"backend `{backend_name}`: N = {params.poly_modulus_degree}, primes "
        f"{list(params.coeff_mod_bit_sizes)} bits, scale 2^{params.scale_bits}, "
        f"{params.levels_between_refreshes} rescales between masked refreshes. "
        f"{_cores_description(backend)}; refreshes answered on this machine by the data owner "
        "(no network: add round trips x RTT). `simulate` is the plaintext polynomial block "
        "(torch, one thread)"
    )


def repeats_sentence(repeats: int) -> str:
    return (
        f"Each row is the median of {repeats} runs (all runs' seconds per block in the JSON). "
        if repeats > 1
        else ""
    )


def table_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their per-place detail (kept once in :func:`block_summary`)."""
    detail = ("refresh_places", "server_seconds_by_operation")
    return [{k: v for k, v in row.items() if k not in detail} for row in rows]


def block_summary(
    backend: CkksBackend, rows: list[dict[str, Any]], *, blocks: int, repeats: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The headline row (batch 64, else the last) and the JSON keys every block table has:
    parameters, per-sample seconds of a block and of ``blocks`` blocks, refresh places and
    budget, cores. Takes the refresh bound objects out of ``rows`` (not JSON)."""
    headline = next((row for row in rows if row["batch_size"] == 64), rows[-1])
    params = backend.params
    bound: RefreshBound = rows[0]["refresh_bound_object"]
    for row in rows:
        row.pop("refresh_bound_object")
    return headline, {
        "parameters": {
            "poly_modulus_degree": params.poly_modulus_degree,
            "coeff_mod_bit_sizes": list(params.coeff_mod_bit_sizes),
            "scale_bits": params.scale_bits,
            "levels_between_refreshes": params.levels_between_refreshes,
        },
        "seconds_per_sample_per_block": headline["seconds_per_sample_per_block"],
        "seconds_per_sample_per_forward": headline["seconds_per_sample_per_block"] * blocks,
        "headline_batch_size": headline["batch_size"],
        "refresh_places": {row["batch_size"]: row["refresh_places"] for row in rows},
        "server_seconds_by_operation": {
            row["batch_size"]: row["server_seconds_by_operation"] for row in rows
        },
        "refresh_budget": _refresh_budget(params, bound, headline),
        "cores_used": _cores_used(backend),
        "worker_processes": backend.workers if backend.workers >= 2 else 0,
        "repeats": repeats,
    }


def flood_slot_std(params: CkksParameters) -> float:
    """Standard deviation of the release's flood in a decoded slot: sigma sqrt(N / 2) / scale."""
    return (
        2.0**params.flood_bits * math.sqrt(params.poly_modulus_degree / 2) / 2.0**params.scale_bits
    )


def run_ckks_benchmark(
    run: DistillRun,
    *,
    backend_name: str = "ckks",
    batch_sizes: Sequence[int] = (16, 64, 256),
    block: int = 0,
    forward_batch: int = 0,
    calibrate: bool = False,
    repeats: int = 1,
    results_dir: Path = Path("results"),
    log: Callable[[str], None] = print,
    command: str | None = None,
) -> list[dict[str, Any]]:
    """Measure one block per batch size; write ``results/ckks_block[_<backend>].{json,md}``.

    With ``repeats`` above one each batch size is measured that many times (fresh keys each
    time) and the run with the median time per block is reported, with every run's time.
    """
    backend = get_backend(backend_name)
    if not isinstance(backend, CkksBackend):
        raise ConfigError(f"bench-ckks measures a CKKS backend, not {backend_name!r}")
    student_path = Path(run.workdir) / "student.pt"
    if not student_path.exists():
        raise ConfigError(f"no distilled student at {student_path}: run `fedfm distill` first")
    model = load_student(student_path).eval()
    if not 0 <= block < model.num_blocks:
        raise ConfigError(f"block must be in 0..{model.num_blocks - 1}, got {block}")
    if not batch_sizes or min(batch_sizes) < 1 or forward_batch < 0:
        raise ConfigError(f"batch sizes must be >= 1, got {list(batch_sizes)} and {forward_batch}")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    splits, _ = load_data(run)
    if max(batch_sizes, default=0) > len(splits.test) or forward_batch > len(splits.test):
        raise ConfigError(
            f"batch sizes up to {len(splits.test)} (the test split), got {batch_sizes}"
        )
    torch.set_num_threads(1)  # the plaintext reference on one core, like SEAL here
    rows = [
        median_run(
            partial(measure_block, model, backend, splits.test.images[:n], block=block, log=log),
            repeats,
        )
        for n in batch_sizes
    ]
    forward = (
        measure_forward(model, backend, splits.test.images[:forward_batch], log=log)
        if forward_batch
        else None
    )
    calibration = (
        measure_refresh_values(model, backend, splits.test.images[: batch_sizes[0]], log=log)
        if calibrate
        else None
    )
    headline, summary = block_summary(backend, rows, blocks=model.num_blocks, repeats=repeats)
    params = backend.params
    write_results(
        results_dir,
        "ckks_block" if backend_name == "ckks" else f"ckks_block_{backend_name}",
        title="One encrypted ViT block under CKKS (TenSEAL) vs the simulate backend",
        description=(
            f"Block {block + 1} of the distilled student in {student_path} ({model.num_blocks} "
            f"blocks, {model_geometry(model).tokens} tokens, width "
            f"{model.vit.embed_dim}) on {run.dataset} test images; "
            f"{setting_sentence(backend_name, backend)} the simulate backend runs. "
            + repeats_sentence(repeats)
            + "A forward pass "
            f"is {model.num_blocks} such blocks"
            + (
                f"; measured on {forward['samples']} images: {forward['predictions_agree']} "
                "head predictions agree with the plaintext model, per-block max error / range "
                + ", ".join(f"{e:.1e}" for e in forward["block_error_over_range"])
                + "."
                if forward
                else "."
            )
        ),
        rows=table_rows(rows),
        columns=BLOCK_COLUMNS,
        extra={
            "backend": backend_name,
            **summary,
            # log2(largest unmasked coefficient / scale) per refresh place, over every block
            # (--calibrate; the refresh's value bound is 2^value_bits)
            "refresh_calibration": calibration,
            "circuit_privacy": {
                "flood_bits": params.flood_bits,
                "flood_slot_std": flood_slot_std(params),
                "release_seconds_per_block": headline["release_seconds"],
                "max_abs_error_before_release": headline["max_abs_error_before_release"],
                "max_abs_error_after_release": headline["max_abs_error"],
            },
            "forward_pass": forward,
        },
        command=command,
    )
    return rows
