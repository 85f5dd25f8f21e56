"""Latency and bytes per query of HELIX inference, encrypted and plaintext (``fedfm bench-helix``).

Both paths run through the fedfm runtime in this process, as whole protocol runs (hello, then
``query``, ``classify``, ``reveal``), with the real encoders: the provider's head on ``g_A``,
the client's queries through ``g_B`` and its map ``W*`` (itself learned first by an encrypted
``align`` run, timed and checked against the plaintext ridge solution):

* **encrypted**: :func:`fedfm.protocols.helix.helix` in ``infer`` mode, fresh CKKS keys per run;
  one query (``rows`` layout) and a batch (``features`` layout, up to N/2 queries per ciphertext);
* **plaintext**: the same steps with ``z_B W* + b*`` sent in the clear to the provider (still
  sealed by the runtime's channel), logits sent back: what HELIX costs over no HE at all.

Per configuration: the median wall time of ``repeats`` runs divided by the queries, and the
bytes of every frame between the two roles (both directions, keys included) per query. Queries
are the client's task queries, repeated to fill the batch.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.data.stdlib_text import build_splits
from fedfm.experiments.helix_evaluation import embed_party, train_head
from fedfm.experiments.results import write_results
from fedfm.protocols.helix.ckks import ClientKeys
from fedfm.protocols.helix.packing import inference_layout
from fedfm.protocols.helix.protocol import (
    MAP_BIAS,
    MAP_WEIGHT,
    PROVIDER,
    _mapping_from_inputs,
    _provider_head,
    _publish_report,
    client_role,
    helix,
    open_report,
)
from fedfm.protocols.helix.ridge import fit_alignment
from fedfm.runtime import Protocol, RoleContext, Step, run_in_process
from fedfm.runtime.transport import ConfigValue

CLIENT = client_role(0)


def _plain_query(context: RoleContext) -> None:
    aligned = _mapping_from_inputs(context).apply(context.input("queries"))
    context.send(PROVIDER, {"aligned": aligned})


def _plain_classify(context: RoleContext) -> None:
    weight, bias = _provider_head(context)
    context.send(CLIENT, {"logits": context.receive(CLIENT)["aligned"] @ weight + bias})


def _plain_reveal(context: RoleContext) -> None:
    _publish_report(context, {"logits": context.receive(PROVIDER)["logits"]})


def plaintext_inference(config: Mapping[str, ConfigValue] | None = None) -> Protocol:
    """The no-HE baseline: aligned queries and logits in the clear between the two roles."""
    return Protocol(
        name="helix-plaintext-baseline",
        roles=(PROVIDER, CLIENT),
        channels=((PROVIDER, CLIENT),),
        steps=(
            Step("query", (CLIENT,), _plain_query),
            Step("classify", (PROVIDER,), _plain_classify),
            Step("reveal", (CLIENT,), _plain_reveal),
        ),
    )


def _timed_runs(
    protocol: Protocol, inputs: dict[str, dict[str, np.ndarray]], key: bytes, repeats: int
) -> tuple[float, int, dict[str, np.ndarray]]:
    """Median seconds of ``repeats`` runs, bytes between the roles, the last report."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run_in_process(protocol, inputs)
        seconds.append(time.perf_counter() - start)
    traffic = sum(pair.bytes for pair in result.traffic.pairs.values())
    return (
        statistics.median(seconds),
        traffic,
        open_report(key, result.outputs[CLIENT]["report"], CLIENT),
    )


def run_helix_benchmark(
    *,
    provider_spec: str,
    client_spec: str,
    batch_size: int,
    repeats: int,
    ridge: float,
    seed: int,
    public_size: int,
    train_per_class: int,
    queries_per_class: int,
    ood_size: int,
    results_dir: Path,
    cache_dir: Path | None,
    command: str | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Measure (module docstring) and write ``helix_bench.{json,md}``; the transformer encoders
    run on ``device`` (default: the CPU; the encrypted inference is CKKS on the CPU)."""
    data = build_splits(
        seed=seed,
        public_size=public_size,
        train_per_class=train_per_class,
        queries_per_class=queries_per_class,
        ood_size=ood_size,
    )
    provider = embed_party(
        provider_spec,
        data,
        data.public + data.train.texts,
        seed=seed,
        cache_dir=cache_dir,
        device=device,
    )
    client = embed_party(
        client_spec,
        data,
        data.public + data.queries.texts,
        seed=seed,
        cache_dir=cache_dir,
        device=device,
    )
    head = train_head(provider.train, data.train.labels, seed=seed)
    key = os.urandom(32)
    report_key = np.frombuffer(key, dtype=np.uint8)
    provider_inputs = {
        "public": provider.public,
        "head_weight": head.weight,
        "head_bias": head.bias,
    }

    start = time.perf_counter()
    aligned = run_in_process(
        helix({"mode": "align", "ridge": ridge}),
        {PROVIDER: provider_inputs, CLIENT: {"public": client.public, "report_key": report_key}},
    )
    align_seconds = time.perf_counter() - start
    report = open_report(key, aligned.outputs[CLIENT]["report"], CLIENT)
    plain_map = fit_alignment(client.public, provider.public, ridge)
    alignment = {
        "public_samples": int(client.public.shape[0]),
        "d_A": int(provider.public.shape[1]),
        "d_B": int(client.public.shape[1]),
        "seconds": align_seconds,
        "bytes": sum(pair.bytes for pair in aligned.traffic.pairs.values()),
        "weight_max_relative_error": float(
            np.abs(report[MAP_WEIGHT] - plain_map.weight).max() / np.abs(plain_map.weight).max()
        ),
        "bias_max_abs_error": float(np.abs(report[MAP_BIAS] - plain_map.bias).max()),
    }
    print(f"[fedfm] bench-helix: encrypted alignment {alignment}")

    tiled = np.resize(client.queries, (batch_size, client.queries.shape[1]))
    rows = []
    for queries in (tiled[:1], tiled):
        client_inputs = {
            "queries": queries,
            MAP_WEIGHT: report[MAP_WEIGHT],
            MAP_BIAS: report[MAP_BIAS],
            "report_key": report_key,
        }
        expected = head.logits(plain_map.apply(queries))
        layout = inference_layout("auto", len(queries), provider.public.shape[1], 4096)
        runs = (
            ("encrypted", helix({"mode": "infer", "packing": layout.name})),
            ("plaintext", plaintext_inference()),
        )
        for path, protocol in runs:
            seconds, traffic, result = _timed_runs(
                protocol, {PROVIDER: provider_inputs, CLIENT: client_inputs}, key, repeats
            )
            error = np.abs(result["logits"] - expected).max() / np.abs(expected).max()
            rows.append(
                {
                    "path": path,
                    "layout": layout.name if path == "encrypted" else "-",
                    "queries": len(queries),
                    "ms_per_query": 1e3 * seconds / len(queries),
                    "bytes_per_query": traffic / len(queries),
                    "run_seconds": seconds,
                    "run_bytes": traffic,
                    "logits_max_relative_error": float(error),
                }
            )
            print(f"[fedfm] bench-helix: {rows[-1]}")
    keys = ClientKeys.generate()
    single_layout = inference_layout("rows", 1, provider.public.shape[1], keys.slots)
    summary = {
        f"{prefix}{metric}_{size}": next(
            row[metric] for row in rows if row["path"] == path and (row["queries"] == 1) == single
        )
        for prefix, path in (("", "encrypted"), ("plaintext_", "plaintext"))
        for size, single in (("single", True), ("batched", False))
        for metric in ("ms_per_query", "bytes_per_query")
    }
    summary["inference_key_bytes_rows"] = int(
        keys.public_context(single_layout.rotation_steps()).size
    )
    summary["inference_key_bytes_features"] = int(keys.public_context([]).size)
    description = (
        f"Provider {provider_spec} (d_A={alignment['d_A']}), client {client_spec} "
        f"(d_B={alignment['d_B']}), CKKS N=8192 [60,40,40,60] scale 2^40. Whole in-process "
        f"protocol runs (fresh keys, channel sealing, serialization), median of {repeats}; "
        "bytes are every frame between the roles, keys included, divided by the queries. "
        f"Encrypted alignment on {alignment['public_samples']} public samples: "
        f"{alignment['seconds']:.1f} s, {alignment['bytes'] / 1e6:.1f} MB, W* max relative "
        f"error {alignment['weight_max_relative_error']:.1e}."
    )
    write_results(
        results_dir,
        "helix_bench",
        title="HELIX inference: latency and bytes per query, encrypted vs plaintext",
        description=description,
        rows=rows,
        columns=[
            ("path", "path"),
            ("layout", "layout"),
            ("queries", "queries"),
            ("ms_per_query", "ms / query"),
            ("bytes_per_query", "bytes / query"),
            ("logits_max_relative_error", "max rel. logit error"),
        ],
        extra={**summary, "alignment": alignment},
        command=command,
    )
    return {**summary, "alignment": alignment, "rows": rows}
