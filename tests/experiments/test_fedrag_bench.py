"""``fedfm bench-fedrag``'s harness on the micro decoder: the issue's fp32 acceptance (tokens,
logits, perplexity) and App. A's bf16 ordering on real docstring cases, and the result file's
keys; the secret-sharing baseline's parity and round trips; ``fedfm fedrag-ablation``'s task.

The micro decoder (``tests.helpers.micro_decoder_source``: 2 layers, context 32) is trained in
pytest's temporary folder in seconds; the benchmark's own run uses the embedded tiny decoder.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedfm.data.stdlib_text import Document, stdlib_documents, stdlib_root
from fedfm.experiments.fedrag_bench import (
    ANSWER_TOKENS,
    Case,
    continuation_cases,
    document_budget,
    run_case,
    run_fedrag_ablation,
    run_fedrag_benchmark,
    task_cases,
)
from fedfm.experiments.fedrag_data import build_data
from fedfm.models.decoder import DecoderSource, train_decoder
from fedfm.protocols.fedrag.decoder import runner_for
from fedfm.protocols.fedrag.reference import plaintext_generate
from fedfm.protocols.fedrag.secret_sharing import (
    FRACTION,
    decode,
    encode,
    ring_matmul,
    share,
    truncate,
)
from tests.helpers import micro_decoder_source

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> DecoderSource:
    source = micro_decoder_source(tmp_path_factory.mktemp("fedrag-bench-decoder"))
    train_decoder(source, progress=False, log=lambda _: None)
    return source


@pytest.fixture(scope="module")
def documents() -> list[Document]:
    """Two packages' docstrings, one group each (parsing the whole standard library, the
    benchmark's default, takes seconds of CPU)."""
    found = []
    for package in ("email", "urllib"):
        found += [replace(d, group=package) for d in stdlib_documents(stdlib_root() / package)]
    return found


def docstring_cases(
    source: DecoderSource, documents: list[Document], count: int, tokens: int
) -> list[Case]:
    runner, _ = runner_for(source)
    data = build_data(questions=count, documents=documents)
    return task_cases(runner, data, document_tokens=document_budget(runner, tokens), count=count)


def test_the_benchmark_meets_the_fp32_acceptance_and_writes_its_keys(
    micro: DecoderSource, documents: list[Document], tmp_path: Path
) -> None:
    """The benchmark's own runner on 4 docstring cases (gold document at owner_0, distractor at
    owner_1): every key the issue names, with the acceptance's bounds."""
    extra = run_fedrag_benchmark(
        decoder=str(micro.path),
        queries=4,
        tokens=4,
        contexts=(4,),
        bench_tokens=2,
        repeats=1,
        results_dir=tmp_path,
        documents=documents,
        log=lambda _: None,
    )
    written = json.loads((tmp_path / "fedrag.json").read_text())
    assert (tmp_path / "fedrag.md").is_file()
    for key in ("max_abs_logit_diff", "perplexity_change", "ttft_speedup_vs_secret_sharing"):
        assert written[key] == pytest.approx(extra[key])
    assert written["queries"] == 4 and written["tokens"] == 4
    assert written["greedy_tokens_identical"] is True
    assert written["greedy_tokens_identical_count"] == 4
    assert isinstance(written["max_abs_logit_diff"], float)
    assert 0.0 <= written["max_abs_logit_diff"] <= 1e-4
    assert isinstance(written["perplexity_change"], float)
    assert 0.0 <= written["perplexity_change"] <= 1e-3  # 0.1 %
    assert isinstance(written["ttft_speedup_vs_secret_sharing"], float)
    assert math.isfinite(written["ttft_speedup_vs_secret_sharing"])
    assert written["ttft_speedup_vs_secret_sharing"] == min(
        x["speedup"] for x in written["ttft_speedups"]
    )
    assert written["ttft_speedup_vs_secret_sharing"] > 0
    # App. A: the structured scrambler's bf16 error below the dense one's
    bf16 = {row["method"]: row["relative_error"] for row in written["bf16"]}
    assert bf16["structured r=2"] < bf16["dense"]
    assert bf16["plaintext bf16"] <= bf16["structured r=16"]
    # one timing row per context, method and preset, each with its traffic and round trips
    assert {(r["method"], r["preset"]) for r in written["rows"]} == {
        (m, p) for m in ("ours", "secret-sharing", "plaintext") for p in ("lan", "rtt-10ms")
    }
    trips = {r["method"]: r["round_trips"] for r in written["rows"]}
    assert trips["plaintext"] == 1 < trips["ours"] < trips["secret-sharing"]


def test_the_cases_are_real_docstrings_with_the_gold_document_first(
    micro: DecoderSource, documents: list[Document]
) -> None:
    _, tokenizer = runner_for(micro)
    cases = docstring_cases(micro, documents, 3, tokens=4)
    data = build_data(questions=3, documents=documents)
    for case, question in zip(cases, data.questions, strict=True):
        assert case.owner_0[0] == tokenizer.bos_token_id
        gold = data.owners[question.owner][question.document].text
        assert tokenizer.decode(case.owner_0[1:]).strip() in gold
        assert case.forced is not None and case.forced.size >= 1


# -- the secret-sharing baseline (PermLLM style) ------------------------------------------------


def test_fixed_point_shares_and_beaver_products_are_exact_to_the_fixed_point() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4))
    first, second = share(encode(x))
    assert not np.array_equal(first, encode(x))  # one share alone is uniform noise
    assert np.abs(decode(first + second) - x).max() <= 2.0**-FRACTION
    a, b = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 4, 5))
    # a product of encodings carries 2f fractional bits; each party truncates its share
    product = ring_matmul(encode(a), encode(b))
    left, right = share(product)
    restored = decode(truncate(left, 0) + truncate(right, 1))
    assert np.abs(restored - a @ b).max() < 1e-3


def test_secret_sharing_generation_equals_plaintext_within_fixed_point(
    micro: DecoderSource, documents: list[Document]
) -> None:
    """The baseline's tokens equal plaintext RAG's and its logits stay within the fixed point's
    error (16 fractional bits, through 2 layers); seven relay round trips per layer per token
    against FedRAG's two, and more traffic."""
    runner, _ = runner_for(micro)
    tokens = 3
    for case in docstring_cases(micro, documents, 2, tokens):
        expected_tokens, expected_logits = plaintext_generate(runner, case.segments(), tokens)
        found = run_case(case, source=micro, tokens=tokens, attention="secret-sharing")
        assert np.array_equal(found["report"]["tokens"], expected_tokens)
        error = float(np.abs(found["report"]["logits"] - expected_logits).max())
        assert error <= 1e-3
        layers = runner.geometry.layers
        # hello, segments, 7 per layer for owner_1's prefill and per generated token, report
        assert found["round_trips"] == 1 + 1 + 7 * layers * (1 + tokens) + 1
        ours = run_case(case, source=micro, tokens=tokens)
        assert ours["round_trips"] == 1 + 1 + 2 * layers * (1 + tokens) + 1
        assert found["traffic_bytes"] > ours["traffic_bytes"]


# -- the ablation (Table 3 shape) ---------------------------------------------------------------


def test_the_ablation_command_scores_the_continuation_task_and_its_rows_agree(
    micro: DecoderSource, documents: list[Document], tmp_path: Path
) -> None:
    """``fedfm fedrag-ablation``'s runner on 3 queries: the answer is the gold document's next
    tokens after the query's opening; the protocol's rows equal the centralized baseline."""
    runner, _ = runner_for(micro)
    data = build_data(questions=1, documents=documents)
    cases = continuation_cases(runner, data, document_tokens=100, count=3)
    for case in cases:
        gold = case.owner_0[1:]
        opening, answer = case.query.size, case.forced
        assert answer is not None and answer.size == ANSWER_TOKENS
        assert np.array_equal(gold[:opening], case.query)  # the query repeats the opening
        assert np.array_equal(gold[opening : opening + answer.size], answer)  # the answer follows

    rows = run_fedrag_ablation(
        decoder=str(micro.path),
        queries=3,
        results_dir=tmp_path,
        documents=documents,
        log=lambda _: None,
    )
    by_method = {row["method"]: row for row in rows}
    assert list(by_method) == ["no documents", "baseline", "+distributed", "+scrambler"]
    written = json.loads((tmp_path / "fedrag_ablation.json").read_text())["rows"]
    assert [row["method"] for row in written] == list(by_method)
    baseline = by_method["baseline"]
    assert 0.0 <= baseline["next_token_accuracy_pct"] <= 100.0
    assert baseline["answer_ppl"] > 1.0
    for method in ("+distributed", "+scrambler"):
        row = by_method[method]
        assert row["next_token_accuracy_pct"] == baseline["next_token_accuracy_pct"]
        assert row["first_token_accuracy_pct"] == baseline["first_token_accuracy_pct"]
        assert row["answer_ppl"] == pytest.approx(baseline["answer_ppl"], rel=1e-4)
