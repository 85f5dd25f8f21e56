"""A party's secret randomness: a keyed stream cipher, never a seed another party knows.

Permutations, batch draws and masks are secrets of the party that draws them. NumPy's generators
(PCG64, Mersenne Twister) are fast but not cryptographic: from enough of their outputs their state,
and with it every later output, can be recovered, and a client of double-blind adaptation sees
relative permutations, i.e. functions of the server's draws. :class:`SecretStream` draws from the
AES-256-CTR keystream of a 256-bit key: from the OS CSPRNG by default, or read from a file only
its owner reads (:func:`load_secret_file`) for reproducible research runs.

The stream's position is part of its state (:meth:`SecretStream.state`), so a checkpointed run
resumes with exactly the draws it would have made; the state holds the key and belongs on the
owner's disk only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedfm.errors import ConfigError

KEY_BYTES = 32
_BLOCK = 16  # AES block: the keystream is consumed in whole blocks
_WORD = 1 << 64


class SecretStream:
    """Uniform integers, permutations and samples from the AES-256-CTR keystream of ``key``.

    Parameters
    ----------
    key:
        32 secret bytes; ``None`` draws them from the operating system (``os.urandom``).
    position:
        Keystream blocks already consumed (for :meth:`restore`).
    """

    def __init__(self, key: bytes | None = None, *, position: int = 0) -> None:
        key = os.urandom(KEY_BYTES) if key is None else key
        if len(key) != KEY_BYTES:
            raise ConfigError(f"a secret stream key has {KEY_BYTES} bytes, got {len(key)}")
        if position < 0:
            raise ConfigError(f"a keystream position is >= 0, got {position}")
        self._key = bytes(key)
        self._position = position

    @classmethod
    def from_file(cls, path: Path) -> SecretStream:
        """A stream keyed by the secret file at ``path`` (see :func:`load_secret_file`)."""
        return cls(load_secret_file(path))

    # -- raw material ------------------------------------------------------------------------
    def random_bytes(self, count: int) -> bytes:
        """The next ``count`` keystream bytes (rounded up to whole AES blocks internally)."""
        blocks = -(-count // _BLOCK)
        counter = self._position.to_bytes(_BLOCK, "big")
        cipher = Cipher(algorithms.AES(self._key), modes.CTR(counter)).encryptor()
        self._position += blocks
        return cipher.update(bytes(blocks * _BLOCK))[:count]

    def words(self, count: int) -> np.ndarray:
        """``count`` uniform 64-bit words."""
        return np.frombuffer(self.random_bytes(8 * count), dtype="<u8").astype(np.uint64)

    # -- numpy Generator-like API (the subset the protocols use) ------------------------------
    def integers(self, high: int, size: int | None = None) -> Any:
        """Uniform integers in ``[0, high)`` (rejection sampling: no modulo bias)."""
        if not 0 < high <= _WORD:
            raise ConfigError(f"integers(high) needs 0 < high <= 2**64, got {high}")
        count = 1 if size is None else size
        limit = np.uint64(_WORD - (_WORD % high)) if _WORD % high else None
        kept: list[np.ndarray] = []
        have = 0
        while have < count:
            words = self.words(count - have + 8)
            if limit is not None:
                words = words[words < limit]
            kept.append(words[: count - have])
            have += kept[-1].size
        values = (np.concatenate(kept) % np.uint64(high)).astype(np.int64)
        return int(values[0]) if size is None else values

    def permutation(self, n: int) -> np.ndarray:
        """A uniformly random permutation of ``range(n)``.

        The order of ``n`` independent uniform 64-bit keys; a tie (probability below
        ``n^2 / 2^65``) is redrawn, so every permutation is exactly equally likely.
        """
        if n < 0:
            raise ConfigError(f"permutation size must be >= 0, got {n}")
        while True:
            keys = self.words(n)
            if np.unique(keys).size == n:
                return np.argsort(keys, kind="stable").astype(np.int64)

    def choice(self, total: int, size: int, replace: bool = False) -> np.ndarray:
        """``size`` distinct indices of ``range(total)`` in random order (no replacement)."""
        if replace:
            raise ConfigError("SecretStream.choice draws without replacement only")
        if not 0 <= size <= total:
            raise ConfigError(f"cannot draw {size} distinct items of {total}")
        return self.permutation(total)[:size]

    def torch_seed(self) -> int:
        """A 63-bit seed for a torch generator (for values that are not secret once drawn,
        such as the initial adapter every client receives)."""
        return int(self.integers(1 << 63))

    # -- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Key and position (secret: keep it on the owner's disk only)."""
        return {"kind": "secret", "key": self._key.hex(), "position": self._position}


class ResearchStream:
    """The same draws from NumPy's seeded PCG64: reproducible and **not secret**.

    For in-process experiments in which one researcher plays every party (paper tables, sweeps,
    attack measurements), so that their results regenerate exactly; never for a run with
    another party: anyone who knows ``seed`` recomputes every permutation.
    """

    def __init__(self, seed: int) -> None:
        self._generator = np.random.default_rng(seed)

    def integers(self, high: int, size: int | None = None) -> Any:
        return self._generator.integers(high, size=size)

    def permutation(self, n: int) -> np.ndarray:
        return self._generator.permutation(n)

    def choice(self, total: int, size: int, replace: bool = False) -> np.ndarray:
        return self._generator.choice(total, size=size, replace=replace)

    def torch_seed(self) -> int:
        # two steps, as fedfm drew the adapter's seed before secret streams existed, so that
        # earlier results regenerate unchanged
        generator = torch.Generator().manual_seed(int(self._generator.integers(2**31)))
        return int(torch.randint(2**31, (1,), generator=generator))

    def state(self) -> dict[str, Any]:
        return {"kind": "research", "bit_generator": self._generator.bit_generator.state}


RandomSource = SecretStream | ResearchStream
"""What a protocol party draws its secrets from (the protocols accept either)."""


def restore_stream(state: dict[str, Any]) -> RandomSource:
    """The stream a ``state()`` described, at the same position."""
    try:
        if state.get("kind") == "research":
            stream = ResearchStream(0)
            stream._generator.bit_generator.state = state["bit_generator"]
            return stream
        return SecretStream(bytes.fromhex(str(state["key"])), position=int(state["position"]))
    except (KeyError, ValueError, TypeError) as error:
        raise ConfigError(f"a damaged random stream state: {error!r}") from error


def write_secret_file(path: Path) -> None:
    """Write 32 fresh secret bytes to ``path``, readable by its owner only (mode 0600).

    Raises
    ------
    ConfigError
        If ``path`` exists (a secret is never overwritten).
    """
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists; a secret file is never overwritten") from None
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(os.urandom(KEY_BYTES).hex().encode() + b"\n")


def load_secret_file(path: Path) -> bytes:
    """The 32-byte key in ``path`` (64 hex digits, as :func:`write_secret_file` writes).

    Raises
    ------
    ConfigError
        If the file is missing, readable by group or others, or not 64 hex digits.
    """
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as error:
        raise ConfigError(f"cannot read the secret file {path}: {error.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"the secret file {path} is accessible to group or others "
            f"(mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}"
        )
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"the secret file {path} must hold {2 * KEY_BYTES} hex digits")
    return key
