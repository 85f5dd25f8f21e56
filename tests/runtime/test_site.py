"""A data owner's site process (:mod:`fedfm.runtime.site`) and the ClientApp that forwards to it."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto

from fedfm.errors import ProtocolAbort, ProtocolError
from fedfm.flower.apps import make_client_app
from fedfm.flower.codec import envelope_to_message, message_to_envelope
from fedfm.runtime import site
from fedfm.runtime.site import Site, SiteError, SiteRefusal, forward
from fedfm.runtime.transport import Envelope
from fedfm_strategies.aggregation import task_identity

OPEN, ADD, LEAVE = "query.open", "query.add", "query.leave"


@dataclass(frozen=True)
class CounterState:
    """A role's state: a running total of what it was sent, and a secret it drew at opening."""

    total: int = 0
    secret: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint8))

    def to_records(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return {"secret": self.secret}, {"total": self.total, "tags": ["a", 1.5]}

    @classmethod
    def from_records(cls, arrays: dict[str, np.ndarray], config: dict[str, Any]) -> CounterState:
        assert config["tags"] == ["a", 1.5]  # lists and floats travel with their types
        return cls(int(config["total"]), arrays["secret"])


class Counter:
    """Adds the request's ``x`` to its total; refuses negative ``x``; ``leave`` aborts."""

    built = 0

    def __init__(self, run_config: dict[str, Any]) -> None:
        self.scale = int(run_config.get("scale", 1))
        Counter.built += 1

    def handle(self, envelope: Envelope, state: CounterState) -> tuple[Envelope, CounterState]:
        if envelope.message_type == OPEN:
            state = CounterState(0, np.frombuffer(os.urandom(8), dtype=np.uint8))
        elif envelope.message_type == LEAVE:
            raise ProtocolAbort("leaving", state=CounterState(-1, state.secret))
        else:
            x = int(envelope.arrays["x"][0])
            if x == 13:
                raise RuntimeError("a bug in the role")
            if x < 0:
                raise ProtocolError(f"x = {x} is negative")
            state = CounterState(state.total + self.scale * x, state.secret)
        reply = Envelope(
            envelope.message_type,
            envelope.node_id,
            envelope.round,
            {"total": np.array([state.total])},
            {"note": b"\x00bytes", "flag": True, "ratio": 2.0},
        )
        return reply, state


def request(message_type: str, x: int = 0, round_: int = 1) -> Envelope:
    return Envelope(message_type, 7, round_, {"x": np.array([x])}, {"k": "v"})


class Running:
    """A site served from a thread, stopped at the end of the test."""

    def __init__(self, folder: Path) -> None:
        self.site = Site(folder, Counter, CounterState, opening=(OPEN,), log=lambda _: None)
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self.site.serve, kwargs={"stop": self._stop.is_set, "poll": 0.05}
        )
        self.thread.start()
        assert self.site.ready.wait(10), "the site did not start"

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


@pytest.fixture
def folder() -> Iterator[Path]:
    # Unix socket paths are short (108 bytes): pytest's tmp_path may be too long
    import tempfile

    with tempfile.TemporaryDirectory(prefix="site-") as name:
        yield Path(name) / "site"


@pytest.fixture
def running(folder: Path) -> Iterator[Running]:
    served = Running(folder)
    yield served
    served.stop()


def send(folder: Path, envelope: Envelope, run_id: int = 1, **run_config: Any) -> Envelope:
    return forward(folder, run_id=run_id, run_config=run_config, envelope=envelope, timeout=10)


def test_a_site_answers_in_order_keeps_state_per_run_and_values_keep_their_types(
    running: Running, folder: Path
) -> None:
    Counter.built = 0
    assert send(folder, request(OPEN), scale=3).arrays["total"][0] == 0
    reply = send(folder, request(ADD, 5), scale=3)
    assert reply.arrays["total"][0] == 15
    assert reply.config == {"note": b"\x00bytes", "flag": True, "ratio": 2.0}
    assert isinstance(reply.config["ratio"], float) and reply.node_id == 7
    assert send(folder, request(ADD, 1), scale=3).arrays["total"][0] == 18
    # a second run has its own role and state
    send(folder, request(OPEN), run_id=2, scale=10)
    assert send(folder, request(ADD, 1), run_id=2).arrays["total"][0] == 10
    assert Counter.built == 2  # one role per run, kept across messages
    modes = {path.name: path.stat().st_mode & 0o777 for path in folder.rglob("*")}
    assert modes["site.key"] == 0o600 and modes["site.sock"] == 0o600
    assert modes["run-1.npz"] == 0o600 and (folder.stat().st_mode & 0o777) == 0o700


def test_a_restarted_site_continues_from_the_state_it_wrote(folder: Path) -> None:
    first = Running(folder)
    send(folder, request(OPEN))
    send(folder, request(ADD, 4))
    secret = first.site._states[1].secret.copy()
    first.stop()
    with pytest.raises(SiteError, match="no site process is listening"):
        send(folder, request(ADD, 1))
    second = Running(folder)
    try:
        assert send(folder, request(ADD, 1)).arrays["total"][0] == 5
        np.testing.assert_array_equal(second.site._states[1].secret, secret)
    finally:
        second.stop()


def test_a_message_for_a_run_the_site_does_not_know_is_refused_by_name(
    running: Running, folder: Path
) -> None:
    with pytest.raises(SiteRefusal, match="this site knows no run 9"):
        send(folder, request(ADD, 1), run_id=9)
    assert not running.site.paths.state(9).exists()


def test_a_refusal_names_the_roles_error_and_keeps_the_state_an_abort_saves_its_own(
    running: Running, folder: Path
) -> None:
    send(folder, request(OPEN))
    send(folder, request(ADD, 2))
    with pytest.raises(SiteRefusal, match="ProtocolError: x = -1 is negative"):
        send(folder, request(ADD, -1))
    assert send(folder, request(ADD, 1)).arrays["total"][0] == 3
    # a bug in the role (not a refusal) is reported and the site serves the next message
    with pytest.raises(SiteRefusal, match="internal error in the site's role: RuntimeError"):
        send(folder, request(ADD, 13))
    assert send(folder, request(ADD, 1)).arrays["total"][0] == 4
    with pytest.raises(SiteRefusal, match="ProtocolAbort: leaving"):
        send(folder, request(LEAVE))
    assert running.site._states[1].total == -1


def test_a_client_without_the_sites_key_gets_no_answer_and_the_site_keeps_serving(
    running: Running, folder: Path
) -> None:
    send(folder, request(OPEN))
    true_key = (folder / "site.key").read_bytes()
    (folder / "site.key").write_bytes(bytes(32))
    with pytest.raises(SiteError, match="did not answer"):
        send(folder, request(ADD, 1))
    (folder / "site.key").write_bytes(true_key)
    assert send(folder, request(ADD, 1)).arrays["total"][0] == 1
    assert running.site._states[1].total == 1


def listening_without_the_key(folder: Path) -> socket.socket:
    """A socket bound where the site's would be (owner-only), by a process without the key."""
    site.prepare_site_folder(folder)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / "site.sock"))
    (folder / "site.sock").chmod(0o600)
    listener.listen(1)
    return listener


def test_an_answer_that_fails_authentication_is_refused(folder: Path) -> None:
    """A process that bound the socket without the key cannot answer in the site's name."""
    impostor = listening_without_the_key(folder)

    def answer() -> None:
        connection, _ = impostor.accept()
        with connection:
            connection.sendall(site.MAGIC + bytes(site.NONCE_BYTES))
            site._receive_frame(connection)
            body = site._body({"ok": True, "message_type": ADD, "round": 1}, {})
            site._send_frame(connection, body, bytes(site.TAG_BYTES))

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(SiteError, match="fails authentication"):
            send(folder, request(ADD, 1))
    finally:
        thread.join(10)
        impostor.close()


def test_a_site_killed_with_a_message_in_flight_fails_that_message_quickly(folder: Path) -> None:
    """The site reads the request and dies before answering: the ClientApp's error names it."""
    dying = listening_without_the_key(folder)

    def die() -> None:
        connection, _ = dying.accept()
        connection.sendall(site.MAGIC + bytes(site.NONCE_BYTES))
        site._receive_frame(connection)
        connection.close()  # what the kernel does for a killed process

    thread = threading.Thread(target=die)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(SiteError, match=r"did not answer query\.add .*killed"):
            send(folder, request(ADD, 1))
    finally:
        thread.join(10)
        dying.close()
    assert time.monotonic() - started < 5
    # the socket file the dead site left behind: a restarted site takes it over
    restarted = Running(folder)
    try:
        assert send(folder, request(OPEN)).arrays["total"][0] == 0
    finally:
        restarted.stop()


@pytest.mark.parametrize("target", ["folder", "key"])
def test_a_folder_or_key_others_can_read_is_refused_with_the_fix(
    running: Running, folder: Path, target: str
) -> None:
    path = folder if target == "folder" else folder / "site.key"
    path.chmod(0o755 if target == "folder" else 0o644)
    try:
        with pytest.raises(SiteError, match=r"group and others must have no access \(chmod"):
            send(folder, request(OPEN))
        with pytest.raises(SiteError, match="group and others"):
            Site(folder, Counter, CounterState)
    finally:
        path.chmod(0o700 if target == "folder" else 0o600)


def test_a_second_site_on_the_same_folder_is_refused(running: Running, folder: Path) -> None:
    with pytest.raises(SiteError, match="already serving"):
        Site(folder, Counter, CounterState).serve(stop=lambda: True)


def test_a_socket_path_too_long_for_unix_sockets_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SiteError, match="longer than a Unix socket allows"):
        site.prepare_site_folder(tmp_path / ("x" * 120))


def test_the_clientapp_forwards_to_the_site_named_by_its_node_config(
    running: Running, folder: Path
) -> None:
    """``site-dir`` in the node config: the app never builds the role or touches context.state."""

    def no_role(_context: Context) -> Counter:
        raise AssertionError("the role is built in the site, not in the ClientApp")

    app = make_client_app(no_role, CounterState, message_types=(OPEN, ADD), state_name="counter")

    def deliver(envelope: Envelope, node_config: dict[str, Any]) -> Message:
        with task_identity():  # a message is made on a server task
            message = message_from_proto(message_to_proto(envelope_to_message(envelope)))
        context = Context(3, 7, node_config, RecordDict(), {"scale": 2})
        reply = app(message, context)
        assert len(context.state) == 0
        return reply

    config = {"site-dir": str(folder)}
    deliver(request(OPEN), config)
    reply = deliver(request(ADD, 4), config)
    assert message_to_envelope(reply, 7).arrays["total"][0] == 8
    refused = deliver(request(ADD, -1), config)
    assert refused.has_error() and "x = -1 is negative" in refused.error.reason
    down = deliver(request(ADD, 1), {"site-dir": str(folder.parent / "nowhere")})
    assert down.has_error() and "does not exist" in down.error.reason


def test_a_site_keeps_only_recent_runs_in_memory_and_reloads_an_older_one(
    running: Running, folder: Path
) -> None:
    for run_id in range(1, site.RUNS_IN_MEMORY + 3):
        send(folder, request(OPEN), run_id=run_id)
        send(folder, request(ADD, run_id), run_id=run_id)
    assert len(running.site._roles) == site.RUNS_IN_MEMORY and 1 not in running.site._states
    assert send(folder, request(ADD, 10), run_id=1).arrays["total"][0] == 11
