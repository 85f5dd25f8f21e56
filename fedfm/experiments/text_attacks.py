"""The red team's attacks on the double-blind protocol's text path (``fedfm red-team``).

A text's length is what the text path gives away (:mod:`fedfm.protocols.double_blind.text`):

``text_lengths_to_server``
    A curious server reads every text's token count from the key masks it evaluates attention
    with. Control: the same data owner with ``hide-text-lengths`` (all-real masks).
``text_rows_linked_by_length``
    A curious client links permuted rows of its batches to its own texts: the last block's key
    masks (label order) give each row's length, and a length that only one of the client's
    training texts has names that text. The permutation is the server's secret; this is what it
    fails to hide. Control: the same client with ``hide-text-lengths``.

``text_rows_linked_by_content``
    The same curious client, when lengths are hidden: it embeds its own texts with the server's
    tables (as it must, to upload them) and names each permuted row of a revealed block's output
    by the text whose embedding it correlates with best. A block's residual stream keeps its
    input's tokens, padding included, so no mask is needed. Measured on block 1 (``reveal =
    "all"``) and on the last block (``reveal = "last"``), each with ``hide-text-lengths``.

All run the protocol's roles message by message on a small random BERT (the outcome depends on
messages, not on accuracy) with the lengths of one client's share of the real docstring task
(:data:`~fedfm.experiments.text_adaptation.TEXT_SPLIT`, MiniLM's tokenizer, 64 tokens, K = 5
iid).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedfm.approx import ApproxConfig
from fedfm.crypto import SimulateBackend
from fedfm.crypto.randomness import ResearchStream
from fedfm.data.partition import partition
from fedfm.experiments.red_team import DEFENDED, SUCCEEDS, AttackResult
from fedfm.models.fhe_text import FheTextClassifier, to_fhe_text
from fedfm.protocols.double_blind.client import KEY_MASKS, ClientState, DoubleBlindClient
from fedfm.protocols.double_blind.config import TRAIN_BLOCK, DoubleBlindConfig
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.server import DoubleBlindServer
from fedfm.protocols.double_blind.text import TextClientData
from fedfm.runtime.transport import Envelope

TESTS = "tests/experiments/test_text_attacks.py"
TOKENS = 64
CLASSES = 7
PAD = 0
VOCAB = 50
BATCH = 16
BATCHES = 4


def docstring_lengths(clients: int = 5, seed: int = 0) -> np.ndarray:
    """Token counts of client 0's texts: the table's docstring pool (MiniLM's tokenizer, 64
    tokens), split iid over ``clients``."""
    from fedfm.distillation.text import task_splits
    from fedfm.experiments.text_adaptation import student_run
    from fedfm.models.fhe_text import load_text_encoder

    run = student_run()
    _, tokenizer = load_text_encoder(run.model)
    pool = task_splits(run, tokenizer).pool
    part = partition(pool, num_partitions=clients, scheme="iid", seed=seed)[0]
    ids = pool.input_ids.numpy()[part]
    return np.asarray((ids != tokenizer.pad_token_id).sum(axis=1), dtype=np.int64)


def small_text_model(seed: int = 0) -> FheTextClassifier:
    """An untrained two-block BERT of width 16 reading 64 tokens (messages, not accuracy)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=TOKENS,
        pad_token_id=PAD,
    )
    encoder = BertModel(config, add_pooling_layer=False).eval()
    return to_fhe_text(
        encoder, ApproxConfig.exact(), num_classes=CLASSES, pad_token_id=PAD, max_tokens=TOKENS
    ).eval()


def texts_of_lengths(lengths: np.ndarray, seed: int) -> TextClientData:
    """Random token ids with the given lengths (the last fifth held out), random labels."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(len(lengths), TOKENS))
    ids[np.arange(TOKENS)[None, :] >= lengths[:, None]] = PAD
    labels = rng.integers(0, CLASSES, size=len(lengths))
    held = len(lengths) // 5
    mask = ids != PAD
    return TextClientData(
        ids[held:], mask[held:], labels[held:], ids[:held], mask[:held], labels[:held], CLASSES
    )


@dataclass(frozen=True)
class LengthLeak:
    """What one training round shows: lengths the server reads right, rows the client links."""

    server_reads: float  # share of the client's texts whose token count the server reads
    rows_linked: float  # share of a round's rows the client names correctly by their length
    rows: int
    # share of a round's rows the client names correctly by content: the first revealed
    # block's output against its own texts' embeddings (:func:`link_rows_by_content`)
    rows_linked_by_content: float = 0.0
    content_block: int = 0  # the model's block whose output it read (1-based)


def link_rows_by_content(
    model: FheTextClassifier, train_tokens: np.ndarray, hidden: np.ndarray
) -> np.ndarray:
    """The client's guess of each row of a revealed block output ``hidden`` ``(rows, T, D)``:
    the index of its training text whose embedding (computed with the server's tables, as it
    does to upload) correlates best with the row, over all positions (padding included)."""
    with torch.no_grad():
        embedded = model.embed(torch.from_numpy(train_tokens)).numpy()
    candidates = embedded.reshape(len(embedded), -1)
    rows = hidden.reshape(len(hidden), -1)
    candidates = candidates - candidates.mean(axis=1, keepdims=True)
    rows = rows - rows.mean(axis=1, keepdims=True)
    candidates /= np.linalg.norm(candidates, axis=1, keepdims=True)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    return np.asarray((rows @ candidates.T).argmax(axis=1))


def length_leak(
    model: FheTextClassifier, data: TextClientData, *, hide: bool, reveal: str = "all"
) -> LengthLeak:
    """Setup and one training round; the server's view of the lengths and the client's links
    (by length from the last block's key masks, by content from the first block it sees)."""
    backend = SimulateBackend()
    config = DoubleBlindConfig(
        rounds=1,
        batch_size=BATCH,
        batches_per_round=BATCHES,
        reveal=reveal,
        secure_aggregation=False,
    )
    server = DoubleBlindServer(
        model,
        config,
        backend,
        num_classes=CLASSES,
        randomness=ResearchStream(0),
        log=lambda _line: None,
    )
    policy = DataOwnerPolicy(
        allow_plaintext=True, require_secure_aggregation=False, hide_text_lengths=hide
    )
    client = DoubleBlindClient(data, backend, policy=policy)
    reply, state = client.handle(server.setup_request(1), ClientState())
    server.on_setup(reply)
    session = server.sessions[1]
    lengths = data.train_key_mask.sum(axis=1)
    seen = session.train_key_mask.sum(axis=1) if session.train_key_mask is not None else None
    reads = float(np.mean(seen == lengths)) if seen is not None else 0.0

    outcome: Envelope | object = server.start("train", 1, 1, server.initial_arrays(16))
    flight = session.in_flight
    if flight is None:
        raise AssertionError("the round did not start")
    indices, permutations = list(flight.indices), list(flight.permutations)
    masks: dict[str, np.ndarray] = {}
    seen_block, outputs = 0, {}  # the first block output the client decrypts
    while isinstance(outcome, Envelope):
        reply, state = client.handle(outcome, state)
        if outcome.message_type == TRAIN_BLOCK:
            block = int(outcome.config["block"])
            if not seen_block and (decrypted := state.group(f"block{block}")):
                seen_block, outputs = block, decrypted
            if block == server.num_blocks:
                masks = state.group(KEY_MASKS)
        outcome = server.on_reply(reply)
    # the client: a row whose length only one of its training texts has is that text
    counts = np.bincount(lengths, minlength=TOKENS + 1)
    linked = by_content = rows = 0
    for index, (batch, perms) in enumerate(zip(indices, permutations, strict=True)):
        truth = batch[perms.after_block(server.num_blocks + 1)]  # the harness's knowledge
        for row, length in enumerate(masks[str(index)].sum(axis=1)):
            rows += 1
            if counts[length] == 1:
                guess = int(np.flatnonzero(lengths == length)[0])
                linked += guess == truth[row]
        if seen_block:  # the rows of that block's output, in order pi_block
            guesses = link_rows_by_content(model, data.train_tokens, outputs[str(index)])
            by_content += int((guesses == batch[perms.after_block(seen_block)]).sum())
    model_block = server.revealed[seen_block - 1] if seen_block else 0
    return LengthLeak(reads, linked / rows, rows, by_content / rows, model_block)


def red_team_suite() -> list[AttackResult]:
    """The text path's attacks for ``fedfm red-team``."""
    lengths = docstring_lengths()
    data = texts_of_lengths(lengths, seed=1)
    model = small_text_model()
    shown, hidden = length_leak(model, data, hide=False), length_leak(model, data, hide=True)
    last = length_leak(model, data, hide=True, reveal="last")
    distinct = int((np.bincount(data.train_key_mask.sum(axis=1)) == 1).sum())
    setting = (
        f"client 0 of the docstring pool (K=5 iid, {len(data.train_labels)} training texts, "
        f"{distinct} with a token count no other has), one round of {BATCHES} batches of {BATCH}"
    )
    return [
        AttackResult(
            name="text_lengths_to_server",
            target="the token count of each of a data owner's texts",
            adversary="curious server",
            outcome=SUCCEEDS if shown.server_reads > 0.5 else DEFENDED,
            figure="share of the data owner's texts whose token count the server reads from "
            "its uploaded key masks",
            value=shown.server_reads,
            control=hidden.server_reads,
            test=f"{TESTS}::test_lengths_reach_the_server_unless_the_data_owner_hides_them",
            detail=(
                f"{setting}; the default policy uploads the texts' masks (attention needs them); "
                "control: node config hide-text-lengths=true (all-real masks: the server reads "
                "64 tokens for every text, right only for texts cut at 64)"
            ),
        ),
        AttackResult(
            name="text_rows_linked_by_length",
            target="the server's permutation (which permuted row is which of the client's texts)",
            adversary="curious client",
            outcome=SUCCEEDS if shown.rows_linked > hidden.rows_linked else DEFENDED,
            figure="share of a round's permuted rows the client names correctly from the last "
            "block's key masks (a length only one of its texts has)",
            value=shown.rows_linked,
            control=hidden.rows_linked,
            test=f"{TESTS}::test_the_client_links_rows_by_length_unless_lengths_are_hidden",
            detail=(
                f"{setting}, {shown.rows} rows; the permutation hides a row only among texts of "
                "its length; control: hide-text-lengths (every row reads 64 tokens). Whether the "
                "hidden states show the rows anyway: text_rows_linked_by_content"
            ),
        ),
        AttackResult(
            name="text_rows_linked_by_content",
            target="the server's permutation (which permuted row is which of the client's texts)",
            adversary="curious client",
            outcome=SUCCEEDS if hidden.rows_linked_by_content > 1 / BATCH else DEFENDED,
            figure=f"share of a round's permuted rows of block {hidden.content_block}'s output "
            "(reveal all) the client names correctly by correlating them with its own texts' "
            "embeddings, with hide-text-lengths",
            value=hidden.rows_linked_by_content,
            control=last.rows_linked_by_content,
            test=f"{TESTS}::test_the_client_links_rows_by_content_even_with_lengths_hidden",
            detail=(
                f"{setting}, {hidden.rows} rows; the client embeds its texts with the server's "
                "tables to upload them, and a block's output keeps its input's tokens (padding "
                "included), so hiding lengths does not hide the rows; control: the same with "
                f"reveal = last (block {last.content_block}'s output, the only one the client "
                "sees). Knowing the rows, the client has block inputs and outputs side by side "
                "(the extraction attacks' starting point)"
            ),
        ),
    ]
