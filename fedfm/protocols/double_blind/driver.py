"""The round loop of double-blind adaptation over any :class:`~fedfm.runtime.transport.Transport`.

The same loop runs in-process (tests, benchmarks) and in a Flower ServerApp: setup once, then per
round ``L + 1`` round trips to train (every client's messages go out together), with secure
aggregation (the default) 4 round trips of SecAgg stages, aggregation through an
:class:`Aggregator`, and one round trip to evaluate (every ``evaluate_every`` rounds and after
the last; a round not evaluated records NaN accuracies) on the held-out outputs the client keeps:
in the first evaluated round its held-out set rides along the training batches
(:meth:`DoubleBlindServer.start`); a client that lost them is evaluated in full, ``L`` round
trips. Clients that fail or time out are logged
and leave the round; the round goes on while at least ``min_clients`` answer (and, under secure
aggregation, at least two and as many as the SecAgg threshold needs). After every round the
global adapter and head are saved; a run started again with the same settings resumes after the
last saved round.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedfm.crypto.randomness import restore_stream
from fedfm.errors import CheckpointError, FedfmError, InvariantError, ProtocolError
from fedfm.protocols.double_blind.config import MIN_SECURE_AGGREGATE, TRAIN_SECAGG
from fedfm.protocols.double_blind.server import (
    ClientUpdate,
    DoubleBlindServer,
    EvaluationResult,
    balanced_accuracy,
)
from fedfm.protocols.secure_aggregation import run_secure_aggregation
from fedfm.runtime.transport import Envelope, Failure, PipelinedTransport, Transport
from fedfm.secagg import ArrayLayout, SecAggConfig

PROGRESS_SECONDS = 10.0  # at most one progress line per phase this often


@dataclass(frozen=True)
class SecureAggregate:
    """A round's result under secure aggregation: all the server learns of the clients' updates.

    ``arrays`` are the global arrays plus the securely averaged update, i.e. the weighted average
    ``sum_k N_k x_k / sum_k N_k`` of the included clients' new adapters and heads (within the
    quantization error, see ``docs/secure_aggregation.md``); ``total_weight`` is ``sum_k N_k``;
    ``included`` the clients whose updates it holds; ``train_loss`` their weighted mean loss.
    """

    arrays: dict[str, np.ndarray]
    total_weight: int
    included: frozenset[int]
    train_loss: float


class Aggregator(Protocol):
    """Combines a round's training into new global arrays (a strategy's job).

    ``aggregate`` gets each client's update (secure aggregation off); ``aggregate_secure`` gets
    the one securely averaged aggregate, which is all there is with secure aggregation on.
    """

    def aggregate(
        self, server_round: int, global_arrays: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]: ...

    def aggregate_secure(
        self, server_round: int, global_arrays: dict[str, np.ndarray], aggregate: SecureAggregate
    ) -> dict[str, np.ndarray]: ...


class WeightedAverage:
    """FedAvg's weighted mean, ``alpha_k = N_k / sum_j N_j`` (Eq. 7)."""

    def aggregate(
        self, server_round: int, global_arrays: dict[str, np.ndarray], updates: list[ClientUpdate]
    ) -> dict[str, np.ndarray]:
        if not updates:
            raise InvariantError("internal: a weighted average of no update")
        total = sum(update.num_examples for update in updates)
        return {
            name: np.asarray(
                sum(u.arrays[name] * (u.num_examples / total) for u in updates)
            ).astype(global_arrays[name].dtype)
            for name in global_arrays
        }

    def aggregate_secure(
        self, server_round: int, global_arrays: dict[str, np.ndarray], aggregate: SecureAggregate
    ) -> dict[str, np.ndarray]:
        """The secure aggregate already is the weighted mean (SecAgg weights by ``N_k``)."""
        return dict(aggregate.arrays)


@dataclass
class RoundRecord:
    """What one round produced (also one line of the run's history).

    ``clients_trained`` counts the clients whose update went into the new global arrays (under
    secure aggregation: into the aggregate), ``train_loss`` is their mean weighted by examples,
    ``failures`` names every client that left the round and why, ``round_trips`` counts training,
    SecAgg stages and evaluation.
    """

    round: int
    train_loss: float
    balanced_accuracy: float
    accuracy: float
    clients_trained: int
    clients_evaluated: int
    failures: list[str]
    seconds: float
    round_trips: int
    # Time inside the transport (the clients' work plus the messages' way there and back) and
    # the median round trip; the rest of ``seconds`` is the server's own work.
    transport_seconds: float = float("nan")
    median_round_trip_seconds: float = float("nan")


class _TimedTransport:
    """A transport that records how long each round trip took (for the round record); with a
    pipelined inner transport, each request's time from post to reply. ``waiting`` is the wall
    time spent inside the transport (round trips overlap when pipelined, so it is not the sum of
    the durations)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.durations: list[float] = []
        self.waiting = 0.0
        self._posted: dict[int, float] = {}

    def clear(self) -> None:
        """Forget the round trips recorded so far (a new round starts)."""
        self.durations.clear()
        self.waiting = 0.0

    def send_and_receive(
        self, envelopes: Iterable[Envelope], *, timeout: float | None = None
    ) -> list[Envelope | Failure]:
        started = time.perf_counter()
        try:
            return self.inner.send_and_receive(envelopes, timeout=timeout)
        finally:
            self.durations.append(time.perf_counter() - started)
            self.waiting += self.durations[-1]

    @property
    def pipelined(self) -> PipelinedTransport | None:
        """The inner transport if it can keep requests in flight node by node."""
        inner = self.inner
        return inner if hasattr(inner, "post") and hasattr(inner, "replies") else None  # type: ignore[return-value]

    def post(self, envelope: Envelope, *, timeout: float | None) -> None:
        inner = self.pipelined
        if inner is None:
            raise ProtocolError(f"{type(self.inner).__name__} cannot pipeline requests")
        self._posted[envelope.node_id] = started = time.perf_counter()
        try:
            inner.post(envelope, timeout=timeout)
        finally:
            self.waiting += time.perf_counter() - started

    def replies(self) -> list[Envelope | Failure]:
        inner = self.pipelined
        if inner is None:
            raise ProtocolError(f"{type(self.inner).__name__} cannot pipeline requests")
        started = time.perf_counter()
        answered = inner.replies()
        now = time.perf_counter()
        self.waiting += now - started
        for reply in answered:
            if (posted := self._posted.pop(reply.node_id, None)) is not None:
                self.durations.append(now - posted)
        return answered


@dataclass
class RunState:
    """The driver's resumable state."""

    round: int = 0
    global_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    history: list[RoundRecord] = field(default_factory=list)
    rng_state: dict[str, Any] = field(default_factory=dict)


def _answer(
    server: DoubleBlindServer,
    reply: Envelope | Failure,
    failures: list[str],
    log: Callable[[str], None],
) -> Envelope | ClientUpdate | EvaluationResult | None:
    """The server's answer to one reply: the node's next request, its result, or ``None`` when
    the node left the round (its failure recorded)."""
    if isinstance(reply, Failure):
        failures.append(f"node {reply.node_id}: {reply.reason}")
        log(f"[fedfm] node {reply.node_id} left the round: {reply.reason}")
        server.abandon(reply.node_id)
        return None
    try:
        return server.on_reply(reply)
    except FedfmError as error:
        failures.append(f"node {reply.node_id}: {error}")
        log(f"[fedfm] node {reply.node_id} left the round: {error}")
        server.abandon(reply.node_id)
        return None


def _exchange_pipelined(
    server: DoubleBlindServer,
    transport: _TimedTransport,
    requests: list[Envelope],
    *,
    timeout: float | None,
    failures: list[str],
    log: Callable[[str], None],
    progress: Callable[[int, list[Envelope]], None] | None = None,
) -> tuple[list[ClientUpdate | EvaluationResult], int]:
    """:func:`_exchange` with each client's next request sent as soon as its reply is answered,
    not once every client's reply is in: one client's round trips overlap the others' and the
    server's work on them. The messages each client gets are the same; the round trips counted
    are the most any client took."""
    # (messages the client took, its place among the requests, result): sorted as the lockstep
    # exchange lists them, so that aggregation adds the same numbers in the same order
    finished: list[tuple[int, int, ClientUpdate | EvaluationResult]] = []
    place = {request.node_id: index for index, request in enumerate(requests)}
    in_flight: dict[int, Envelope] = {}
    sent: dict[int, int] = {}

    def post(request: Envelope) -> None:
        in_flight[request.node_id] = request
        sent[request.node_id] = sent.get(request.node_id, 0) + 1
        transport.post(request, timeout=timeout)

    for request in requests:
        post(request)
    while in_flight:
        if progress is not None:
            progress(max(sent.values()) - 1, list(in_flight.values()))
        for reply in transport.replies():
            if in_flight.pop(reply.node_id, None) is None:
                continue  # not a request of this exchange
            outcome = _answer(server, reply, failures, log)
            if isinstance(outcome, Envelope):
                post(outcome)
            elif outcome is not None:
                finished.append((sent[reply.node_id], place[reply.node_id], outcome))
    finished.sort(key=lambda entry: entry[:2])
    return [outcome for _, _, outcome in finished], max(sent.values(), default=0)


def _exchange(
    server: DoubleBlindServer,
    transport: Transport,
    requests: list[Envelope],
    *,
    timeout: float | None,
    failures: list[str],
    log: Callable[[str], None],
    progress: Callable[[int, list[Envelope]], None] | None = None,
    pipelined: bool = False,
) -> tuple[list[ClientUpdate | EvaluationResult], int]:
    """Send requests and keep answering replies until every client reached a result or failed;
    ``progress`` hears the round trips so far and the requests about to go out. ``pipelined``
    (with a transport that can, :class:`~fedfm.runtime.transport.PipelinedTransport`): each
    client's next request goes out as soon as its reply is answered."""
    if pipelined and isinstance(transport, _TimedTransport) and transport.pipelined is not None:
        return _exchange_pipelined(
            server,
            transport,
            requests,
            timeout=timeout,
            failures=failures,
            log=log,
            progress=progress,
        )
    results: list[ClientUpdate | EvaluationResult] = []
    trips = 0
    while requests:
        if progress is not None:
            progress(trips, requests)
        replies = transport.send_and_receive(requests, timeout=timeout)
        trips += 1
        answered = set()
        next_requests: list[Envelope] = []
        for reply in replies:
            answered.add(reply.node_id)
            outcome = _answer(server, reply, failures, log)
            if isinstance(outcome, Envelope):
                next_requests.append(outcome)
            elif outcome is not None:
                results.append(outcome)
        for request in requests:
            if request.node_id not in answered:
                failures.append(f"node {request.node_id}: no reply")
                log(f"[fedfm] node {request.node_id} left the round: no reply")
                server.abandon(request.node_id)
        requests = next_requests
    return results, trips


def _phase(
    server: DoubleBlindServer,
    kind: str,
    nodes: list[int],
    server_round: int,
    global_arrays: dict[str, np.ndarray],
    with_evaluation: bool = False,
    **exchange: Any,
) -> tuple[list[ClientUpdate | EvaluationResult], int]:
    """Start a train or evaluate round on every node that has enough data and run it through
    (``with_evaluation``: held-out sets ride along the training, :meth:`DoubleBlindServer.
    start`)."""
    requests = [
        request
        for node in nodes
        if (
            request := server.start(
                kind, node, server_round, global_arrays, with_evaluation=with_evaluation
            )
        )
        is not None
    ]
    return _exchange(server, requests=requests, **exchange)


def progress_lines(
    server: DoubleBlindServer,
    heading: str,
    log: Callable[[str], None],
    every: float,
) -> Callable[[int, list[Envelope]], None]:
    """A ``progress`` callback for :func:`_exchange`: one line, at most every ``every`` seconds,
    naming the round trips so far and where each client in flight stands (block, refreshes).
    An encrypted block takes tens of refresh round trips; without these lines a user would see
    nothing between two round summaries."""
    last = time.perf_counter()

    def report(trips: int, requests: list[Envelope]) -> None:
        nonlocal last
        now = time.perf_counter()
        if trips == 0 or now - last < every:
            return
        last = now
        where = "; ".join(
            f"node {request.node_id} {server.position(request.node_id)}" for request in requests
        )
        log(f"[fedfm] {heading}: {trips} round trips, {len(requests)} in flight ({where})")

    return report


def _secure_aggregate(
    transport: Transport,
    updates: list[ClientUpdate],
    global_arrays: dict[str, np.ndarray],
    *,
    config: SecAggConfig,
    server_round: int,
    timeout: float | None,
    failures: list[str],
    log: Callable[[str], None],
) -> tuple[SecureAggregate, int]:
    """The SecAgg stages with the clients that trained; their aggregate and the round trips."""
    outcome = run_secure_aggregation(
        transport,
        [update.node_id for update in updates],
        ArrayLayout.of(global_arrays),
        config,
        message_type=TRAIN_SECAGG,
        round_id=server_round,
        timeout=timeout,
        log=log,
    )
    for node, reason in outcome.dropouts.items():
        kept = " (its update is in the aggregate)" if node in outcome.included else ""
        failures.append(f"node {node}: secure aggregation: {reason}{kept}")
        log(f"[fedfm] node {node} left secure aggregation: {reason}{kept}")
    included = [update for update in updates if update.node_id in outcome.included]
    weight = sum(update.num_examples for update in included)
    if weight != outcome.total_weight:
        raise ProtocolError(
            f"round {server_round}: the secure aggregate weighs {outcome.total_weight} examples, "
            f"but its clients reported {weight}: some client masked another weight"
        )
    aggregate = SecureAggregate(
        arrays={
            name: (value + outcome.arrays[name]).astype(value.dtype)
            for name, value in global_arrays.items()
        },
        total_weight=weight,
        included=outcome.included,
        train_loss=sum(u.train_loss * u.num_examples for u in included) / weight,
    )
    return aggregate, outcome.round_trips


def save_state(path: Path, state: RunState, identity: dict[str, Any]) -> None:
    """Write the global arrays (npz) and the history (JSON) atomically."""
    path.mkdir(parents=True, exist_ok=True)
    arrays_tmp = path / "global.partial.npz"
    np.savez(arrays_tmp, **state.global_arrays)  # type: ignore[arg-type]  # numpy's stub
    meta_tmp = path / "state.partial.json"
    # the state holds the server's secret stream (key and position): owner-only, like a key file
    meta_tmp.unlink(missing_ok=True)
    descriptor = os.open(meta_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        meta = {
            "identity": identity,
            "round": state.round,
            "history": [asdict(record) for record in state.history],
            "rng_state": state.rng_state,
        }
        handle.write(json.dumps(meta, indent=2))
    arrays_tmp.replace(path / "global.npz")
    meta_tmp.replace(path / "state.json")


def load_state(path: Path, identity: dict[str, Any]) -> RunState | None:
    """The saved state of a run with the same identity, ``None`` if there is none."""
    meta_path, arrays_path = path / "state.json", path / "global.npz"
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        with np.load(arrays_path) as saved:
            arrays = {name: saved[name] for name in saved.files}
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"saved run state in {path} is unreadable: {error}") from error
    if meta.get("identity") != identity:
        raise CheckpointError(
            f"{path} holds a run with other settings; use another checkpoint folder or remove it"
        )
    history = [RoundRecord(**record) for record in meta["history"]]
    return RunState(
        round=int(meta["round"]),
        global_arrays=arrays,
        history=history,
        rng_state=meta.get("rng_state", {}),
    )


def run_double_blind(
    server: DoubleBlindServer,
    transport: Transport,
    node_ids: list[int],
    *,
    aggregator: Aggregator | None = None,
    checkpoint_dir: Path | None = None,
    identity: dict[str, Any] | None = None,
    timeout: float | None = None,
    secagg_timeout: float | None = None,
    min_clients: int = 1,
    log: Callable[[str], None] = print,
    progress_every: float = PROGRESS_SECONDS,
    pipelined: bool = False,
) -> list[RoundRecord]:
    """Run setup and all rounds; return the history (one record per round).

    ``pipelined``: with a transport that can keep requests in flight node by node (Flower's),
    each client's next training or evaluation request goes out as soon as its reply is answered
    instead of once every client's reply is in (the SecAgg stages stay in lockstep).

    ``timeout`` bounds each round trip of setup, training and evaluation, ``secagg_timeout``
    each SecAgg stage (``None``: no limit). A client that does not answer in time leaves the
    round. While a phase runs, a progress line (round trips, each client's block and refresh)
    goes to ``log`` at most every ``progress_every`` seconds.
    """
    aggregator = aggregator or WeightedAverage()
    config = server.config
    needed = max(min_clients, MIN_SECURE_AGGREGATE) if config.secure_aggregation else min_clients
    identity = identity or {"config": config.to_config()}
    log(
        f"[fedfm] double-blind adaptation: backend={config.backend}, {len(node_ids)} clients, "
        f"{config.rounds} rounds, {server.num_blocks} blocks, batch {config.batch_size} x "
        f"{config.batches_per_round}"
    )
    failures: list[str] = []
    # Under CKKS every client makes its keys here (tens of seconds on 2 cores) and the server
    # loads each public context: the user sees that setup runs, and how long it took.
    log(f"[fedfm] setup: {len(node_ids)} clients make their keys and send the public part")
    setup_started = time.perf_counter()
    setup = transport.send_and_receive(
        [server.setup_request(node) for node in node_ids], timeout=timeout
    )
    for reply in setup:
        if isinstance(reply, Failure):
            log(f"[fedfm] node {reply.node_id} failed setup: {reply.reason}")
            continue
        try:
            server.on_setup(reply)
        except FedfmError as error:
            log(f"[fedfm] node {reply.node_id} failed setup: {error}")
    active = server.ordered_nodes()
    log(
        f"[fedfm] setup: {len(active)} clients ready in {time.perf_counter() - setup_started:.1f} s"
    )
    if len(active) < min_clients:
        raise ProtocolError(f"only {len(active)} clients completed setup, need {min_clients}")

    state = load_state(checkpoint_dir, identity) if checkpoint_dir else None
    if state is not None:
        log(f"[fedfm] resuming after round {state.round} from {checkpoint_dir}")
        # the server's draws continue where they stopped (the clients' momentum restarts)
        server.rng = restore_stream(state.rng_state)
    else:
        state = RunState(global_arrays=server.initial_arrays(server.hidden_size))

    timed = _TimedTransport(transport)
    for server_round in range(state.round + 1, config.rounds + 1):
        started = time.perf_counter()
        timed.clear()
        failures = []
        phase: dict[str, Any] = {
            "transport": timed,
            "timeout": timeout,
            "failures": failures,
            "log": log,
            "pipelined": pipelined,
        }
        heading = f"round {server_round}/{config.rounds} [{config.backend}]"
        outcomes, train_trips = _phase(
            server,
            "train",
            active,
            server_round,
            state.global_arrays,
            with_evaluation=config.evaluates(server_round),
            progress=progress_lines(server, f"{heading} train", log, progress_every),
            **phase,
        )
        updates = [u for u in outcomes if isinstance(u, ClientUpdate)]
        if len(updates) < needed:
            secure = " (secure aggregation needs 2 at least)" if needed > min_clients else ""
            raise ProtocolError(
                f"round {server_round}: {len(updates)} clients finished training, need "
                f"{needed}{secure}; failures: {'; '.join(failures) or 'none'}"
            )
        secagg_trips = 0
        if config.secure_aggregation:
            aggregate, secagg_trips = _secure_aggregate(
                timed,
                updates,
                state.global_arrays,
                config=config.secagg_config(min_clients),
                server_round=server_round,
                timeout=secagg_timeout,
                failures=failures,
                log=log,
            )
            state.global_arrays = aggregator.aggregate_secure(
                server_round, state.global_arrays, aggregate
            )
            clients_trained, train_loss = len(aggregate.included), aggregate.train_loss
        else:
            state.global_arrays = aggregator.aggregate(server_round, state.global_arrays, updates)
            clients_trained = len(updates)
            train_loss = sum(u.train_loss * u.num_examples for u in updates) / sum(
                u.num_examples for u in updates
            )
        results: list[ClientUpdate | EvaluationResult] = []
        eval_trips = 0
        if config.evaluates(server_round):
            results, eval_trips = _phase(
                server,
                "evaluate",
                active,
                server_round,
                state.global_arrays,
                progress=progress_lines(server, f"{heading} evaluate", log, progress_every),
                **phase,
            )
        confusion = sum(
            (r.confusion for r in results if isinstance(r, EvaluationResult)),
            start=np.zeros((server.num_classes,) * 2, dtype=np.int64),
        )
        evaluated = confusion.sum() > 0  # NaN accuracies for a round not evaluated
        record = RoundRecord(
            round=server_round,
            train_loss=float(train_loss),
            balanced_accuracy=balanced_accuracy(confusion),
            accuracy=float(np.trace(confusion) / confusion.sum()) if evaluated else float("nan"),
            clients_trained=clients_trained,
            clients_evaluated=len(results),
            failures=failures,
            seconds=time.perf_counter() - started,
            round_trips=train_trips + secagg_trips + eval_trips,
            transport_seconds=timed.waiting,
            median_round_trip_seconds=float(np.median(timed.durations))
            if timed.durations
            else float("nan"),
        )
        state.history.append(record)
        state.round = server_round
        state.rng_state = server.rng.state()
        if checkpoint_dir is not None:
            save_state(checkpoint_dir, state, identity)
        accuracy = (
            f"balanced accuracy {record.balanced_accuracy:.4f}" if evaluated else "not evaluated"
        )
        log(
            f"[fedfm] round {server_round}/{config.rounds} [{config.backend}]: "
            f"train loss {record.train_loss:.4f}, {accuracy} ({record.clients_trained} trained, "
            f"{record.clients_evaluated} evaluated, {record.round_trips} round trips, "
            f"{record.seconds:.1f} s)"
        )
    return state.history
