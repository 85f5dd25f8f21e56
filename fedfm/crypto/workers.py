"""Background processes for CKKS work, so that it uses every core.

SEAL's Python bindings keep the GIL, so threads do not help; processes do. One pool per process
(:func:`shared_pool`) serves every key in it (a simulation runs many data owners and the server's
evaluators in one process): a job carries the serialized context it needs (public or secret,
without rotation keys: up to a few MB), and each worker keeps the last few contexts it loaded. Three
jobs use it: a data owner's refresh of a batch of masked ciphertexts
(:func:`fedfm.crypto.refresh.refresh_blobs`, in small chunks shared by the workers and the calling
process: :meth:`WorkerPool.map_chunks`), the server's mask material, made ahead of time because it
depends on no data (:func:`fedfm.crypto.refresh.mask_material_blobs`), and *segments* of the
server's block evaluation that need no refresh and do not depend on each other, such as one
attention head's logits (:func:`fedfm.crypto.circuit.run_segment`, driven by
:meth:`fedfm.crypto.circuit.Circuit.spread`). A segment's worker loads the evaluator's public
context (with its rotation keys: megabytes, too large to send with every job) from a file the
evaluator writes once, and keeps the circuit it built.

Workers are forked (``fork``: no re-import of the caller's main script, as ``spawn`` would do;
they only run SEAL and element-wise NumPy, not the parent's thread pools).

How many workers: ``FEDFM_CKKS_WORKERS`` (an integer; ``0`` or ``1`` keep everything
in-process), by default the number of cores. A pool that cannot start or breaks logs a warning
and the work runs in-process, with the same results.

The allocator (:func:`keep_heap`): every homomorphic operation allocates megabytes of temporaries
(NumPy arrays, SEAL polynomials). glibc serves such blocks from fresh ``mmap`` pages or gives heap
memory back to the system as soon as it is freed, so the kernel maps and zeroes them again for the
next operation: about a tenth of a block's time at N = 8192 went to that (system time). The CKKS
backend therefore asks glibc, once per process, to keep up to 1 GiB of freed heap and to serve
blocks below 32 MiB from it (``FEDFM_KEEP_HEAP=0`` leaves the allocator alone). The cost: the
process keeps its peak heap instead of shrinking after a block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from fedfm.errors import ConfigError

_LOG = logging.getLogger(__name__)
WORKERS_VARIABLE = "FEDFM_CKKS_WORKERS"
KEEP_HEAP_VARIABLE = "FEDFM_KEEP_HEAP"
# glibc's mallopt parameters (malloc.h) and the values keep_heap sets.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_HEAP_SETTINGS = {
    _M_TRIM_THRESHOLD: 1 << 30,  # give freed heap back to the system only past 1 GiB
    _M_TOP_PAD: 256 << 20,  # grow the heap in steps of 256 MiB
    _M_MMAP_THRESHOLD: 32 << 20,  # blocks below 32 MiB (glibc's maximum) from the heap
}
# map_chunks with the caller working too: about this many chunks per process, each at least
# this many items (a refresh of one ciphertext takes milliseconds; a job costs about one).
STEAL_CHUNKS, STEAL_CHUNK_MIN = 4, 8
# Contexts a worker keeps loaded (data owners and evaluators it serves in turn).
CONTEXTS_PER_WORKER = 4

# In the parent: the pool of this process and its size.
_POOL: list[WorkerPool] = []


def configured_workers(requested: int | None = None) -> int:
    """Worker processes to use: ``requested``, else ``$FEDFM_CKKS_WORKERS``, else the cores."""
    if requested is None:
        raw = os.environ.get(WORKERS_VARIABLE, "").strip()
        if not raw:
            return os.cpu_count() or 1
        try:
            requested = int(raw)
        except ValueError:
            raise ConfigError(f"{WORKERS_VARIABLE}={raw!r} is not an integer") from None
    if requested < 0:
        raise ConfigError(f"CKKS worker count must be >= 0, got {requested}")
    return requested


@functools.cache
def keep_heap() -> bool:
    """Tune glibc's allocator for CKKS work (module docstring); ``True`` if it was tuned.

    Once per process (forked workers inherit it); a no-op off glibc or with
    ``FEDFM_KEEP_HEAP=0``.
    """
    if os.environ.get(KEEP_HEAP_VARIABLE, "").strip() == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(parameter, value) == 1 for parameter, value in _HEAP_SETTINGS.items())


class WorkerPool:
    """``count`` forked worker processes (see the module docstring)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._executor = ProcessPoolExecutor(
            max_workers=count, mp_context=multiprocessing.get_context("fork")
        )

    def submit(self, function: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._executor.submit(function, *args)

    def map_chunks(
        self,
        function: Callable[[bytes, Sequence[bytes]], list[bytes]],
        context_bytes: bytes,
        items: Sequence[bytes],
        local: Callable[[Sequence[bytes]], list[bytes]] | None = None,
    ) -> list[bytes]:
        """``function(context_bytes, chunk)`` over contiguous chunks of ``items``, results in
        order.

        Without ``local``: one chunk per worker. With ``local``, the calling process works too:
        the items go out in small chunks and the caller takes back, from the end, every chunk no
        worker has picked up yet (:meth:`Future.cancel` succeeds), running ``local(chunk)``
        itself. Workers still busy with earlier jobs (mask material made ahead) then delay
        nothing: whoever is free does the next chunk.
        """
        if local is None:
            size = -(-len(items) // self.count)
        else:
            size = max(STEAL_CHUNK_MIN, -(-len(items) // (STEAL_CHUNKS * (self.count + 1))))
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        futures = [self._executor.submit(function, context_bytes, chunk) for chunk in chunks]
        done: dict[int, list[bytes]] = {}
        try:
            if local is not None:
                for index in reversed(range(len(chunks))):
                    if not futures[index].cancel():
                        break
                    done[index] = local(chunks[index])
            return [
                item
                for index, future in enumerate(futures)
                for item in (done[index] if index in done else future.result())
            ]
        finally:
            for future in futures:
                future.cancel()

    def process_ids(self) -> list[int]:
        """The worker processes' ids (none before the first job starts them or after
        :meth:`close`)."""
        processes = self._executor._processes or {}  # None once the executor shut down
        return [process.pid for process in processes.values() if process.pid is not None]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def shared_pool(count: int) -> WorkerPool | None:
    """This process's pool of ``count`` workers (started on first use), or ``None`` if ``count``
    is below 2 or the pool cannot start (the caller then works in-process)."""
    if count < 2:
        return None
    if _POOL and _POOL[0].count == count:
        return _POOL[0]
    discard_pool()
    try:
        _POOL.append(WorkerPool(count))
    except (OSError, RuntimeError) as error:
        _LOG.warning("CKKS workers could not start (%s); working in-process", error)
        return None
    return _POOL[0]


def discard_pool() -> None:
    """Stop this process's pool (after it broke); the next :func:`shared_pool` starts anew."""
    while _POOL:
        _POOL.pop().close()
