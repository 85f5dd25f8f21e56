"""SLIP as a protocol of the fedfm runtime: ``charlie`` (trusted) and ``david`` (untrusted).

Roles (spec 003 §2): ``charlie`` holds ``W_C`` (factored), the precomputed pads, the input and
the output; ``david`` holds ``W_D`` of the split layers and every other linear layer whole, as a
file the model owner provisioned (never a message). One inference of a causal LM on Charlie's
prompt; steps ``request_0, answer_0, ..., request_{R-1}, answer_{R-1}, output``: Charlie sends a
request (masked activations, :mod:`~fedfm.protocols.slip.hybrid`), David answers ``W_D (a +
r)``, Charlie unmasks and continues. ``R`` is the model's request count (one per group of
linear layers sharing an input, plus one per attention in double-step mode).

Inputs: Charlie ``input_ids`` (token ids), ``share`` (the folder :func:`provision` wrote for
him, as UTF-8 bytes) and optionally ``report_key`` (32 bytes): he publishes the output (the
logits of the last position and the greedy next token) sealed under it, so the relay cannot
read it (:func:`open_report`). David ``share`` (his weight file, as UTF-8 bytes). Tests and
benchmarks pass the parties in code (``parties=``) instead.

A runtime step cannot block on David, and a node keeps only arrays between steps: Charlie's
step replays the forward with the David parts received so far (kept in his node state, never
sent) and stops at the next request (:meth:`~fedfm.protocols.slip.hybrid.Charlie.resume`). The
replay recomputes Charlie's own work; ``fedfm bench-slip`` times the single-pass driver.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.errors import ConfigError, InvariantError, ProtocolError
from fedfm.protocols.slip.decomposition import build_plan
from fedfm.protocols.slip.defaults import DEFAULTS
from fedfm.protocols.slip.hybrid import (
    ATTENTIONS,
    COMPOSITIONS,
    Charlie,
    CharlieShare,
    David,
    Pause,
    decompose,
    linear_layers,
    load_david,
    request_count,
    save_david,
)
from fedfm.protocols.slip.pads import PadStore
from fedfm.runtime.payload import pack_arrays, unpack_arrays
from fedfm.runtime.protocol import Protocol, RoleContext, Step, StepAction, config_choice
from fedfm.runtime.transport import ConfigValue
from fedfm.secagg.channel import KEY_BYTES, open_sealed, seal

CHARLIE, DAVID = "charlie", "david"
REPORT_LABEL = b"fedfm-slip-report-v1|"
CHARLIE_FILE, PADS_FOLDER, DAVID_FILE = "charlie.npz", "pads", "david.npz"
EXAMPLE_TOKENS = 4  # the traced forward's length (the structure does not depend on it)


@dataclass(frozen=True)
class SlipSettings:
    """A run's settings: the run config's keys (:data:`DEFAULTS`), validated."""

    model: str
    decoder_cache: str
    blocks: str
    layers: str
    rank: int
    composition: str
    attention: str

    def parameters(self) -> dict[str, ConfigValue]:
        """Everything both parties must agree on (part of the signed protocol digest)."""
        return {
            "model": self.model,
            "blocks": self.blocks,
            "layers": self.layers,
            "rank": self.rank,
            "composition": self.composition,
            "attention": self.attention,
        }


def _choice(config: Mapping[str, ConfigValue], key: str, choices: tuple[str, ...]) -> str:
    return config_choice("slip", config, key, choices)


def settings_from_config(config: Mapping[str, ConfigValue] | None) -> SlipSettings:
    """Validated settings; :class:`ConfigError` names an unknown key or a bad value."""
    merged = {**DEFAULTS, **(config or {})}
    unknown = sorted(set(merged) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown slip run config keys {unknown}; known: {sorted(DEFAULTS)}")
    rank = merged["rank"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 2:
        raise ConfigError(
            f"slip rank must be an integer >= 2, got {rank!r}: with k = 1 David recovers W_C "
            "from W_D alone up to its scale (spec App. A.1)"
        )
    return SlipSettings(
        model=str(merged["model"]),
        decoder_cache=str(merged["decoder-cache"]),
        blocks=str(merged["blocks"]),
        layers=str(merged["layers"]),
        rank=rank,
        composition=_choice(merged, "composition", COMPOSITIONS),
        attention=_choice(merged, "attention", ATTENTIONS),
    )


# -- the model and the parties --------------------------------------------------------------------

_CACHE: dict[Any, Any] = {}
_CACHE_LOCK = threading.RLock()  # a cached value may be made from another


def _cached(key: Any, make: Any) -> Any:
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = make()
        return _CACHE[key]


def load_model(settings: SlipSettings) -> Any:
    """The causal LM the run config names (embedded decoders from ``decoder-cache``): the
    model owner's, and Charlie's for everything but the split weights. Cached per process;
    callers get a copy."""
    from fedfm.models.decoder import DecoderSource, load_decoder
    from fedfm.models.decoder.config import EMBEDDED_DECODERS

    def make() -> Any:
        source: Any = settings.model
        if settings.model in EMBEDDED_DECODERS:
            source = DecoderSource(name=settings.model, cache_dir=Path(settings.decoder_cache))
        model, _ = load_decoder(source, attn_implementation="eager", progress=False)
        return model

    return copy.deepcopy(_cached(("model", settings.model, settings.decoder_cache), make))


def example_inputs(tokens: int = EXAMPLE_TOKENS) -> dict[str, Any]:
    import torch

    return {"input_ids": torch.full((1, tokens), 3, dtype=torch.long)}


def plan_for(model: Any, settings: SlipSettings) -> dict[str, int]:
    """The split layers the settings name, ``k`` each."""
    return build_plan(
        linear_layers(model), blocks=settings.blocks, types=settings.layers, rank=settings.rank
    )


def provision(model: Any, settings: SlipSettings, folder: Path, *, rows: int) -> tuple[Path, Path]:
    """The model owner's offline step: decompose ``model``, write David's weight file and
    Charlie's folder (his factors and ``rows`` precomputed pad rows per masked layer)."""
    decomposition = decompose(model, plan_for(model, settings))
    folder.mkdir(parents=True, exist_ok=True)
    david_path, charlie_folder = folder / DAVID_FILE, folder / CHARLIE
    save_david(decomposition.david, david_path)
    charlie_folder.mkdir(exist_ok=True)
    share = decomposition.charlie_share()
    share.save(charlie_folder / CHARLIE_FILE)
    charlie = Charlie(
        copy.deepcopy(model),
        share,
        example_inputs(),
        composition=settings.composition,
        attention=settings.attention,
    )
    charlie.precompute_pads(decomposition.david_share(), rows).save(charlie_folder / PADS_FOLDER)
    return charlie_folder, david_path


@dataclass
class Parties:
    """Both parties in this process (tests, benchmarks): the run's inputs name none."""

    charlie: Charlie
    david: David


def _path_input(context: RoleContext, name: str) -> Path:
    return Path(np.asarray(context.input(name), dtype=np.uint8).tobytes().decode())


def _charlie(context: RoleContext, settings: SlipSettings, parties: Parties | None) -> Charlie:
    if parties is not None:
        return parties.charlie
    folder = _path_input(context, "share")

    def make() -> Charlie:
        share = CharlieShare.load(folder / CHARLIE_FILE)
        return Charlie(
            load_model(settings),
            share,
            example_inputs(),
            composition=settings.composition,
            attention=settings.attention,
            pads=PadStore.load(folder / PADS_FOLDER),
        )

    charlie: Charlie = _cached(("charlie", str(folder), settings), make)
    return charlie


def _david(context: RoleContext, parties: Parties | None) -> David:
    if parties is not None:
        return parties.david
    path = _path_input(context, "share")
    david: David = _cached(("david", str(path)), lambda: load_david(path))
    return david


# -- Charlie's sealed report ----------------------------------------------------------------------


def _report_key(context: RoleContext) -> bytes | None:
    key = context.inputs.get("report_key")
    if key is None:
        return None
    data = np.asarray(key, dtype=np.uint8).tobytes()
    if len(data) != KEY_BYTES:
        raise ConfigError(f"charlie's report_key must be {KEY_BYTES} bytes, got {len(data)}")
    return data


def open_report(key: bytes, sealed: np.ndarray) -> dict[str, np.ndarray]:
    """What Charlie published sealed under ``key`` (his operator's ``report_key``)."""
    data = np.asarray(sealed, dtype=np.uint8).tobytes()
    return unpack_arrays(open_sealed(key, data, REPORT_LABEL + CHARLIE.encode(), "slip report"))


# -- the steps -------------------------------------------------------------------------------------

ANSWER, PENDING = "answer", "pending"


def _inputs(context: RoleContext) -> dict[str, Any]:
    import torch

    ids = np.asarray(context.input("input_ids"))
    if ids.dtype.kind not in "iu" or ids.size == 0:
        raise ConfigError(f"charlie's input_ids must be token ids, got {ids.dtype}{ids.shape}")
    return {"input_ids": torch.from_numpy(ids.reshape(1, -1).astype(np.int64))}


def _answered(state: Mapping[str, np.ndarray], count: int) -> list[dict[str, np.ndarray]]:
    answers: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
    for name, value in state.items():
        if name.startswith(ANSWER + "."):
            _, index, key = name.split(".", 2)
            answers[int(index)][key] = value
    return answers


def _charlie_step(
    settings: SlipSettings, parties: Parties | None, index: int, total: int
) -> StepAction:
    def act(context: RoleContext) -> None:
        charlie = _charlie(context, settings, parties)
        state = context.state
        if index > 0:
            reply = context.receive(DAVID)
            masks = {
                name[len(PENDING) + 1 :]: value
                for name, value in state.items()
                if name.startswith(PENDING + ".")
            }
            parts = charlie.unmask(reply, masks)
            for key in list(state):
                if key.startswith(PENDING + "."):
                    del state[key]
            for key, value in parts.items():
                state[f"{ANSWER}.{index - 1}.{key}"] = value
        try:
            output = charlie.resume(_inputs(context), _answered(state, index))
        except Pause as pause:
            if pause.index != index or index >= total:
                raise InvariantError(
                    f"charlie paused at request {pause.index} in step {index} of {total}"
                ) from None
            for key, mask in pause.masks.items():
                state[f"{PENDING}.{key}"] = mask
            context.send(DAVID, pause.request)
            return
        if index != total:
            raise ProtocolError(f"the forward ended after {index} requests, {total} declared")
        logits = output.logits[0, -1].detach().double().numpy()
        report = {"logits": logits, "next_token": np.asarray([int(logits.argmax())])}
        report_key = _report_key(context)
        if report_key is not None:
            sealed = seal(report_key, pack_arrays(report), REPORT_LABEL + CHARLIE.encode())
            context.publish("report", np.frombuffer(sealed, dtype=np.uint8))
        for key_name in list(state):
            del state[key_name]  # nothing of this inference outlives it on Charlie's node

    return act


def _david_step(parties: Parties | None) -> StepAction:
    def act(context: RoleContext) -> None:
        david = _david(context, parties)
        context.send(CHARLIE, david.answer(context.receive(CHARLIE)))

    return act


def slip(
    config: Mapping[str, ConfigValue] | None = None, *, parties: Parties | None = None
) -> Protocol:
    """The SLIP protocol for the run config keys ``config`` (module docstring)."""
    settings = settings_from_config(config)
    if parties is not None:
        total = parties.charlie.requests
    else:
        total = _cached(
            ("requests", settings.model, settings.decoder_cache, settings.attention),
            lambda: request_count(load_model(settings), example_inputs(), settings.attention),
        )
    steps: list[Step] = []
    for index in range(total):
        steps.append(
            Step(f"request_{index}", (CHARLIE,), _charlie_step(settings, parties, index, total))
        )
        steps.append(Step(f"answer_{index}", (DAVID,), _david_step(parties)))
    steps.append(Step("output", (CHARLIE,), _charlie_step(settings, parties, total, total)))
    return Protocol(
        name="slip",
        roles=(CHARLIE, DAVID),
        channels=((CHARLIE, DAVID),),
        separated=((CHARLIE, DAVID),),
        steps=tuple(steps),
        parameters={**settings.parameters(), "requests": total},
    )
