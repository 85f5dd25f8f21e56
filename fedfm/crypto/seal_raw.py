"""Bulk access to the coefficients of SEAL ciphertexts and plaintexts, and RNS arithmetic.

SEAL's Python bindings (``tenseal.sealapi``) expose no bulk coefficient access: objects only
``save`` to and ``load`` from files. This module parses and builds those files.

Layout (SEAL 4.x as built into TenSEAL 0.3.18, checked by ``tests/crypto/test_refresh.py``)
---------------------------------------------------------------------------------------
Every saved object is a 16-byte header (``uint16`` magic ``0xA15E``, ``uint8`` header size 16,
``uint8`` version major, ``uint8`` version minor, ``uint8`` compression mode 0 none / 1 zlib /
2 zstd, ``uint16`` reserved, ``uint64`` total size including the header) and a body, compressed
according to the mode. All integers are little-endian.

* Ciphertext body: ``parms_id`` (4 x ``uint64``), ``is_ntt_form`` (``uint8``), ``size``,
  ``poly_modulus_degree`` N, ``coeff_modulus_size`` k (``uint64`` each), ``scale`` (``float64``),
  ``correction_factor`` (``uint64``), then a nested ``DynArray``: its own 16-byte header
  (uncompressed), a ``uint64`` count and ``count`` ``uint64`` words laid out
  ``[polynomial][prime][coefficient]``.
* Plaintext body: ``parms_id``, ``coeff_count`` (``uint64``), ``scale`` (``float64``), nested
  ``DynArray`` (for CKKS: k x N words in NTT form).

Objects are written back uncompressed. ``load`` makes SEAL validate them (every word reduced
modulo its prime, sizes consistent with the parameters), so a malformed write fails loudly.

Compact wire format
-------------------
What fedfm sends (:func:`dumps`): ``b"FFC1"``, ``parms_id`` (4 x ``uint64``), ``is_ntt_form``,
``size``, ``k`` (``uint8`` each), ``log2 N`` (``uint8``), ``scale`` (``float64``),
``correction_factor`` (``uint64``), one byte per prime giving the width ``w_j`` of its residues,
then for each prime and polynomial the residues as little-endian integers of ``w_j`` bytes (the
bytes the largest needs: 5 for uniform residues modulo a 40-bit prime). Exact, smaller
than SEAL's zstd files (residues are uniform, so they do not compress below their bit width) and
about ten times faster to make and read. :meth:`SealIO.load_ciphertext` takes both formats and
checks either as strictly as SEAL's ``load``.

Going between NTT and coefficient form uses SEAL's own transforms on a scratch ciphertext that
carries the polynomials. SEAL (built with ``SEAL_THROW_ON_TRANSPARENT_CIPHERTEXT``) refuses a
ciphertext whose polynomials after the first are all zero, so a scratch ciphertext without a
nonzero polynomial after its first gets a guard polynomial appended.

Modular arithmetic works on ``uint64`` arrays for primes below 2^60 without overflow.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import struct
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tenseal as ts
import tenseal.sealapi as sealapi
import zstandard

import fedfm.crypto.seal_memory as seal_memory
from fedfm.errors import CryptoParameterError, InvariantError, ProtocolError

_LOG = logging.getLogger(__name__)

SEAL_MAGIC = 0xA15E
HEADER = struct.Struct("<HBBBBHQ")
COMPR_NONE, COMPR_ZLIB, COMPR_ZSTD = 0, 1, 2
# SEAL's SEAL_CIPHERTEXT_SIZE_MAX: polynomials one ciphertext can carry.
CIPHERTEXT_SIZE_MAX = 16
MAX_PRIME_BITS = 60

_CT_META = struct.Struct("<4QBQQQdQ")  # parms_id, is_ntt, size, N, k, scale, correction
_PT_META = struct.Struct("<4QQd")  # parms_id, coeff_count, scale
_COUNT = struct.Struct("<Q")

ParmsId = tuple[int, int, int, int]


@dataclass(frozen=True, eq=False)
class RawCiphertext:
    """A ciphertext's fields; ``data`` is ``uint64`` of shape (size, k, N)."""

    parms_id: ParmsId
    is_ntt_form: bool
    scale: float
    data: np.ndarray
    correction_factor: int = 1


@dataclass(frozen=True, eq=False)
class RawPlaintext:
    """A CKKS plaintext's fields; ``data`` is ``uint64`` of shape (k, N), in NTT form."""

    parms_id: ParmsId
    scale: float
    data: np.ndarray


def seal_context_of(context: Any) -> Any:
    """The SEAL context behind a TenSEAL context (or the SEAL context itself)."""
    if isinstance(context, ts.Context):
        return context.seal_context().data
    return context


def context_data(seal_context: Any, parms_id: ParmsId | list[int]) -> Any:
    """SEAL's ``ContextData`` for ``parms_id``; :class:`ProtocolError` if not in the chain."""
    data = seal_context.get_context_data(list(parms_id))
    if data is None:
        raise ProtocolError(f"parms_id {list(parms_id)} is not in this context's modulus chain")
    return data


def primes_of(seal_context: Any, parms_id: ParmsId | list[int]) -> list[int]:
    """The data primes of level ``parms_id``, lowest first."""
    return [m.value() for m in context_data(seal_context, parms_id).parms().coeff_modulus()]


# --- serialization -------------------------------------------------------------------------


@functools.cache
def _seal_version() -> tuple[int, int]:
    """The (major, minor) version SEAL stamps on what it saves; ``load`` insists on it."""
    with tempfile.TemporaryDirectory(dir=scratch_root()) as folder:
        path = Path(folder) / "object"
        sealapi.Plaintext().save(str(path))
        _, _, major, minor, *_ = HEADER.unpack_from(path.read_bytes())
    return major, minor


def _header(compr_mode: int, total: int) -> bytes:
    return HEADER.pack(SEAL_MAGIC, HEADER.size, *_seal_version(), compr_mode, 0, total)


def _body(blob: bytes) -> bytes:
    """The uncompressed body of a saved SEAL object."""
    if len(blob) < HEADER.size:
        raise ProtocolError(f"SEAL object of {len(blob)} bytes is shorter than its header")
    magic, header_size, _, _, mode, _, total = HEADER.unpack_from(blob)
    if magic != SEAL_MAGIC or header_size != HEADER.size or total != len(blob):
        raise ProtocolError("not a SEAL object (bad magic, header size or total size)")
    body = blob[HEADER.size :]
    if mode == COMPR_NONE:
        return body
    if mode == COMPR_ZSTD:
        # Streaming decompression: SEAL's frames do not record their decompressed size.
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    if mode == COMPR_ZLIB:
        import zlib

        return zlib.decompress(body)
    raise ProtocolError(f"SEAL object has unknown compression mode {mode}")


def _dyn_array(body: bytes, offset: int, count: int) -> np.ndarray:
    """The ``count`` words of the nested ``DynArray`` at ``offset`` (checked)."""
    magic, header_size, _, _, mode, _, total = HEADER.unpack_from(body, offset)
    if magic != SEAL_MAGIC or header_size != HEADER.size or mode != COMPR_NONE:
        raise ProtocolError("SEAL object's nested coefficient array has an unexpected header")
    (found,) = _COUNT.unpack_from(body, offset + HEADER.size)
    start = offset + HEADER.size + _COUNT.size
    if found != count or total != HEADER.size + _COUNT.size + 8 * count:
        raise ProtocolError(f"SEAL coefficient array holds {found} words, expected {count}")
    if len(body) < start + 8 * count:
        raise ProtocolError("SEAL object is truncated")
    return np.frombuffer(body, dtype="<u8", count=count, offset=start).astype(np.uint64)


def _dyn_array_bytes(data: np.ndarray) -> bytes:
    words = np.ascontiguousarray(data, dtype="<u8").tobytes()
    total = HEADER.size + _COUNT.size + len(words)
    return _header(COMPR_NONE, total) + _COUNT.pack(data.size) + words


def parse_ciphertext(blob: bytes) -> RawCiphertext:
    """A :class:`RawCiphertext` from the bytes ``Ciphertext.save`` writes."""
    body = _body(blob)
    *parms_id, is_ntt, size, degree, k, scale, correction = _CT_META.unpack_from(body)
    data = _dyn_array(body, _CT_META.size, size * k * degree).reshape(size, k, degree)
    return RawCiphertext(tuple(parms_id), bool(is_ntt), scale, data, correction)


def ciphertext_bytes(raw: RawCiphertext) -> bytes:
    """Uncompressed SEAL bytes of ``raw`` (what ``Ciphertext.load`` reads)."""
    data = np.asarray(raw.data)
    if data.ndim != 3:
        raise ProtocolError(f"ciphertext data must be (size, k, N), got shape {data.shape}")
    size, k, degree = data.shape
    meta = _CT_META.pack(
        *raw.parms_id, int(raw.is_ntt_form), size, degree, k, raw.scale, raw.correction_factor
    )
    body = meta + _dyn_array_bytes(data)
    return _header(COMPR_NONE, HEADER.size + len(body)) + body


def parse_plaintext(blob: bytes, degree: int | None = None) -> RawPlaintext:
    """A :class:`RawPlaintext` from the bytes a CKKS ``Plaintext.save`` writes.

    A plaintext does not record N: with ``degree`` the data is shaped (k, N), else it is flat.
    """
    body = _body(blob)
    *parms_id, coeff_count, scale = _PT_META.unpack_from(body)
    data = _dyn_array(body, _PT_META.size, coeff_count)
    if degree is not None:
        if coeff_count % degree:
            raise ProtocolError(f"plaintext of {coeff_count} words is not k x N for N={degree}")
        data = data.reshape(-1, degree)
    return RawPlaintext(tuple(parms_id), scale, data)


def plaintext_bytes(raw: RawPlaintext) -> bytes:
    """Uncompressed SEAL bytes of ``raw``; ``data`` is (k, N) or flat."""
    data = np.asarray(raw.data)
    body = _PT_META.pack(*raw.parms_id, data.size, raw.scale) + _dyn_array_bytes(data)
    return _header(COMPR_NONE, HEADER.size + len(body)) + body


# --- compact wire format ------------------------------------------------------------------

COMPACT_MAGIC = b"FFC1"
_COMPACT_META = struct.Struct("<4s4QBBBBdQ")  # magic, parms_id, ntt, size, k, log2 N, scale, cf


def compact_bytes(raw: RawCiphertext) -> bytes:
    """``raw`` in the compact wire format: row ``j`` (one prime) as integers of as many bytes
    as its largest residue needs (``ceil(bits(p) / 8)`` for uniform residues modulo ``p``)."""
    data = np.ascontiguousarray(raw.data, dtype="<u8")
    size, k, degree = data.shape
    if degree & (degree - 1) or not 1 <= k <= 255 or not 2 <= size <= CIPHERTEXT_SIZE_MAX:
        raise ProtocolError(f"ciphertext data of shape {data.shape} is not (size, k, 2^n)")
    largest = data.max(axis=(0, 2))
    widths = [max(1, -(-int(value).bit_length() // 8)) for value in largest]
    octets = data.view(np.uint8).reshape(size, k, degree, 8)
    meta = _COMPACT_META.pack(
        COMPACT_MAGIC,
        *raw.parms_id,
        int(raw.is_ntt_form),
        size,
        k,
        degree.bit_length() - 1,
        raw.scale,
        raw.correction_factor,
    )
    rows = (octets[:, j, :, :width].tobytes() for j, width in enumerate(widths))
    return meta + bytes(widths) + b"".join(rows)


def parse_compact(blob: bytes, seal_context: Any) -> RawCiphertext:
    """A :class:`RawCiphertext` from :func:`compact_bytes` output, checked against the context
    (level in its chain, sizes, length); reduction modulo each prime is checked on writing."""
    if len(blob) < _COMPACT_META.size:
        raise ProtocolError(f"compact ciphertext of {len(blob)} bytes is shorter than its header")
    magic, *fields = _COMPACT_META.unpack_from(blob)
    if magic != COMPACT_MAGIC:
        raise ProtocolError("not a compact fedfm ciphertext (bad magic)")
    parms_id = tuple(fields[:4])
    is_ntt, size, k, log_degree, scale, correction = fields[4:]
    primes = primes_of(seal_context, parms_id)
    degree = context_data(seal_context, parms_id).parms().poly_modulus_degree()
    if k != len(primes) or 1 << log_degree != degree or not 2 <= size <= CIPHERTEXT_SIZE_MAX:
        raise ProtocolError(
            f"compact ciphertext claims size {size}, {k} primes and N = 2^{log_degree}; its "
            f"level has {len(primes)} primes and N = {degree}"
        )
    offset = _COMPACT_META.size + k
    widths = list(blob[_COMPACT_META.size : offset])
    if len(widths) != k or not all(1 <= width <= 8 for width in widths):
        raise ProtocolError(f"compact ciphertext has invalid residue widths {widths}")
    expected = offset + size * degree * sum(widths)
    if len(blob) != expected or not math.isfinite(scale) or scale <= 0:
        raise ProtocolError(
            f"compact ciphertext has {len(blob)} bytes, expected {expected} (truncated?)"
        )
    octets = np.zeros((size, k, degree, 8), dtype=np.uint8)
    for j, width in enumerate(widths):
        chunk = size * degree * width
        part = np.frombuffer(blob, dtype=np.uint8, count=chunk, offset=offset)
        octets[:, j, :, :width] = part.reshape(size, degree, width)
        offset += chunk
    data = octets.view("<u8").reshape(size, k, degree).astype(np.uint64)
    return RawCiphertext(parms_id, bool(is_ntt), scale, data, correction)


# --- file exchange with SEAL ---------------------------------------------------------------


def scratch_root() -> str | None:
    """RAM-backed ``/dev/shm`` when present: the files only shuttle bytes in and out of SEAL."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


@functools.cache
def pid_namespace() -> str:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``; ``0`` where Linux's
    ``/proc`` is missing): a pid names a process only inside its namespace."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def scratch_prefix(kind: str) -> str:
    """``fedfm-<kind>-<pid namespace>-<pid>-``: the owner's pid (and the namespace it is valid
    in) in a scratch name lets a later process remove what a killed one left
    (:func:`sweep_stale_scratch`)."""
    return f"fedfm-{kind}-{pid_namespace()}-{os.getpid()}-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale_scratch(root: str | None = None) -> int:
    """Remove the scratch files and folders (:func:`scratch_prefix`) in ``root`` (default
    :func:`scratch_root`) whose owner process no longer runs; return how many. A process killed
    before its finalizers ran (a site stopped with SIGKILL, a timed-out worker) leaves them, and
    in ``/dev/shm`` a public context file holds its 17-200 MB of RAM until a reboot.

    Only entries made in this process's PID namespace are judged: containers sharing one
    ``/dev/shm`` (``--ipc=host``) see other namespaces' pids as dead or as someone else. Names
    without a namespace and an owner pid, other users' entries and a pid reused by a running
    process are left."""
    folder = root if root is not None else scratch_root()
    if folder is None:
        return 0
    removed = 0
    namespace = pid_namespace()
    for path in Path(folder).glob(f"fedfm-*-{namespace}-*-*"):
        parts = path.name.split("-")
        owner = parts[3] if len(parts) > 4 and parts[2] == namespace else ""
        if not owner.isdigit() or int(owner) == os.getpid() or _running(int(owner)):
            continue
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:  # another user's, or gone meanwhile
            continue
        removed += 1
    return removed


@functools.cache
def _swept_once() -> None:
    """Sweep stale scratch once per process, before its first scratch entry."""
    sweep_stale_scratch()


def _remove_folder(folder: str, owner_pid: int) -> None:
    # A forked worker inherits SealIO objects; collecting them there must not delete the
    # parent's scratch folder.
    if os.getpid() == owner_pid:
        shutil.rmtree(folder, ignore_errors=True)


def _read_direct(ciphertext: Any) -> RawCiphertext:
    return RawCiphertext(
        tuple(ciphertext.parms_id()),
        ciphertext.is_ntt_form(),
        ciphertext.scale,
        seal_memory.read_ciphertext_words(ciphertext),
        seal_memory.correction_factor(ciphertext),
    )


class SealIO:
    """Reads and writes SEAL objects of one context through a private scratch file.

    With ``direct`` (default: when :func:`direct_memory_available`), coefficients are
    read and written in SEAL's memory instead (no file, no compression): the same objects, about
    ten times faster. One instance reuses one file, so it is not safe to share between threads.
    """

    def __init__(self, context: Any, *, direct: bool | None = None) -> None:
        self.seal_context = seal_context_of(context)
        self.direct = direct_memory_available() if direct is None else direct
        _swept_once()
        self._folder = tempfile.mkdtemp(prefix=scratch_prefix("seal"), dir=scratch_root())
        self._path = str(Path(self._folder) / "object")
        self._finalizer = weakref.finalize(self, _remove_folder, self._folder, os.getpid())
        self._evaluator = sealapi.Evaluator(self.seal_context)

    def close(self) -> None:
        """Remove the scratch folder (also done when the object is collected)."""
        self._finalizer()

    def save(self, item: Any) -> bytes:
        """SEAL's serialization of ``item`` (zstd-compressed by SEAL)."""
        item.save(self._path)
        return Path(self._path).read_bytes()

    def load_ciphertext(self, blob: bytes) -> sealapi.Ciphertext:
        """A ciphertext of this context from the compact wire form or SEAL's own bytes."""
        if bytes(blob[: len(COMPACT_MAGIC)]) == COMPACT_MAGIC:
            return self.write_ciphertext(parse_compact(blob, self.seal_context))
        Path(self._path).write_bytes(blob)
        ciphertext = sealapi.Ciphertext(self.seal_context)
        try:
            ciphertext.load(self.seal_context, self._path)
        except Exception as error:  # SEAL raises ValueError/RuntimeError for bad data
            raise ProtocolError(f"SEAL refused the ciphertext: {error}") from None
        return ciphertext

    def load_plaintext(self, blob: bytes) -> sealapi.Plaintext:
        Path(self._path).write_bytes(blob)
        plaintext = sealapi.Plaintext()
        try:
            plaintext.load(self.seal_context, self._path)
        except Exception as error:  # SEAL raises ValueError/RuntimeError for bad data
            raise ProtocolError(f"SEAL refused the plaintext: {error}") from None
        return plaintext

    def read_ciphertext(self, ciphertext: Any) -> RawCiphertext:
        if not self.direct:
            return parse_ciphertext(self.save(ciphertext))
        return _read_direct(ciphertext)

    def write_ciphertext(self, raw: RawCiphertext) -> sealapi.Ciphertext:
        """A ciphertext holding ``raw``, checked as SEAL's ``load`` checks it."""
        if not self.direct:
            return self.load_ciphertext(ciphertext_bytes(raw))
        primes = primes_of(self.seal_context, raw.parms_id)
        return seal_memory.new_ciphertext(
            self.seal_context,
            raw.parms_id,
            primes,
            raw.is_ntt_form,
            raw.scale,
            raw.data,
            raw.correction_factor,
        )

    def read_plaintext(self, plaintext: Any) -> RawPlaintext:
        if self.direct:
            raw = RawPlaintext(
                tuple(plaintext.parms_id()),
                plaintext.scale,
                seal_memory.read_plaintext_words(plaintext),
            )
        else:
            raw = parse_plaintext(self.save(plaintext))
        degree = context_data(self.seal_context, raw.parms_id).parms().poly_modulus_degree()
        if raw.data.size % degree:
            raise ProtocolError(f"plaintext of {raw.data.size} words is not k x N for N={degree}")
        return RawPlaintext(raw.parms_id, raw.scale, raw.data.reshape(-1, degree))

    def write_plaintext(self, raw: RawPlaintext) -> sealapi.Plaintext:
        """A CKKS plaintext (NTT form, ``(k, N)`` data) holding ``raw``, checked like ``load``."""
        if not self.direct:
            return self.load_plaintext(plaintext_bytes(raw))
        primes = primes_of(self.seal_context, raw.parms_id)
        data = np.asarray(raw.data).reshape(len(primes), -1)
        return seal_memory.new_plaintext(raw.parms_id, primes, raw.scale, data)

    def _transform(self, parms_id: ParmsId, polys: np.ndarray, *, to_ntt: bool) -> np.ndarray:
        """``polys`` (m, k, N) through SEAL's NTT (forward or inverse) at level ``parms_id``."""
        polys = np.asarray(polys, dtype=np.uint64)
        if polys.ndim != 3:
            raise ProtocolError(f"polynomials must be (m, k, N), got shape {polys.shape}")
        count, k, degree = polys.shape
        out = np.empty_like(polys)
        start = 0
        while start < count:
            block = polys[start : start + CIPHERTEXT_SIZE_MAX]
            real = len(block)
            if real < 2 or not block[1:].any():
                # A guard (all ones) keeps the scratch ciphertext from being "transparent".
                real = min(real, CIPHERTEXT_SIZE_MAX - 1)
                guard = np.ones((1, k, degree), dtype=np.uint64)
                block = np.concatenate([block[:real], guard])
            scratch = self.write_ciphertext(RawCiphertext(parms_id, not to_ntt, 1.0, block))
            if to_ntt:
                self._evaluator.transform_to_ntt_inplace(scratch)
            else:
                self._evaluator.transform_from_ntt_inplace(scratch)
            out[start : start + real] = self.read_ciphertext(scratch).data[:real]
            start += real
        return out

    def add_ntt_inplace(self, ciphertext: Any, poly: np.ndarray) -> None:
        """``c0 += poly`` for residues ``poly`` (k, N) of an NTT-form polynomial.

        ``(poly, 0)`` goes in as a ciphertext of its own and SEAL adds it (SEAL refuses such a
        "transparent" ciphertext only as the result of an operation, not as an operand).
        """
        poly = np.asarray(poly, dtype=np.uint64)
        addend = np.zeros((2, *poly.shape), dtype=np.uint64)
        addend[0] = poly
        parms_id: ParmsId = tuple(ciphertext.parms_id())
        raw = RawCiphertext(parms_id, True, ciphertext.scale, addend)
        self._evaluator.add_inplace(ciphertext, self.write_ciphertext(raw))

    def to_ntt(self, parms_id: ParmsId, polys: np.ndarray) -> np.ndarray:
        """NTT form of the coefficient-form polynomials ``polys`` (m, k, N) at ``parms_id``."""
        return self._transform(parms_id, polys, to_ntt=True)

    def from_ntt(self, parms_id: ParmsId, polys: np.ndarray) -> np.ndarray:
        """Coefficient form of the NTT-form polynomials ``polys`` (m, k, N) at ``parms_id``."""
        return self._transform(parms_id, polys, to_ntt=False)


def seal_bytes(item: Any) -> bytes:
    """What ``item.save`` writes (SEAL's bindings only write to files)."""
    with tempfile.TemporaryDirectory(dir=scratch_root()) as folder:
        path = str(Path(folder) / "object")
        item.save(path)
        return Path(path).read_bytes()


def read_ciphertext(ciphertext: Any) -> RawCiphertext:
    """The fields and coefficients of a SEAL (or TenSEAL-held) ciphertext."""
    if direct_memory_available():
        return _read_direct(ciphertext)
    return parse_ciphertext(seal_bytes(ciphertext))


def plaintext_words(plaintext: Any) -> np.ndarray:
    """The coefficients of a SEAL plaintext, flat (``k * N`` words for a CKKS one)."""
    if direct_memory_available():
        return seal_memory.read_plaintext_words(plaintext)
    return parse_plaintext(seal_bytes(plaintext)).data


def dumps(ciphertext: Any) -> bytes:
    """The compact wire form of ``ciphertext`` (see the module docstring)."""
    return compact_bytes(read_ciphertext(ciphertext))


def write_ciphertext(context: Any, raw: RawCiphertext) -> sealapi.Ciphertext:
    """A SEAL ciphertext of ``context`` holding ``raw`` (validated by SEAL)."""
    io = SealIO(context)
    try:
        return io.write_ciphertext(raw)
    finally:
        io.close()


def read_plaintext(context: Any, plaintext: Any) -> RawPlaintext:
    """The fields and coefficients (k, N) of a SEAL CKKS plaintext of ``context``."""
    io = SealIO(context)
    try:
        return io.read_plaintext(plaintext)
    finally:
        io.close()


def write_plaintext(context: Any, raw: RawPlaintext) -> sealapi.Plaintext:
    """A SEAL CKKS plaintext of ``context`` holding ``raw`` (validated by SEAL)."""
    io = SealIO(context)
    try:
        return io.write_plaintext(raw)
    finally:
        io.close()


# --- modular arithmetic on uint64 arrays ---------------------------------------------------


def _check_prime(p: int) -> None:
    if not 1 < p < 1 << MAX_PRIME_BITS:
        raise CryptoParameterError(f"modulus {p} is outside (1, 2^{MAX_PRIME_BITS})")


def mulmod(a: np.ndarray, b: int, p: int) -> np.ndarray:
    """``a * b mod p`` elementwise for ``a`` reduced modulo ``p < 2^60`` and an integer ``b``.

    Horner's rule over ``c``-bit chunks of ``b`` with ``c = 63 - bits(p)`` (23 for a 40-bit
    prime): with ``acc, a < p < 2^bits(p)`` each step computes ``2^c acc + chunk a < 2^(c+1) p
    <= 2^64``, so ``uint64`` never overflows. Past :data:`_HORNER_STEPS` chunks (a large prime,
    e.g. 12 for 58 bits) Shoup's multiplication by a constant is cheaper: with ``w = floor(b 2^64
    / p)`` the estimate ``q = floor(a w / 2^64)`` is ``floor(a b / p)`` or one less, so ``a b -
    q p`` lies in ``[0, 2p)``, exact in wrapping ``uint64`` arithmetic; one conditional
    subtraction finishes.
    """
    _check_prime(p)
    a = np.asarray(a, dtype=np.uint64)
    b %= p
    width = 63 - p.bit_length()
    chunks = -(-b.bit_length() // width)
    if chunks > _HORNER_STEPS:
        return reduce_once(a * np.uint64(b) - _high_product(a, (b << 64) // p) * np.uint64(p), p)
    acc = np.zeros_like(a)
    for shift in range(width * (chunks - 1), -1, -width):
        acc <<= np.uint64(width)
        acc += a * np.uint64((b >> shift) & ((1 << width) - 1))
        acc %= np.uint64(p)
    return acc


# Horner steps beyond which Shoup's product is faster (measured: 3 steps cost about what
# Shoup's 20 array operations do).
_HORNER_STEPS = 3
_LOW32 = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def _high_product(a: np.ndarray, w: int) -> np.ndarray:
    """``floor(a * w / 2^64)`` for ``uint64`` ``a`` and an integer ``0 <= w < 2^64``, from 32-bit
    halves (no partial sum exceeds ``2^64 - 1``)."""
    a_low, a_high = a & _LOW32, a >> _32
    w_low, w_high = np.uint64(w & 0xFFFFFFFF), np.uint64(w >> 32)
    middle = a_high * w_low + ((a_low * w_low) >> _32)
    middle_low = a_low * w_high + (middle & _LOW32)
    return a_high * w_high + (middle >> _32) + (middle_low >> _32)


def reduce_once(values: np.ndarray, p: int) -> np.ndarray:
    """``values`` in ``[0, 2p)`` reduced into ``[0, p)``: ``values - p`` wraps around to above
    ``values`` exactly when ``values < p``, so the minimum of the two is the reduction (cheaper
    than NumPy's ``uint64`` remainder or a ``where``)."""
    return np.minimum(values, values - np.uint64(p))


def addmod(a: np.ndarray, b: np.ndarray, p: int) -> np.ndarray:
    """``a + b mod p`` for ``a, b`` reduced modulo ``p < 2^60``."""
    return reduce_once(np.asarray(a, dtype=np.uint64) + np.asarray(b, dtype=np.uint64), p)


def submod(a: np.ndarray, b: np.ndarray, p: int) -> np.ndarray:
    """``a - b mod p`` for ``a, b`` reduced modulo ``p < 2^60``."""
    shifted = np.asarray(a, dtype=np.uint64) + np.uint64(p)
    return reduce_once(shifted - np.asarray(b, dtype=np.uint64), p)


def radix_digits(value: int, primes: Sequence[int]) -> list[int]:
    """Digits ``d_j < q_j`` of ``0 <= value < prod(primes)`` in the mixed radix of ``primes``:
    ``value = d0 + q0 (d1 + q1 (d2 + ...))``."""
    digits = []
    for prime in primes:
        value, digit = divmod(value, prime)
        digits.append(digit)
    if value:
        raise InvariantError("a value beyond the product of its radix primes")
    return digits


def _lexicographic(
    digits: Sequence[np.ndarray], constant: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``(less, equal)``: whether each mixed-radix number is below / equal to ``constant``
    (its digits), comparing from the most significant digit."""
    less = np.zeros(digits[0].shape, dtype=bool)
    equal = np.ones(digits[0].shape, dtype=bool)
    for digit, bound in zip(reversed(digits), reversed(constant), strict=True):
        less |= equal & (digit < np.uint64(bound))
        equal &= digit == np.uint64(bound)
    return less, equal


@dataclass(frozen=True, eq=False)
class MixedRadix:
    """Integers ``x = d0 + q0 (d1 + q1 (d2 + ...)) - negative * Q`` with ``0 <= d_j < q_j`` and
    ``Q = q0 q1 ...``: the exact centered lift of residues modulo ``Q``. ``negative`` marks the
    entries whose representative in ``[0, Q)`` exceeds ``Q / 2``."""

    digits: tuple[np.ndarray, ...]
    negative: np.ndarray
    primes: tuple[int, ...]

    @property
    def a0(self) -> np.ndarray:
        """The lowest digit: ``x mod q0``."""
        return self.digits[0]

    @property
    def q0(self) -> int:
        return self.primes[0]

    @property
    def modulus(self) -> int:
        """``Q``, the product of the primes."""
        return math.prod(self.primes)

    def residues(self, primes: list[int]) -> np.ndarray:
        """``x mod p`` for each prime (stacked on a new first axis), vectorised; modulo ``q0``
        that is ``a0`` itself."""
        out = []
        for p in primes:
            _check_prime(p)
            if p == self.q0:
                out.append(self.a0)
                continue
            value = self.a0 % np.uint64(p)
            weight = 1
            for digit, below in zip(self.digits[1:], self.primes[:-1], strict=True):
                weight *= below
                value = addmod(value, mulmod(digit % np.uint64(p), weight, p), p)
            wrap = np.full_like(value, self.modulus % p)
            out.append(np.where(self.negative, submod(value, wrap, p), value))
        return np.stack(out)

    def to_int(self) -> np.ndarray:
        """Exact integers as a NumPy object array of Python ``int`` (for inspection)."""
        value = np.zeros(self.a0.shape, dtype=object)
        for digit, prime in zip(reversed(self.digits), reversed(self.primes), strict=True):
            value = value * prime + digit.astype(object)
        return value - self.negative.astype(object) * self.modulus

    def to_float(self) -> np.ndarray:
        """The integers as ``float64`` (rounded)."""
        value = np.zeros(self.a0.shape, dtype=np.float64)
        for digit, prime in zip(reversed(self.digits), reversed(self.primes), strict=True):
            value = value * float(prime) + digit.astype(np.float64)
        return value - self.negative * float(self.modulus)

    def within(self, bound: int) -> np.ndarray:
        """Whether ``|x| <= bound`` (for ``0 <= bound < Q / 2``), exactly, on the digits."""
        if not 0 <= bound < self.modulus // 2:
            raise InvariantError(f"a bound of {bound.bit_length()} bits for a lift modulo Q")
        less, equal = _lexicographic(self.digits, radix_digits(bound, self.primes))
        if bound == 0:
            return ~self.negative & equal
        below, _ = _lexicographic(self.digits, radix_digits(self.modulus - bound, self.primes))
        # x >= 0: x <= bound; x < 0: its representative X = x + Q is at least Q - bound
        return np.where(self.negative, ~below, less | equal)


def crt_lift_many(residues: Sequence[np.ndarray], primes: Sequence[int]) -> MixedRadix:
    """Centered integers ``x`` with ``x = residues[j] mod primes[j]``, ``|x| <= Q / 2``.

    Garner: digit ``d_j = (r_j - (d0 + q0 d1 + ... )) (q0 ... q_{j-1})^-1 mod q_j``; ``x > Q // 2``
    exactly when its digits exceed those of ``Q // 2`` (compared from the most significant).
    """
    primes = tuple(int(p) for p in primes)
    if len(primes) < 1 or len(residues) != len(primes):
        raise ProtocolError(f"{len(residues)} residue rows for {len(primes)} primes")
    for prime in primes:
        _check_prime(prime)
    digits = [np.asarray(residues[0], dtype=np.uint64)]
    for j in range(1, len(primes)):
        q = primes[j]
        partial = digits[0] % np.uint64(q)
        weight = 1
        for i in range(1, j):
            weight *= primes[i - 1]
            partial = addmod(partial, mulmod(digits[i] % np.uint64(q), weight, q), q)
        weight *= primes[j - 1]
        difference = submod(np.asarray(residues[j], dtype=np.uint64), partial, q)
        digits.append(mulmod(difference, pow(weight, -1, q), q))
    less, equal = _lexicographic(digits, radix_digits(math.prod(primes) // 2, primes))
    return MixedRadix(tuple(digits), ~(less | equal), primes)


def crt_lift(r0: np.ndarray, r1: np.ndarray, q0: int, q1: int) -> MixedRadix:
    """:func:`crt_lift_many` for two primes."""
    return crt_lift_many([r0, r1], [q0, q1])


# The direct path's self-test lives here, beside both paths it compares (seal_memory stays below
# this module: it knows SEAL's memory layout, not its files).
@functools.cache
def direct_memory_available() -> bool:
    """Whether direct access works in this process (probed once; see the module docstring)."""
    if os.environ.get(seal_memory.SWITCH_VARIABLE, "").strip() == "0":
        return False
    try:
        return _probe_direct_memory()
    except Exception as error:  # any surprise means: do not touch SEAL's memory
        _LOG.info("direct SEAL memory access unavailable (%s); using save/load", error)
        return False


def _probe_direct_memory() -> bool:
    """Compare direct reads and writes with SEAL's own serialization on a small context."""
    context = ts.context(ts.SCHEME_TYPE.CKKS, 4096, coeff_mod_bit_sizes=[40, 20, 40])
    seal_context = context.seal_context().data
    io = SealIO(seal_context, direct=False)
    try:
        top = seal_context.first_context_data()
        parms_id = tuple(top.parms_id())
        primes = [m.value() for m in top.parms().coeff_modulus()]
        rng = np.random.default_rng(0)
        data = np.stack([rng.integers(0, p, size=(3, 4096), dtype=np.uint64) for p in primes], 1)
        expected = RawCiphertext(parms_id, True, 2.0**37, data, 1)
        loaded = io.write_ciphertext(expected)  # made by SEAL's load
        if not np.array_equal(seal_memory.read_ciphertext_words(loaded), data):
            return False
        made = seal_memory.new_ciphertext(seal_context, parms_id, primes, True, 2.0**37, data, 1)
        found = io.read_ciphertext(made)  # read by SEAL's save
        if (
            found.parms_id != parms_id
            or not found.is_ntt_form
            or found.scale != 2.0**37
            or found.correction_factor != 1
            or not np.array_equal(found.data, data)
        ):
            return False
        plain = data[0]
        loaded_plain = io.write_plaintext(RawPlaintext(parms_id, 2.0**30, plain))
        if not np.array_equal(seal_memory.read_plaintext_words(loaded_plain), plain.ravel()):
            return False
        found_plain = io.read_plaintext(seal_memory.new_plaintext(parms_id, primes, 2.0**30, plain))
        return (
            found_plain.parms_id == parms_id
            and found_plain.scale == 2.0**30
            and np.array_equal(found_plain.data, plain)
        )
    finally:
        io.close()
