"""CKKS work in background processes: refresh workers, mask material made ahead, fallbacks."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import platform
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from fedfm.approx import calibrate
from fedfm.approx.specs import ApproxConfig
from fedfm.crypto import CKKS_8192_REFRESH, ModelGeometry, run_locally, workers
from fedfm.crypto.ckks import CkksBackend
from fedfm.crypto.seal_raw import SealIO, pid_namespace, scratch_prefix, sweep_stale_scratch
from fedfm.crypto.workers import WORKERS_VARIABLE, configured_workers, discard_pool
from fedfm.errors import ConfigError
from fedfm.models.fhe_vit import to_fhe_friendly

pytestmark = pytest.mark.ckks  # real TenSEAL/SEAL encryption throughout

GEOMETRY = ModelGeometry(tokens=5, patch_size=4)


def test_worker_count_comes_from_the_argument_the_environment_or_the_cores(monkeypatch) -> None:
    monkeypatch.delenv(WORKERS_VARIABLE, raising=False)
    assert configured_workers() == (os.cpu_count() or 1)
    assert configured_workers(3) == 3
    monkeypatch.setenv(WORKERS_VARIABLE, "0")
    assert configured_workers() == 0
    monkeypatch.setenv(WORKERS_VARIABLE, "two")
    with pytest.raises(ConfigError, match="not an integer"):
        configured_workers()
    with pytest.raises(ConfigError, match=">= 0"):
        configured_workers(-1)


def _parties(backend: CkksBackend) -> tuple[object, object]:
    owner = backend.create_key_owner(geometry=GEOMETRY)
    return owner, backend.create_evaluator(owner.public_context(), GEOMETRY)


def _refresh_round_trip(owner, evaluator, values: np.ndarray) -> np.ndarray:
    """Encrypt, mask every ciphertext, refresh through the owner, unmask, decrypt."""
    batch = owner.encrypt(values)
    cts = [ct for feature in batch.tensor for ct in feature]
    fresh = run_locally(evaluator.circuit.refresh(cts, "test"), evaluator, owner)
    count = len(batch.tensor[0])
    tensor = [fresh[f * count : (f + 1) * count] for f in range(len(batch.tensor))]
    return owner.decrypt(evaluator._batch(tensor, batch.shape, batch.copies))


def test_workers_refresh_to_the_same_values_as_in_process(monkeypatch) -> None:
    values = np.random.default_rng(0).normal(size=(6, 5, 12))
    discard_pool()
    owner, evaluator = _parties(CkksBackend(CKKS_8192_REFRESH, workers=0))
    jobs = []
    monkeypatch.setattr(workers.WorkerPool, "map_chunks", _spy(workers.WorkerPool.map_chunks, jobs))
    in_process = _refresh_round_trip(owner, evaluator, values)
    assert evaluator.circuit.refresher.worker_material == 0 and not workers._POOL and not jobs
    owner, evaluator = _parties(CkksBackend(CKKS_8192_REFRESH, workers=2))
    pooled = _refresh_round_trip(owner, evaluator, values)
    # 12 ciphertexts: masks came from the worker pool, the refresh ran there too
    assert evaluator.circuit.refresher.worker_material >= 12
    assert len(jobs) == 1 and workers._POOL[0].count == 2
    np.testing.assert_allclose(pooled, values, atol=1e-6)
    np.testing.assert_allclose(in_process, values, atol=1e-6)
    # a second data owner in the same process uses the same pool
    other, other_evaluator = _parties(CkksBackend(CKKS_8192_REFRESH, workers=2))
    pool = workers._POOL[0]
    np.testing.assert_allclose(
        _refresh_round_trip(other, other_evaluator, values), values, atol=1e-6
    )
    assert workers._POOL[0] is pool and len(jobs) == 2


def _spy(method, calls: list):
    def spied(self, *args, **kwargs):
        calls.append(args)
        return method(self, *args, **kwargs)

    return spied


def test_a_failed_worker_pool_falls_back_to_in_process(caplog) -> None:
    values = np.random.default_rng(1).normal(size=(6, 5, 12))
    owner, evaluator = _parties(CkksBackend(CKKS_8192_REFRESH, workers=2))
    _refresh_round_trip(owner, evaluator, values)
    _kill_idle_workers(evaluator)
    # the refresh and the material ordered after the first refresh both meet the dead pool
    np.testing.assert_allclose(_refresh_round_trip(owner, evaluator, values), values, atol=1e-6)
    assert "refreshing in-process" in caplog.text
    assert "masks are made in-process" in caplog.text
    assert evaluator.circuit.refresher._supply._workers is None


def _kill_idle_workers(evaluator) -> None:
    """Kill the pool's workers between jobs and wait until the pool knows it is broken.

    Not in the middle of a job: a worker killed while sending its result leaves the parent's
    result reader waiting forever for the rest of that message (CPython's ProcessPoolExecutor
    cannot tell), which once hung a whole test run. The mask material made before is dropped,
    so that the next refresh needs the dead pool.
    """
    refresher = evaluator.circuit.refresher
    refresher.hold_material()
    supply = refresher._supply
    concurrent.futures.wait(list(supply._pending))
    supply._pending.clear()
    supply._ready.clear()
    pool = workers._POOL[0]
    for process in list(pool._executor._processes.values()):
        process.kill()
        process.join()
    with pytest.raises(BrokenProcessPool):
        pool.submit(os.getpid).result()


def _drop_in_child(io: SealIO) -> None:
    del io  # collected in the forked child: must not remove the parent's folder


def test_scratch_folders_survive_a_forked_child_that_drops_them() -> None:
    io = SealIO(CkksBackend(CKKS_8192_REFRESH, workers=0).create_key_owner()._seal)
    folder = Path(io._folder)
    child = multiprocessing.get_context("fork").Process(target=_drop_in_child, args=(io,))
    child.start()
    child.join()
    assert child.exitcode == 0 and folder.is_dir()
    io.close()
    assert not folder.exists()


def test_scratch_a_killed_process_left_is_swept_and_a_live_ones_kept(tmp_path) -> None:
    """A process killed before its finalizers ran leaves its scratch (in /dev/shm: RAM); the
    next process to make scratch removes entries whose owner pid no longer runs, in its own PID
    namespace only (another namespace's pids mean other processes)."""
    killed = multiprocessing.get_context("fork").Process(target=os.getpid)
    killed.start()
    killed.join()
    dead, alive = killed.pid, os.getppid()
    namespace = pid_namespace()
    other = str(int(namespace) + 1)
    stale_file = tmp_path / f"fedfm-public-{namespace}-{dead}-abc123"
    stale_folder = tmp_path / f"fedfm-seal-{namespace}-{dead}-def456"
    live_file = tmp_path / f"fedfm-public-{namespace}-{alive}-ghi789"
    own_folder = tmp_path / f"{scratch_prefix('seal')}jkl012"
    other_namespace = tmp_path / f"fedfm-public-{other}-{dead}-mno345"  # a container's
    unnamed = tmp_path / "fedfm-public-xyz_01"  # made before names carried the owner's pid
    older = tmp_path / f"fedfm-public-{dead}-pqr678"  # pid without a namespace: left
    stale_file.write_bytes(b"context")
    (stale_folder / "object").parent.mkdir()
    (stale_folder / "object").write_bytes(b"ciphertext")
    for path in (live_file, unnamed, other_namespace, older):
        path.write_bytes(b"context")
    own_folder.mkdir()
    assert sweep_stale_scratch(str(tmp_path)) == 2
    assert not stale_file.exists() and not stale_folder.exists()
    for kept in (live_file, own_folder, unnamed, other_namespace, older):
        assert kept.exists(), kept.name
    io = SealIO(CkksBackend(CKKS_8192_REFRESH, workers=0).create_key_owner()._seal)
    assert Path(io._folder).name.startswith(f"fedfm-seal-{namespace}-{os.getpid()}-")
    io.close()


def test_the_allocator_keeps_freed_heap_unless_told_not_to(monkeypatch) -> None:
    workers.keep_heap.cache_clear()
    monkeypatch.setenv(workers.KEEP_HEAP_VARIABLE, "0")
    assert workers.keep_heap() is False
    workers.keep_heap.cache_clear()
    monkeypatch.delenv(workers.KEEP_HEAP_VARIABLE)
    tuned = workers.keep_heap()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert tuned is True  # glibc accepted every setting
    assert workers.keep_heap() is tuned  # once per process


def test_attention_heads_in_workers_match_in_process_evaluation() -> None:
    """Circuit.spread sends all heads but the first to the workers: same values, same counts."""
    torch.manual_seed(3)
    vit = VisionTransformer(
        img_size=8, patch_size=4, embed_dim=12, depth=1, num_heads=3, mlp_ratio=2.0, num_classes=3
    )
    with torch.no_grad():
        vit.cls_token.normal_(0.0, 1.0)
        vit.pos_embed.normal_(0.0, 0.5)
    model = to_fhe_friendly(vit, ApproxConfig()).eval()
    calibrate(model, [torch.rand(16, 3, 8, 8)])
    with torch.no_grad():
        hidden = model.embed(torch.rand(5, 3, 8, 8))
        expected = model.block(0, hidden).numpy()
    owner = CkksBackend(CKKS_8192_REFRESH, workers=2).create_key_owner(geometry=GEOMETRY)
    outputs, counts = [], []
    for count in (2, 0):
        evaluator = CkksBackend(CKKS_8192_REFRESH, workers=count).create_evaluator(
            owner.public_context(), GEOMETRY
        )
        assert (evaluator.circuit.pool is not None) == (count == 2)
        batch = evaluator.load(owner.encrypt(hidden.numpy()).to_payload())
        out = run_locally(evaluator.evaluate_block(model, 0, batch), evaluator, owner)
        outputs.append(owner.decrypt(out))
        stats = evaluator.circuit.stats
        counts.append((stats.rotations, stats.products, stats.plain_products, stats.refreshes))
    span = float(np.abs(expected).max())
    for got in outputs:
        assert np.abs(got - expected).max() <= 1e-4 * span
    assert counts[0] == counts[1] and counts[0][0] > 0


def _double(circuit, ct):
    return [circuit.add(ct, ct)]


def test_segments_meet_a_dead_pool_and_finish_in_process(caplog) -> None:
    values = np.random.default_rng(4).normal(size=(3, 5, 2))
    owner, evaluator = _parties(CkksBackend(CKKS_8192_REFRESH, workers=2))
    circuit = evaluator.circuit
    cts = [feature[0] for feature in evaluator.load(owner.encrypt(values).to_payload()).nested()]
    assert circuit.pool is not None
    _kill_idle_workers(evaluator)
    doubled = circuit.spread(_double, [(ct,) for ct in cts])
    assert "evaluating in-process" in caplog.text and circuit.pool is None
    # the worker's share was evaluated here instead: twice each feature, decrypted
    np.testing.assert_allclose(
        owner.decrypt(evaluator._batch(doubled, values.shape, copies=True)), 2 * values, atol=1e-5
    )


def _tagged(prefix: bytes, chunk) -> list[bytes]:
    return [prefix + b"worker:" + item for item in chunk]


def test_the_caller_takes_back_chunks_no_worker_started() -> None:
    discard_pool()
    pool = workers.shared_pool(2)
    items = [str(i).encode() for i in range(200)]
    seen: list[int] = []

    def local(chunk):
        seen.append(len(chunk))
        return [b"x:local:" + item for item in chunk]

    out = pool.map_chunks(_tagged, b"x:", items, local=local)
    # every item once, in order, whoever did it
    assert [item.rsplit(b":", 1)[1] for item in out] == items
    assert all(item.startswith((b"x:local:", b"x:worker:")) for item in out)
    # small chunks (about 4 per process, at least STEAL_CHUNK_MIN items) and the caller did some
    assert seen and max(seen) <= max(workers.STEAL_CHUNK_MIN, -(-200 // 12))
    assert sum(seen) == sum(item.startswith(b"x:local:") for item in out)
    # without a local function, one chunk per worker and all done there
    assert all(item.startswith(b"x:worker:") for item in pool.map_chunks(_tagged, b"x:", items))
    assert len(pool.process_ids()) == 2
    discard_pool()
    assert pool.process_ids() == []  # a closed pool has no processes to report
