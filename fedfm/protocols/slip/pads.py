"""Charlie's one-time pads and their cancellation masks, precomputed offline (spec 003 §4.1 (0)).

For every layer key David evaluates on masked inputs, Charlie draws pad rows ``r`` uniform over
the ring from the OS CSPRNG and computes ``c = W_D r`` (mod 2**64) with David's *encoded*
weights, before any input exists. Online, a request takes fresh rows; a pad is used once:

* taking a row that was taken before raises :class:`ProtocolError` (reuse: two masked messages
  under one pad reveal the difference of two activations);
* asking for more rows than are left raises :class:`ProtocolError` (a missing pad: Charlie never
  falls back to sending an unmasked activation).

The store is Charlie's secret. Saved (:meth:`PadStore.save`), it is a folder with the pads
(``pads.npz``) and a ledger of consumed rows (``ledger.json``), rewritten on every take so that
a second run from the same files cannot reuse them either.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.slip.ring import ring_matmul, uniform_pads

PADS_FILE, LEDGER_FILE = "pads.npz", "ledger.json"


@dataclass
class LayerPads:
    """One layer key's pads ``r`` (rows x n), masks ``c`` (rows x m) and consumed count."""

    pads: np.ndarray
    masks: np.ndarray
    used: int = 0

    @property
    def capacity(self) -> int:
        return int(self.pads.shape[0])


@dataclass
class PadStore:
    """Precomputed pads per layer key (see the module docstring)."""

    layers: dict[str, LayerPads] = field(default_factory=dict)
    folder: Path | None = None  # where take() records consumption, if saved
    precompute_seconds: float = 0.0

    @classmethod
    def precompute(
        cls, weights: Mapping[str, np.ndarray], keys: Iterable[str], rows: int
    ) -> PadStore:
        """``rows`` fresh pad rows for each of ``keys`` (encoded weights ``(m, n)`` by key)."""
        import time

        if rows < 1:
            raise ConfigError(f"precompute at least one pad row, got {rows}")
        start = time.perf_counter()
        layers = {}
        for key in keys:
            if key not in weights:
                raise ConfigError(f"no weight for pad key {key!r}")
            weight = weights[key]
            pads = uniform_pads((rows, weight.shape[1]))
            layers[key] = LayerPads(pads, ring_matmul(pads, weight))
        return cls(layers, precompute_seconds=time.perf_counter() - start)

    @property
    def nbytes(self) -> int:
        """Storage of the pads and masks (bytes)."""
        return sum(p.pads.nbytes + p.masks.nbytes for p in self.layers.values())

    def remaining(self, key: str) -> int:
        pads = self.layers.get(key)
        return 0 if pads is None else pads.capacity - pads.used

    def take(self, key: str, rows: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The next ``rows`` unused pad rows of ``key``: ``(first row, r, c)``, marked used."""
        pads = self.layers.get(key)
        if pads is None:
            raise ProtocolError(f"no pad for layer {key!r}: Charlie precomputed none")
        self._sync()
        if pads.used + rows > pads.capacity:
            raise ProtocolError(
                f"missing pad for layer {key!r}: {rows} rows asked, "
                f"{pads.capacity - pads.used} of {pads.capacity} left; precompute more"
            )
        first = pads.used
        return first, *self.take_rows(key, first, rows)

    def take_rows(self, key: str, first: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``first .. first + rows`` of ``key``; :class:`ProtocolError` if any was used."""
        pads = self.layers.get(key)
        if pads is None:
            raise ProtocolError(f"no pad for layer {key!r}: Charlie precomputed none")
        self._sync()
        if first < pads.used:
            raise ProtocolError(
                f"pad rows {first}..{first + rows - 1} of layer {key!r} were used before: a "
                "one-time pad is never reused"
            )
        if first + rows > pads.capacity:
            raise ProtocolError(f"missing pad for layer {key!r}: rows beyond {pads.capacity}")
        pads.used = first + rows
        self._record()
        return pads.pads[first : first + rows], pads.masks[first : first + rows]

    # -- files --------------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        """Write the store to ``folder`` and record every later take there."""
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {}
        for index, pads in enumerate(self.layers.values()):
            arrays[f"r{index}"], arrays[f"c{index}"] = pads.pads, pads.masks
        np.savez(folder / PADS_FILE, **arrays)  # type: ignore[arg-type]
        self.folder = folder
        self._record()

    def _sync(self) -> None:
        """Take the ledger on disk as the truth: another process (a Flower worker) holding the
        same store may have consumed rows since this one was loaded."""
        if self.folder is not None and (self.folder / LEDGER_FILE).exists():
            used = json.loads((self.folder / LEDGER_FILE).read_text())["used"]
            for key, pads in self.layers.items():
                pads.used = max(pads.used, int(used.get(key, 0)))

    def _record(self) -> None:
        if self.folder is not None:
            ledger = {key: pads.used for key, pads in self.layers.items()}
            path = self.folder / LEDGER_FILE
            path.with_suffix(".tmp").write_text(json.dumps({"keys": list(ledger), "used": ledger}))
            path.with_suffix(".tmp").replace(path)

    @classmethod
    def load(cls, folder: Path) -> PadStore:
        """The store saved in ``folder``, with its consumed rows."""
        try:
            ledger = json.loads((folder / LEDGER_FILE).read_text())
            with np.load(folder / PADS_FILE) as data:
                layers = {
                    key: LayerPads(data[f"r{i}"], data[f"c{i}"], int(ledger["used"][key]))
                    for i, key in enumerate(ledger["keys"])
                }
        except (OSError, KeyError, ValueError) as error:
            raise ConfigError(f"no readable pad store in {folder}: {error}") from None
        return cls(layers, folder=folder)
