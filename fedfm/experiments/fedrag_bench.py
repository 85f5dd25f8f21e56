"""``fedfm bench-fedrag`` and ``fedfm fedrag-ablation``: FedRAG against its baselines.

**Benchmark** (Table 2 / App. C shape, ``results/fedrag.json`` and ``.md``): the generation of one
request through the runtime in this process, its network time emulated per preset
(:class:`fedfm.runtime.EmulatedTransport`: the slowest node's RTT + bytes / bandwidth +
measured compute per round trip), for

* **ours**: scrambled distributed attention (:func:`fedfm.protocols.fedrag.fedrag`);
* **secret-sharing**: the PermLLM-style baseline on the same runtime
  (:mod:`fedfm.protocols.fedrag.secret_sharing`);
* **plaintext**: centralized RAG: one node holds every segment (one round trip ships the token
  ids to it), then runs the model locally.

Time to first token: from the start of the run (session set-up included) to the step that yields
the first token; decode tokens/s: the other ``T - 1`` tokens over the time after it. Traffic:
bytes both ways on every node's link; round trips: the relay's. Medians of ``repeats`` runs.

**Accuracy** (the issue's acceptance, same command): fp32 greedy tokens of the protocol against
plaintext RAG over ``tokens`` tokens on ``queries`` queries (gold document at ``owner_0``, a
distractor at ``owner_1``), the largest ``|delta logit|`` over every generated position, the
answer perplexity change with forced tokens, and App. A's bf16 emulation: relative error of the
attention output with the structured and the dense scrambler, on the decoder's real queries,
keys and values.

**Ablation** (Table 3 shape, ``results/fedrag_ablation.json``): baseline (centralized) /
+distributed (online softmax, no scrambling) / +scrambler, and a "no documents" control, on a
docstring *continuation* task the embedded decoder can score on (:func:`continuation_cases`):
next-token accuracy over the answer span, first-token accuracy, answer perplexity.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.data.stdlib_text import Document
from fedfm.errors import ConfigError
from fedfm.experiments.fedrag_data import FedragData, build_data
from fedfm.experiments.results import write_results
from fedfm.protocols.fedrag.attention import attention_with_lse, causal_mask
from fedfm.protocols.fedrag.decoder import DecoderRunner, runner_for
from fedfm.protocols.fedrag.plan import COORDINATOR, RolePlan
from fedfm.protocols.fedrag.protocol import (
    decoder_source,
    fedrag,
    open_report,
    settings_from_config,
)
from fedfm.protocols.fedrag.reference import perplexity_of, plaintext_generate
from fedfm.protocols.fedrag.scrambler import LocalRandomness, draw_attention_keys, relative_error
from fedfm.runtime import PRESETS, EmulatedTransport, InProcessFederation
from fedfm.runtime.transport import ConfigValue

BENCH_PRESETS = ("lan", "rtt-10ms")
QUERY_TOKENS = 16
ANSWER_TOKENS = 8  # the forced answer's tokens (perplexity): room is kept for them
SECRET_SHARING_QUERIES = 3  # the baseline's logit error is measured on the first few queries


def query_budget(runner: DecoderRunner) -> int:
    """Query tokens: :data:`QUERY_TOKENS`, or a quarter of a shorter model's context."""
    return min(QUERY_TOKENS, runner.geometry.context // 4)


def document_budget(runner: DecoderRunner, tokens: int) -> int:
    """Tokens per owner's document so that both, the query and the generated (or forced
    answer) tokens fit the model's context."""
    room = runner.geometry.context - max(tokens, ANSWER_TOKENS) - query_budget(runner) - 1
    if room < 2:
        raise ConfigError(
            f"{tokens} generated tokens leave no room for documents in the decoder's context of "
            f"{runner.geometry.context} tokens"
        )
    return room // 2


@dataclass(frozen=True)
class Case:
    """One request: the owners' segments and the coordinator's query, as token ids."""

    owner_0: np.ndarray
    owner_1: np.ndarray
    query: np.ndarray
    answer: str = ""
    forced: np.ndarray | None = None

    def segments(self) -> list[np.ndarray]:
        return [self.owner_0, self.owner_1, self.query]


def task_cases(
    runner: DecoderRunner, data: FedragData, *, document_tokens: int, count: int
) -> list[Case]:
    """The gold document at ``owner_0``, another owner's document as a distractor at
    ``owner_1``, the query at the coordinator (each cut to its budget)."""
    tokenizer = runner.tokenizer
    cases = []
    for number, question in enumerate(data.questions[:count]):
        gold = data.owners[question.owner][question.document].text
        other = data.owners[1 - question.owner if len(data.owners) == 2 else 0]
        distractor = other[(question.document + number) % len(other)].text

        def ids(text: str, limit: int) -> np.ndarray:
            return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:limit])

        query = ids("\n" + question.query, query_budget(runner))
        answer_ids = ids(" " + question.answer, ANSWER_TOKENS)
        cases.append(
            Case(
                np.concatenate([[tokenizer.bos_token_id], ids("\n" + gold, document_tokens)]),
                ids("\n" + distractor, document_tokens),
                query,
                question.answer,
                answer_ids,
            )
        )
    return cases


def synthetic_case(runner: DecoderRunner, context: int, seed: int) -> Case:
    """Random token ids: ``context`` per owner and a query of :func:`query_budget` tokens."""
    rng = np.random.default_rng(seed)
    vocab = runner.geometry.vocab
    return Case(
        np.concatenate([[0], rng.integers(3, vocab, context - 1)]),
        rng.integers(3, vocab, context),
        rng.integers(3, vocab, query_budget(runner)),
    )


def run_case(
    case: Case,
    *,
    source: Any,
    tokens: int,
    attention: str = "scrambled",
    scrambler: str = "structured",
    plan: str = "dedicated",
    forced: bool = False,
    transport_presets: Sequence[str] = (),
) -> dict[str, Any]:
    """One protocol run; its report, traffic and (with presets) emulated times."""
    key = os.urandom(32)
    owner_extra = (
        {"allow_plaintext_attention": np.asarray(True)} if attention == "distributed" else {}
    )
    coordinator: dict[str, np.ndarray] = {
        "query": case.query,
        "report_key": np.frombuffer(key, np.uint8),
    }
    if forced and case.forced is not None:
        coordinator["forced"] = case.forced
    inputs = {
        "owner_0": {"segment": case.owner_0, **owner_extra},
        "owner_1": {"segment": case.owner_1, **owner_extra},
        COORDINATOR: coordinator,
    }
    config: dict[str, ConfigValue] = {
        "max-new-tokens": tokens,
        "attention": attention,
        "scrambler": scrambler,
        "compute-plan": plan,
    }
    protocol = fedrag(config, decoders=source)
    roles = RolePlan(2, plan)
    federation = InProcessFederation(
        protocol, inputs, placement=roles.placement(3 if plan == "rotating" else 4)
    )
    marks: dict[str, dict[str, float]] = {}
    transport = None
    if transport_presets:
        transport = EmulatedTransport(
            federation.nodes, profiles=[PRESETS[name] for name in transport_presets]
        )

    def log(line: str) -> None:
        if transport is not None and " step " in line:
            step = line.split(" step ", 1)[1].split(" ", 1)[0]
            marks[step] = dict(transport.projected_seconds)

    result = federation.run(transport, log=log)
    report = open_report(key, result.outputs[COORDINATOR]["report"])
    summary: dict[str, Any] = {
        "report": report,
        "round_trips": int(result.traffic.round_trips),
        "traffic_bytes": result.traffic.node_bytes,
    }
    if transport is not None:
        first = "report" if tokens == 1 else f"{COORDINATOR}_b1_l0_q"
        for name in transport_presets:
            ttft = marks[first][name]
            total = marks["report"][name]
            summary[name] = {
                "ttft_s": ttft,
                "decode_tok_s": (tokens - 1) / (total - ttft)
                if tokens > 1 and total > ttft
                else float("nan"),
            }
    return summary


def plaintext_timing(
    case: Case, runner: DecoderRunner, tokens: int, presets: Sequence[str]
) -> dict[str, Any]:
    """Centralized RAG: ship the segments' ids to one node (one round trip), generate there."""
    shipped = sum(np.asarray(s, dtype=np.int64).nbytes for s in (case.owner_0, case.owner_1))
    started = time.perf_counter()
    with torch.no_grad():
        from fedfm.protocols.fedrag.decoder import eager_model

        ids = torch.as_tensor(np.concatenate(case.segments()))[None]
        with eager_model(runner.model) as model:
            output = model(input_ids=ids, use_cache=True)
            first = time.perf_counter() - started
            token = int(output.logits[0, -1].argmax())
            for _ in range(tokens - 1):
                output = model(
                    input_ids=torch.tensor([[token]]), cache=output.past_key_values, use_cache=True
                )
                token = int(output.logits[0, -1].argmax())
    total = time.perf_counter() - started
    summary: dict[str, Any] = {"round_trips": 1, "traffic_bytes": int(shipped)}
    for name in presets:
        link = PRESETS[name].round_trip_seconds(shipped, 0)
        summary[name] = {
            "ttft_s": link + first,
            "decode_tok_s": (tokens - 1) / (total - first) if tokens > 1 else float("nan"),
        }
    return summary


# -- App. A: bf16 emulation -------------------------------------------------------------------


def captured_qkv(runner: DecoderRunner, ids: np.ndarray, layer: int) -> tuple[np.ndarray, ...]:
    """The decoder's real post-RoPE ``q, k, v`` at ``layer`` for ``ids`` (plaintext forward)."""
    hidden = runner.embed(ids)
    positions = np.arange(ids.size)
    g = runner.geometry
    for current in range(layer + 1):
        q, k, v = runner.qkv(current, hidden, positions)
        if current == layer:
            return q, k, v

        def attend(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
            return attention_with_lse(
                qq, kk.repeat_interleave(g.groups, 0), vv.repeat_interleave(g.groups, 0),
                scaling=runner.scaling, allowed=causal_mask(ids.size, ids.size, offset=0),
            )[0]  # fmt: skip

        hidden = runner.finish(current, hidden, positions, attend)
    raise ConfigError(f"layer {layer} is past the model's {g.layers} layers")


def bf16_error(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scaling: float,
    kind: str | None,
    scaling_range: float = 2.0,
) -> float:
    """Relative error of cross attention computed in bf16 on scrambled inputs (App. A): the
    parties scramble in bf16, the compute node multiplies in bf16, the inquirer unscrambles in
    bf16; against the fp32 plaintext attention. ``kind=None``: bf16 without scrambling."""
    reference, _ = attention_with_lse(q, k, v, scaling=scaling)
    bf16 = torch.bfloat16

    def rounded(x: np.ndarray) -> np.ndarray:
        return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(bf16).float().numpy()

    if kind is None:
        out, _ = attention_with_lse(
            rounded(q), rounded(k), rounded(v), scaling=scaling, compute_dtype=bf16
        )
        return relative_error(out.numpy(), reference.numpy())
    keys = draw_attention_keys(
        LocalRandomness(),
        "bf16",
        heads=k.shape[0],
        head_dim=k.shape[-1],
        kind=kind,
        scaling_range=scaling_range,
    )
    qs = rounded(keys.scramble_queries(rounded(q).astype(np.float64)))
    ks = rounded(keys.scramble_keys(rounded(k).astype(np.float64)))
    vs = rounded(keys.scramble_values(rounded(v).astype(np.float64)))
    out, _ = attention_with_lse(qs, ks, vs, scaling=scaling, compute_dtype=bf16)
    restored = keys.unscramble_outputs(rounded(out.numpy()).astype(np.float64))
    return relative_error(rounded(restored), reference.numpy())


def bf16_table(
    runner: DecoderRunner, texts: Sequence[str], *, ranges: Sequence[float]
) -> list[dict[str, Any]]:
    """Median relative errors over texts and layers per scrambler (and per scaling range)."""
    rows: dict[str, list[float]] = {}
    for text in texts:
        ids = np.asarray(
            [
                runner.tokenizer.bos_token_id,
                *runner.tokenizer(text, add_special_tokens=False)["input_ids"],
            ]
        )[: runner.geometry.context]
        split = ids.size // 2
        for layer in range(runner.geometry.layers):
            q, k, v = captured_qkv(runner, ids, layer)
            q_, k_, v_ = q[:, split:], k[:, :split], v[:, :split]
            k_ = np.repeat(k_, runner.geometry.groups, 0)
            v_ = np.repeat(v_, runner.geometry.groups, 0)
            rows.setdefault("plaintext bf16", []).append(
                bf16_error(q_, k_, v_, scaling=runner.scaling, kind=None)
            )
            rows.setdefault("dense", []).append(
                bf16_error(q_, k_, v_, scaling=runner.scaling, kind="dense")
            )
            for r in ranges:
                rows.setdefault(f"structured r={r:g}", []).append(
                    bf16_error(
                        q_, k_, v_, scaling=runner.scaling, kind="structured", scaling_range=r
                    )
                )
    return [
        {"method": name, "relative_error": float(statistics.median(values)), "samples": len(values)}
        for name, values in rows.items()
    ]


# -- the commands -------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def accuracy(
    cases: Sequence[Case],
    *,
    source: Any,
    runner: DecoderRunner,
    tokens: int,
    secret_sharing_queries: int = SECRET_SHARING_QUERIES,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The issue's fp32 acceptance on ``cases``: greedy tokens of the protocol against plaintext
    RAG, the largest ``|delta logit|`` over every generated position, the largest relative
    change of the forced answer's perplexity, and the secret-sharing baseline's logit error on
    the first ``secret_sharing_queries`` cases (the keys of ``results/fedrag.json``)."""
    identical, diffs, ppl_changes, ss_diffs = [], [], [], []
    for number, case in enumerate(cases):
        ours = run_case(case, source=source, tokens=tokens)
        ref_tokens, ref_logits = plaintext_generate(runner, case.segments(), tokens)
        identical.append(bool(np.array_equal(ours["report"]["tokens"], ref_tokens)))
        diffs.append(float(np.abs(ours["report"]["logits"] - ref_logits).max()))
        if case.forced is not None and case.forced.size:
            forced = run_case(case, source=source, tokens=case.forced.size, forced=True)
            _, plain_logits = plaintext_generate(
                runner, case.segments(), case.forced.size, forced=case.forced
            )
            ours_ppl = perplexity_of(forced["report"]["logits"], case.forced)
            plain_ppl = perplexity_of(plain_logits, case.forced)
            ppl_changes.append(abs(ours_ppl - plain_ppl) / plain_ppl)
        if number < secret_sharing_queries:
            ss = run_case(case, source=source, tokens=tokens, attention="secret-sharing")
            ss_diffs.append(float(np.abs(ss["report"]["logits"] - ref_logits).max()))
        log(
            f"[fedfm] bench-fedrag: query {number + 1}: identical={identical[-1]} "
            f"max|dlogit|={diffs[-1]:.2e}"
        )
    return {
        "queries": len(cases),
        "tokens": tokens,
        "greedy_tokens_identical": all(identical),
        "greedy_tokens_identical_count": int(sum(identical)),
        "max_abs_logit_diff": max(diffs),
        "perplexity_change": max(ppl_changes) if ppl_changes else None,
        "secret_sharing_max_abs_logit_diff": max(ss_diffs) if ss_diffs else None,
    }


def run_fedrag_benchmark(
    *,
    decoder: str = "llama_fedfm_tiny",
    decoder_cache: Path = Path("runs/cache"),
    queries: int = 20,
    tokens: int = 32,
    contexts: Sequence[int] = (24, 48),
    bench_tokens: int = 16,
    repeats: int = 3,
    results_dir: Path = Path("results"),
    documents: Sequence[Document] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Accuracy, bf16 and timing (module docstring); writes ``fedrag.json`` and ``.md``.
    ``documents``: see :func:`fedfm.experiments.fedrag_data.build_data`."""
    torch.set_num_threads(1)
    settings = settings_from_config({"decoder": decoder, "decoder-cache": str(decoder_cache)})
    source = decoder_source(settings)
    runner, _ = runner_for(source)
    data = build_data(questions=max(queries, 1), documents=documents)
    cases = task_cases(runner, data, document_tokens=document_budget(runner, tokens), count=queries)
    log(f"[fedfm] bench-fedrag: {len(cases)} queries x {tokens} tokens, fp32")
    found = accuracy(cases, source=source, runner=runner, tokens=tokens, log=log)
    texts = [d.text for d in data.owners[0][:8]]
    bf16 = bf16_table(runner, texts, ranges=(1.0, 2.0, 4.0, 16.0))
    log(
        "[fedfm] bench-fedrag: bf16 "
        + ", ".join(f"{r['method']} {r['relative_error']:.2%}" for r in bf16)
    )

    rows = []
    methods = ("ours", "secret-sharing", "plaintext")
    speedups: list[dict[str, Any]] = []
    for context in contexts:
        case = synthetic_case(runner, context, seed=context)
        # the methods take turns within each repeat, so a change of the machine's load between
        # repeats weighs on all of them alike (the speed-up is a ratio of the same repeats)
        runs: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
        for _ in range(repeats):
            for method in methods:
                if method == "plaintext":
                    found_run = plaintext_timing(case, runner, bench_tokens, BENCH_PRESETS)
                else:
                    attention = "scrambled" if method == "ours" else "secret-sharing"
                    found_run = run_case(
                        case,
                        source=source,
                        tokens=bench_tokens,
                        attention=attention,
                        transport_presets=BENCH_PRESETS,
                    )
                runs[method].append(found_run)
        for method in methods:
            for preset in BENCH_PRESETS:
                rows.append(
                    {
                        "context": f"{context}+{context}",
                        "query": query_budget(runner),
                        "output": bench_tokens,
                        "method": method,
                        "preset": preset,
                        "ttft_s": _median([r[preset]["ttft_s"] for r in runs[method]]),
                        "decode_tok_s": _median([r[preset]["decode_tok_s"] for r in runs[method]]),
                        "traffic_mib": runs[method][0]["traffic_bytes"] / 2**20,
                        "round_trips": runs[method][0]["round_trips"],
                    }
                )
            log(f"[fedfm] bench-fedrag: context {context}+{context}, {method}: {rows[-1]}")
        for preset in BENCH_PRESETS:
            ttft = {
                r["method"]: r["ttft_s"]
                for r in rows
                if r["context"] == f"{context}+{context}" and r["preset"] == preset
            }
            speedups.append(
                {
                    "context": f"{context}+{context}",
                    "preset": preset,
                    "speedup": ttft["secret-sharing"] / ttft["ours"],
                }
            )
    extra = {
        "decoder": decoder,
        **found,
        "ttft_speedup_vs_secret_sharing": min(x["speedup"] for x in speedups),
        "ttft_speedups": speedups,
        "bf16": bf16,
        "repeats": repeats,
    }
    write_results(
        results_dir,
        "fedrag",
        title="FedRAG: scrambled distributed attention vs secret sharing vs plaintext",
        description=(
            f"Decoder {decoder}; timing on random token ids ({bench_tokens} generated tokens) "
            f"under the runtime's emulated presets {list(BENCH_PRESETS)}, medians of {repeats} "
            f"runs; accuracy on {len(cases)} docstring-completion queries x {tokens} tokens, fp32. "
            f"greedy tokens identical: {found['greedy_tokens_identical']} "
            f"({found['greedy_tokens_identical_count']}/{len(cases)}); max |delta logit| "
            f"{found['max_abs_logit_diff']:.2e}; answer perplexity change "
            f"{(found['perplexity_change'] or float('nan')):.2e}; TTFT speed-up vs secret "
            f"sharing (smallest) {min(x['speedup'] for x in speedups):.2f}x."
        ),
        rows=rows,
        columns=[
            ("context", "context"),
            ("query", "query"),
            ("output", "output"),
            ("method", "method"),
            ("preset", "preset"),
            ("ttft_s", "TTFT (s)"),
            ("decode_tok_s", "decode tok/s"),
            ("traffic_mib", "traffic (MiB)"),
            ("round_trips", "round trips"),
        ],
        extra=extra,
    )
    return extra


CONTINUATION_OPENING = 16  # tokens of the gold document the query repeats
ABLATION_METHODS = ("no documents", "baseline", "+distributed", "+scrambler")


def continuation_cases(
    runner: DecoderRunner, data: FedragData, *, document_tokens: int, count: int
) -> list[Case]:
    """The ablation's extractive task: the query is the opening of a document (its first
    :func:`query_budget` tokens, at most :data:`CONTINUATION_OPENING`), the answer its next
    :data:`ANSWER_TOKENS` tokens, a span of the gold document at ``owner_0`` that the model can
    copy when it fits the owner's budget; another owner's document is the distractor at
    ``owner_1``. Documents are taken in order, alternating owners, skipping those too short for
    an opening and an answer."""
    tokenizer = runner.tokenizer
    opening = min(CONTINUATION_OPENING, query_budget(runner))

    def ids(text: str) -> np.ndarray:
        return np.asarray(tokenizer("\n" + text, add_special_tokens=False)["input_ids"])

    cases: list[Case] = []
    owners = data.owners
    for index in range(max(len(documents) for documents in owners)):
        for owner, documents in enumerate(owners):
            if len(cases) == count or index >= len(documents):
                continue
            gold = ids(documents[index].text)
            if gold.size < opening + ANSWER_TOKENS:
                continue
            other = owners[(owner + 1) % len(owners)]
            distractor = ids(other[(index + len(cases)) % len(other)].text)[:document_tokens]
            answer = gold[opening : opening + ANSWER_TOKENS]
            cases.append(
                Case(
                    np.concatenate([[tokenizer.bos_token_id], gold[:document_tokens]]),
                    distractor,
                    gold[:opening],
                    tokenizer.decode(answer),
                    answer,
                )
            )
    if len(cases) < count:
        raise ConfigError(f"only {len(cases)} documents are long enough, {count} asked")
    return cases


def forced_logits(case: Case, method: str, *, source: Any, runner: DecoderRunner) -> np.ndarray:
    """The answer tokens' logits (teacher forcing) under one ablation ``method``."""
    if case.forced is None:
        raise ConfigError("an ablation case needs its answer tokens")
    if method == "no documents":
        segments = [np.asarray([runner.tokenizer.bos_token_id]), case.query]
        return plaintext_generate(runner, segments, case.forced.size, forced=case.forced)[1]
    if method == "baseline":
        return plaintext_generate(runner, case.segments(), case.forced.size, forced=case.forced)[1]
    attention = {"+distributed": "distributed", "+scrambler": "scrambled"}[method]
    found = run_case(case, source=source, tokens=case.forced.size, attention=attention, forced=True)
    return np.asarray(found["report"]["logits"])


def run_fedrag_ablation(
    *,
    decoder: str = "llama_fedfm_tiny",
    decoder_cache: Path = Path("runs/cache"),
    queries: int = 40,
    results_dir: Path = Path("results"),
    documents: Sequence[Document] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Table 3's rows on the docstring continuation task (:func:`continuation_cases`).

    Per method, over the queries: **next-token accuracy** (the share of answer positions where
    the model's top token, given the true prefix, is the document's next token), **first-token
    accuracy** (its greedy first token is the answer's first), and the answer tokens'
    **perplexity** (geometric mean over queries). All from one teacher-forced run per query and
    method (the first position is not forced, so it is also the greedy first token).
    ``documents``: see :func:`fedfm.experiments.fedrag_data.build_data`."""
    torch.set_num_threads(1)
    settings = settings_from_config({"decoder": decoder, "decoder-cache": str(decoder_cache)})
    source = decoder_source(settings)
    runner, _ = runner_for(source)
    data = build_data(questions=1, documents=documents)
    cases = continuation_cases(
        runner, data, document_tokens=document_budget(runner, ANSWER_TOKENS), count=queries
    )
    rows = []
    for method in ABLATION_METHODS:
        token_hits, first_hits, ppls = [], [], []
        for case in cases:
            logits = forced_logits(case, method, source=source, runner=runner)
            guesses = logits.argmax(axis=1)
            token_hits.append(float(np.mean(guesses == case.forced)))
            first_hits.append(bool(guesses[0] == case.forced[0]))  # type: ignore[index]
            ppls.append(perplexity_of(logits, case.forced))  # type: ignore[arg-type]
        rows.append(
            {
                "method": method,
                "next_token_accuracy_pct": 100.0 * float(np.mean(token_hits)),
                "first_token_accuracy_pct": 100.0 * float(np.mean(first_hits)),
                "answer_ppl": float(np.exp(np.mean(np.log(ppls)))),
                "queries": len(cases),
            }
        )
        log(f"[fedfm] fedrag-ablation: {rows[-1]}")
    opening = cases[0].query.size
    write_results(
        results_dir,
        "fedrag_ablation",
        title="FedRAG ablation (Table 3 shape): docstring continuation",
        description=(
            f"Decoder {decoder}; {len(cases)} queries, each the opening ({opening} tokens) of a "
            "held-out docstring; the answer is the docstring's next "
            f"{ANSWER_TOKENS} tokens, a span of the gold document the model sees at owner_0 "
            "(another owner's document is a distractor at owner_1). Next-token accuracy: share of "
            "answer positions whose top-1 prediction (true prefix, teacher forcing) is the "
            "document's token; first-token accuracy: the greedy first token is the answer's; "
            "PPL: geometric mean over queries of the answer tokens' perplexity. 'no documents': "
            "the query alone, centralized (a control: what the documents add)."
        ),
        rows=rows,
        columns=[
            ("method", "method"),
            ("next_token_accuracy_pct", "next-token Acc (%)"),
            ("first_token_accuracy_pct", "first-token Acc (%)"),
            ("answer_ppl", "PPL"),
            ("queries", "queries"),
        ],
    )
    return rows
