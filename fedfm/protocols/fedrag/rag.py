"""The ``rag`` stage: retrieval (§5.1), collaborative re-ranking (§5.2), then the segments.

Inputs: an owner's ``documents`` (UTF-8 texts joined by NUL bytes, uint8) and ``index`` (their
embeddings, one row each, the coordinator's embedding model); the coordinator's ``query_text``
(UTF-8, uint8), ``query_embedding``, and its relevance head ``reranker_weight``,
``reranker_bias``.

Steps: ``retrieve`` (coordinator: its embedding in the clear, or under CKKS), ``score`` (owners:
local top-k ids and scores, or encrypted scores of every document), ``candidates``
(coordinator: global top-k by score, each owner told which of its documents are candidates),
``rerank_l<l>_q`` / ``rerank_l<l>_attn`` per encoder layer (:mod:`.reranking`), ``select``
(coordinator: relevance scores, global top-m, each owner told which of its documents form its
segment). The generation's ``segments`` step then builds each owner's segment from its selected
documents (each cut at :data:`DOCUMENT_TOKENS` decoder tokens) and the coordinator's from the
query (``"\\n" + query``: the task continues it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import fedfm.protocols.fedrag.keys as keyring
from fedfm.errors import ConfigError, ProtocolError
from fedfm.protocols.fedrag.attention import attention_with_lse
from fedfm.protocols.fedrag.decoder import DecoderRunner
from fedfm.protocols.fedrag.plan import COORDINATOR
from fedfm.protocols.fedrag.reranking import encoder_runner, features, relevance
from fedfm.protocols.fedrag.retrieval import (
    IndexEvaluator,
    QueryKeys,
    check_embeddings,
    plaintext_scores,
    top_k,
)
from fedfm.protocols.fedrag.scrambler import key_purpose, token_permutation
from fedfm.runtime.protocol import RoleContext, Step

DOCUMENT_TOKENS = 40  # decoder tokens per selected document in the generation's context
SEPARATOR = b"\x00"


def split_documents(context: RoleContext) -> list[str]:
    raw = np.asarray(context.input("documents"), dtype=np.uint8).tobytes()
    return raw.decode("utf-8").split(SEPARATOR.decode())


def join_documents(texts: list[str]) -> np.ndarray:
    """The ``documents`` input of an owner."""
    if any(SEPARATOR.decode() in text for text in texts):
        raise ConfigError("documents may not contain NUL characters")
    return np.frombuffer(SEPARATOR.join(t.encode("utf-8") for t in texts), dtype=np.uint8).copy()


def query_prompt(query: str) -> str:
    return f"\n{query}"


def _prefixed(prefix: str, payload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{prefix}.{name}": value for name, value in payload.items()}


def _unprefixed(prefix: str, message: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    start = f"{prefix}."
    return {n[len(start) :]: v for n, v in message.items() if n.startswith(start)}


class RagStages:
    """Retrieval and re-ranking steps, and the segment builder for the generation."""

    def __init__(self, settings: object, *, runner_for: Callable[[str], DecoderRunner]) -> None:
        self.settings = settings
        self.plan = settings.plan  # type: ignore[attr-defined]
        self.runner_for = runner_for

    @property
    def _s(self) -> object:
        return self.settings

    # -- retrieval ----------------------------------------------------------------------------

    def _retrieve(self, context: RoleContext) -> None:
        query = np.asarray(context.input("query_embedding"), dtype=np.float64).reshape(-1)
        if self.settings.retrieval == "faithful":  # type: ignore[attr-defined]
            for owner in self.plan.owner_roles:
                context.send(owner, {"embedding": query})
            return
        keys = QueryKeys.generate()
        context.state["ckks"] = keys.secret_state()
        message = {
            "context": keys.public_context(),
            **_prefixed("query", keys.encrypt_query(query)),
        }
        for owner in self.plan.owner_roles:
            context.send(owner, message)

    def _score(self, context: RoleContext) -> None:
        index = check_embeddings(f"{context.role}'s index", context.input("index"))
        if len(split_documents(context)) != index.shape[0]:
            raise ConfigError(
                f"{context.role} has {index.shape[0]} embeddings for a different number of "
                "documents"
            )
        message = context.receive(COORDINATOR)
        k = self.settings.top_k  # type: ignore[attr-defined]
        if self.settings.retrieval == "faithful":  # type: ignore[attr-defined]
            scores = plaintext_scores(message["embedding"], index)
            ids = top_k(scores, k)
            context.send(COORDINATOR, {"ids": ids, "scores": scores[ids]})
            return
        evaluator = IndexEvaluator(message["context"])
        payload = evaluator.scores(_unprefixed("query", message), index)
        context.send(
            COORDINATOR, {**_prefixed("scores", payload), "count": np.asarray([index.shape[0]])}
        )

    def _candidates(self, context: RoleContext) -> None:
        found = []  # (score, owner index, document id)
        keys = QueryKeys.restore(context.state.pop("ckks")) if "ckks" in context.state else None
        for number, owner in enumerate(self.plan.owner_roles):
            message = context.receive(owner)
            if keys is None:
                ids, scores = np.asarray(message["ids"]), np.asarray(message["scores"])
            else:
                count = int(np.asarray(message["count"]).reshape(-1)[0])
                scores = keys.decrypt_scores(_unprefixed("scores", message), count)
                ids = np.arange(count)
            found += [(float(s), number, int(i)) for s, i in zip(scores, ids, strict=True)]
        found.sort(key=lambda item: (-item[0], item[1], item[2]))
        chosen = found[: self.settings.top_k]  # type: ignore[attr-defined]
        context.state["cand.owner"] = np.asarray([c[1] for c in chosen], dtype=np.int64)
        context.state["cand.doc"] = np.asarray([c[2] for c in chosen], dtype=np.int64)
        context.state["report.retrieval_scores"] = np.asarray([c[0] for c in chosen])
        encoder = encoder_runner()
        text = np.asarray(context.input("query_text"), dtype=np.uint8).tobytes().decode("utf-8")
        query_ids = encoder.query_ids(text)
        hidden = encoder.embed(query_ids, 0, 0)
        for number, owner in enumerate(self.plan.owner_roles):
            mine = [i for i, c in enumerate(chosen) if c[1] == number]
            context.send(
                owner,
                {
                    "candidates": np.asarray(mine, dtype=np.int64),
                    "documents": np.asarray([chosen[i][2] for i in mine], dtype=np.int64),
                    "query_length": np.asarray([query_ids.size]),
                },
            )
        for i in range(len(chosen)):
            context.state[f"rr.{i}.hidden"] = hidden

    # -- re-ranking ---------------------------------------------------------------------------

    def _pairs(self, context: RoleContext) -> list[tuple[int, str]]:
        """(candidate, the other party) for every candidate this role takes part in."""
        if context.role == COORDINATOR:
            owners = context.state["cand.owner"]
            return [(i, self.plan.owner_roles[int(o)]) for i, o in enumerate(owners)]
        return [(int(i), COORDINATOR) for i in context.state.get("rr.candidates", [])]

    def _owner_start(self, context: RoleContext) -> None:
        message = context.receive(COORDINATOR)
        encoder = encoder_runner()
        texts = split_documents(context)
        start = int(np.asarray(message["query_length"]).reshape(-1)[0])
        context.state["rr.candidates"] = np.asarray(message["candidates"], dtype=np.int64)
        for i, doc in zip(message["candidates"], message["documents"], strict=True):
            if not 0 <= int(doc) < len(texts):
                raise ProtocolError(f"the coordinator named document {int(doc)} of {context.role}")
            context.state[f"rr.{int(i)}.hidden"] = encoder.embed(
                encoder.document_ids(texts[int(doc)]), 1, start
            )

    def _purpose(self, candidate: int, inquirer: str, owner: str, layer: int) -> str:
        return key_purpose(self.settings.request, f"rerank{candidate}", inquirer, owner, layer)  # type: ignore[attr-defined]

    def _derive(self, context: RoleContext, peer: str, purpose: str) -> keyring.AttentionKeys:
        encoder = encoder_runner()
        return keyring.derive(
            context,
            peer,
            purpose,
            heads=encoder.heads,
            head_dim=encoder.head_dim,
            kind=self.settings.scrambler,  # type: ignore[attr-defined]
            scaling_range=self.settings.scaling_range,  # type: ignore[attr-defined]
        )

    def _pre(self, layer: int, context: RoleContext) -> None:
        encoder = encoder_runner()
        by_compute: dict[str, dict[str, np.ndarray]] = {}
        for i, peer in self._pairs(context):
            q, k, v = encoder.qkv(layer, context.state[f"rr.{i}.hidden"])
            inquire = self._derive(context, peer, self._purpose(i, context.role, peer, layer))
            serve = self._derive(context, peer, self._purpose(i, peer, context.role, layer))
            q_order, kv_order = token_permutation(q.shape[1]), token_permutation(k.shape[1])
            context.state.update(keyring.keys_to_arrays(f"rr.{i}.keys", inquire))
            context.state[f"rr.{i}.order"] = q_order
            message = by_compute.setdefault(self.plan.compute_role(context.role, peer), {})
            message[f"{i}.q"] = inquire.scramble_queries(q.astype(np.float64))[:, q_order].astype(
                np.float32
            )
            message[f"{i}.k"] = serve.scramble_keys(k.astype(np.float64))[:, kv_order].astype(
                np.float32
            )
            message[f"{i}.v"] = serve.scramble_values(v.astype(np.float64))[:, kv_order].astype(
                np.float32
            )
        for compute, message in by_compute.items():
            context.send(compute, message)

    def _post(self, layer: int, context: RoleContext) -> None:
        encoder = encoder_runner()
        for i, peer in self._pairs(context):
            message = context.receive(self.plan.compute_role(context.role, peer))
            order = context.state.pop(f"rr.{i}.order")
            out, lse = np.empty_like(message[f"{i}.out"]), np.empty_like(message[f"{i}.lse"])
            out[:, order], lse[:, order] = message[f"{i}.out"], message[f"{i}.lse"]
            keys = keyring.keys_from_state(context.state, f"rr.{i}.keys", self.settings.scrambler)  # type: ignore[attr-defined]
            out = keys.unscramble_outputs(out.astype(np.float64))
            remote = [
                (torch.from_numpy(out.astype(np.float32)), torch.from_numpy(lse.astype(np.float32)))
            ]
            context.state[f"rr.{i}.hidden"] = encoder.finish(
                layer, context.state[f"rr.{i}.hidden"], remote
            )

    def _layer_step(self, layer: int, context: RoleContext) -> None:
        if layer == 0 and context.role != COORDINATOR:
            self._owner_start(context)
        if layer > 0:
            self._post(layer - 1, context)
        self._pre(layer, context)

    def _compute(self, context: RoleContext) -> None:
        encoder = encoder_runner()
        got = {message.sender: message.arrays for message in context.inbox}
        replies: dict[str, dict[str, np.ndarray]] = {}
        answered: set[str] = set()
        for first, second in self.plan.served(context.role):
            if COORDINATOR not in (first, second):
                continue  # the generation's owner-owner pairs
            owner = second if first == COORDINATOR else first
            if owner not in got:
                continue  # no candidate of this owner
            coordinator = got.get(COORDINATOR, {})
            for i in sorted({name.split(".")[0] for name in got[owner]}):
                if f"{i}.q" not in coordinator:
                    raise ProtocolError(f"{owner} sent candidate {i}, the coordinator did not")
                answered.add(i)
                for asker, holder in ((COORDINATOR, owner), (owner, COORDINATOR)):
                    out, lse = attention_with_lse(
                        got[asker][f"{i}.q"], got[holder][f"{i}.k"], got[holder][f"{i}.v"],
                        scaling=encoder.scaling,
                    )  # fmt: skip
                    reply = replies.setdefault(asker, {})
                    reply[f"{i}.out"] = out.numpy().astype(np.float32)
                    reply[f"{i}.lse"] = lse.numpy().astype(np.float32)
        asked = {name.split(".")[0] for name in got.get(COORDINATOR, {})}
        if asked - answered:
            raise ProtocolError(f"no owner sent re-ranking candidates {sorted(asked - answered)}")
        for receiver, reply in replies.items():
            context.send(receiver, reply)

    def _select(self, context: RoleContext) -> None:
        encoder = encoder_runner()
        self._post(encoder.layers - 1, context)
        weight, bias = context.input("reranker_weight"), context.input("reranker_bias")
        owners, docs = context.state["cand.owner"], context.state["cand.doc"]
        scores = np.asarray(
            [
                relevance(weight, bias, features(context.state[f"rr.{i}.hidden"]))
                for i in range(owners.size)
            ]
        )
        chosen = top_k(scores, self.settings.top_m)  # type: ignore[attr-defined]
        context.state["report.rerank_scores"] = scores
        context.state["report.selected_owner"] = owners[chosen]
        context.state["report.selected_document"] = docs[chosen]
        for number, owner in enumerate(self.plan.owner_roles):
            picked = [int(docs[i]) for i in chosen if int(owners[i]) == number]
            context.send(owner, {"selected": np.asarray(picked, dtype=np.int64)})
        for name in [n for n in context.state if n.startswith(("rr.", "cand."))]:
            del context.state[name]

    def steps(self) -> list[Step]:
        encoder_layers = _encoder_layers()
        steps = [
            Step("retrieve", (COORDINATOR,), self._retrieve),
            Step("score", self.plan.owner_roles, self._score),
            Step("candidates", (COORDINATOR,), self._candidates),
        ]
        computes = tuple(
            dict.fromkeys(self.plan.compute_role(COORDINATOR, o) for o in self.plan.owner_roles)
        )
        for layer in range(encoder_layers):
            roles = (COORDINATOR, *self.plan.owner_roles)
            steps.append(Step(f"rerank_l{layer}_q", roles, _bound(self._layer_step, layer)))
            steps.append(Step(f"rerank_l{layer}_attn", computes, self._compute))
        steps.append(Step("select", (COORDINATOR,), self._select))
        return steps

    # -- the generation's segments -------------------------------------------------------------

    def segment(self, context: RoleContext, runner: DecoderRunner) -> np.ndarray:
        tokenizer = runner.tokenizer
        if context.role == COORDINATOR:
            text = np.asarray(context.input("query_text"), dtype=np.uint8).tobytes().decode("utf-8")
            return np.asarray(tokenizer(query_prompt(text), add_special_tokens=False)["input_ids"])
        for name in [n for n in context.state if n.startswith("rr.")]:
            del context.state[name]
        selected = context.receive(COORDINATOR)["selected"]
        texts = split_documents(context)
        ids: list[int] = (
            [tokenizer.bos_token_id] if context.role == self.plan.owner_roles[0] else []
        )
        for doc in np.asarray(selected, dtype=np.int64):
            if not 0 <= int(doc) < len(texts):
                raise ProtocolError(
                    f"the coordinator selected document {int(doc)} of {context.role}"
                )
            body = tokenizer("\n" + texts[int(doc)], add_special_tokens=False)["input_ids"]
            ids += body[:DOCUMENT_TOKENS]
        if not ids:
            ids = tokenizer("\n", add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)


def _bound(action: Callable[[int, RoleContext], None], layer: int) -> Callable[[RoleContext], None]:
    return lambda context: action(layer, context)


def _encoder_layers() -> int:
    import json

    from fedfm.models.text_encoders import packaged_minilm_path

    config = json.loads((packaged_minilm_path() / "config.json").read_text())
    return int(config["num_hidden_layers"])
