"""A data owner's long-lived *site process* and the local channel a thin ClientApp uses to reach it.

On Flower's Deployment Engine every message starts a fresh ``flwr-clientapp`` process that
imports the app, rebuilds the node's role and reads its state (keys included) from
``context.state``: seconds per message before any work. A site process is started once by the
data owner's operator, beside its SuperNode, and keeps the role, its state, keys, model and data
in memory. The ClientApp then only forwards each message's envelope to it over a Unix socket and
returns the answer (:func:`forward`).

The channel is local and owner-only, and authenticated both ways:

- the site's folder (``site-dir`` in the SuperNode's node config) is the operator's alone
  (mode ``0700``), with the socket ``site.sock`` and a 32-byte key ``site.key`` (``0600``, from
  the OS CSPRNG) that only the operator's processes can read;
- each connection starts with a fresh nonce from the site; the request and the reply each carry
  an HMAC-SHA256 tag over the nonce and the bytes, so neither side accepts bytes from a process
  that does not hold the key (another user who could reach the socket, or a stale socket file
  another program bound).

What a site keeps survives a restart: after every answered message it writes the run's state
(``state/run-<id>.npz``, ``0600``) before replying; a restarted site continues from there. A
message for a run the site has no state for is refused by name unless it opens a run (the
protocol's first message). A site that is down, or dies while a message is in flight, makes the
ClientApp fail that message with an error that names the site: the server sees the node drop
out within its timeout and nothing is lost on the site.

Nothing here imports Flower: :mod:`fedfm.flower.apps` connects it to ``ClientApp``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, cast

import numpy as np

from fedfm.errors import FedfmError, ProtocolAbort, ProtocolError
from fedfm.runtime.payload import pack_arrays, unpack_arrays
from fedfm.runtime.transport import ConfigValue, Envelope, NodeRole, StateT

_LOG = logging.getLogger(__name__)

SOCKET_NAME = "site.sock"
KEY_NAME = "site.key"
STATE_FOLDER = "state"
KEY_BYTES = 32
NONCE_BYTES = 32
TAG_BYTES = 32
MAGIC = b"FEDFM-SITE-1"
_LENGTH_BYTES = 8
MAX_FRAME_BYTES = 1 << 34  # 16 GiB: far above any message, refuses garbage lengths
# A Unix socket path is limited to 108 bytes (sun_path) on Linux, the terminating zero included.
MAX_SOCKET_PATH = 107
# Runs whose role and state a site keeps in memory; older ones reload their state from disk
# (and rebuild their role) when a message comes for them again.
RUNS_IN_MEMORY = 4
# How long the site waits for a connected ClientApp to send its request (a client that connects
# and stalls must not block the next message).
REQUEST_SECONDS = 60.0

RunRole = Callable[[Mapping[str, ConfigValue]], NodeRole[Any]]


class SiteError(FedfmError):
    """The site process is unreachable, misconfigured, or answered with bytes it cannot trust."""


class SiteRefusal(FedfmError):
    """The site's role refused the message; the reason is the role's own error."""


# -- the site's folder ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SitePaths:
    """The files of a site folder: the socket, the key and the states of its runs."""

    folder: Path

    @property
    def socket(self) -> Path:
        return self.folder / SOCKET_NAME

    @property
    def key(self) -> Path:
        return self.folder / KEY_NAME

    @property
    def states(self) -> Path:
        return self.folder / STATE_FOLDER

    def state(self, run_id: int) -> Path:
        return self.states / f"run-{run_id}.npz"


def _owner_only(path: Path, what: str, *, folder: bool) -> None:
    """Refuse ``path`` unless it belongs to this user and nobody else may read or write it."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise SiteError(f"{what} {path} does not exist") from None
    kind_ok = stat.S_ISDIR(info.st_mode) if folder else not stat.S_ISDIR(info.st_mode)
    if not kind_ok:
        raise SiteError(f"{what} {path} is not a {'folder' if folder else 'file'}")
    if info.st_uid != os.getuid():
        raise SiteError(f"{what} {path} belongs to uid {info.st_uid}, not to this user")
    loose = stat.S_IMODE(info.st_mode) & 0o077
    if loose:
        raise SiteError(
            f"{what} {path} has mode {stat.S_IMODE(info.st_mode):04o}: group and others must have "
            f"no access (chmod {'700' if folder else '600'} {path})"
        )


def prepare_site_folder(folder: Path) -> SitePaths:
    """Create (or check) a site folder: ``0700``, with a fresh ``0600`` key if it has none.

    Raises
    ------
    SiteError
        If the folder or its key exist with access for group or others, or belong to another
        user, or the socket's path is too long for a Unix socket.
    """
    paths = SitePaths(Path(folder).resolve())
    if len(os.fsencode(paths.socket)) > MAX_SOCKET_PATH:
        raise SiteError(
            f"the socket path {paths.socket} is longer than a Unix socket allows "
            f"({MAX_SOCKET_PATH} bytes): choose a shorter site folder"
        )
    if not paths.folder.exists():
        paths.folder.mkdir(mode=0o700, parents=True)
    _owner_only(paths.folder, "site folder", folder=True)
    if not paths.key.exists():
        descriptor = os.open(paths.key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(secrets.token_bytes(KEY_BYTES))
    paths.states.mkdir(mode=0o700, exist_ok=True)
    _owner_only(paths.states, "site state folder", folder=True)
    read_key(paths)
    return paths


def read_key(paths: SitePaths) -> bytes:
    """The site's key, after checking that only this user can read it."""
    _owner_only(paths.folder, "site folder", folder=True)
    _owner_only(paths.key, "site key file", folder=False)
    key = paths.key.read_bytes()
    if len(key) != KEY_BYTES:
        raise SiteError(f"site key file {paths.key} holds {len(key)} bytes, not {KEY_BYTES}")
    return key


# -- frames --------------------------------------------------------------------------------------
def _typed_value(key: str, value: Any) -> list[Any]:
    if isinstance(value, bool):
        return ["?", value]
    if isinstance(value, int):
        return ["i", value]
    if isinstance(value, float):
        return ["f", value]
    if isinstance(value, str):
        return ["s", value]
    if isinstance(value, bytes):
        return ["b", base64.b64encode(value).decode()]
    if isinstance(value, list):
        return ["l", [_typed_value(key, item) for item in value]]
    raise ProtocolError(
        f"value {key!r} is a {type(value).__name__}; the site channel carries int, float, str, "
        "bytes, bool and lists of them"
    )


def _typed(values: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Config values as JSON with their types (bytes are not JSON, and 1.0 must stay a float)."""
    return {key: _typed_value(key, value) for key, value in values.items()}


def _untyped_value(key: str, entry: Any) -> Any:
    if not (isinstance(entry, list) and len(entry) == 2):
        raise ProtocolError(f"malformed value {key!r} in a site frame")
    kind, raw = entry
    try:
        if kind == "?" and isinstance(raw, bool):
            return raw
        if kind == "i" and isinstance(raw, int):
            return raw
        if kind == "f" and isinstance(raw, int | float):
            return float(raw)
        if kind == "s" and isinstance(raw, str):
            return raw
        if kind == "b" and isinstance(raw, str):
            return base64.b64decode(raw, validate=True)
        if kind == "l" and isinstance(raw, list):
            return [_untyped_value(key, item) for item in raw]
    except ValueError:
        pass
    raise ProtocolError(f"malformed value {key!r} in a site frame")


def _untyped(values: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(values, Mapping):
        raise ProtocolError("malformed values in a site frame")
    return {str(key): _untyped_value(str(key), entry) for key, entry in values.items()}


def _body(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return len(text).to_bytes(_LENGTH_BYTES, "big") + text + pack_arrays(arrays)


def _parse_body(body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    end = _LENGTH_BYTES + int.from_bytes(body[:_LENGTH_BYTES], "big")
    if end > len(body):
        raise ProtocolError("malformed site frame: its header is longer than the frame")
    try:
        header = json.loads(body[_LENGTH_BYTES:end])
    except ValueError as error:
        raise ProtocolError(f"malformed site frame header: {error}") from None
    if not isinstance(header, dict):
        raise ProtocolError("malformed site frame header: not an object")
    return header, unpack_arrays(body[end:])


def _tag(key: bytes, label: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(key, label + nonce + body, hashlib.sha256).digest()


def _receive_exactly(connection: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = connection.recv(min(left, 1 << 22))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send_frame(connection: socket.socket, body: bytes, tag: bytes) -> None:
    connection.sendall(len(body).to_bytes(_LENGTH_BYTES, "big") + body + tag)


def _receive_frame(connection: socket.socket) -> tuple[bytes, bytes]:
    length = int.from_bytes(_receive_exactly(connection, _LENGTH_BYTES), "big")
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"a site frame announces {length} bytes, more than allowed")
    body = _receive_exactly(connection, length)
    return body, _receive_exactly(connection, TAG_BYTES)


# -- the ClientApp's side ------------------------------------------------------------------------
def forward(
    folder: Path,
    *,
    run_id: int,
    run_config: Mapping[str, ConfigValue],
    envelope: Envelope,
    timeout: float | None = None,
) -> Envelope:
    """Send ``envelope`` (a request for run ``run_id``) to the site in ``folder``; its answer.

    Raises
    ------
    SiteError
        If the site's folder or key are not the user's alone, the site is not running, it closed
        the connection before answering (killed), or an answer fails authentication.
    SiteRefusal
        If the site's role refused the message (the role's error, by name).
    """
    paths = SitePaths(Path(folder))
    key = read_key(paths)
    if not paths.socket.exists():
        raise SiteError(
            f"no site process is listening in {paths.folder} (no {SOCKET_NAME}): start it with "
            f"`fedfm site --dir {paths.folder} ...`"
        )
    _owner_only(paths.socket, "site socket", folder=False)
    header = {
        "kind": "request",
        "run_id": int(run_id),
        "run_config": _typed(run_config),
        "message_type": envelope.message_type,
        "node_id": int(envelope.node_id),
        "round": int(envelope.round),
        "config": _typed(envelope.config),
    }
    body = _body(header, envelope.arrays)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout)
        try:
            connection.connect(str(paths.socket))
        except (ConnectionRefusedError, FileNotFoundError):
            raise SiteError(
                f"the site process in {paths.folder} is down (its socket refuses connections): "
                f"restart it with `fedfm site --dir {paths.folder} ...`"
            ) from None
        try:
            hello = _receive_exactly(connection, len(MAGIC) + NONCE_BYTES)
            if not hello.startswith(MAGIC):
                raise SiteError(f"{paths.socket} does not speak the site protocol")
            nonce = hello[len(MAGIC) :]
            _send_frame(connection, body, _tag(key, b"request", nonce, body))
            reply, tag = _receive_frame(connection)
        except (ConnectionError, TimeoutError, OSError) as error:
            raise SiteError(
                f"the site process in {paths.folder} did not answer {envelope.message_type} "
                f"(round {envelope.round}): {error}; it may have been killed"
            ) from None
    if not hmac.compare_digest(tag, _tag(key, b"reply", nonce, reply)):
        raise SiteError(f"the answer on {paths.socket} fails authentication with the site key")
    answer, arrays = _parse_body(reply)
    if not answer.get("ok"):
        raise SiteRefusal(str(answer.get("reason", "the site refused the message")))
    return Envelope(
        str(answer["message_type"]),
        envelope.node_id,
        int(answer["round"]),
        arrays,
        _untyped(answer.get("config", {})),
    )


# -- the site process ----------------------------------------------------------------------------
class Site(Generic[StateT]):
    """A data owner's site: one role per run, its state in memory and on disk.

    Parameters
    ----------
    folder:
        The site folder (created ``0700`` with a fresh key if missing).
    role_for_run:
        The node's role for a run, from the run's config (called once per run; the site's own
        node config, which carries its privacy decisions, is bound into it by the caller).
    state_type:
        The role's state; ``state_type()`` is a new run's state.
    opening:
        The message types that may open a run the site does not know (``None``: any).
    """

    def __init__(
        self,
        folder: Path,
        role_for_run: RunRole,
        state_type: type[StateT],
        *,
        opening: Iterable[str] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.paths = prepare_site_folder(folder)
        self._key = read_key(self.paths)
        self._role_for_run = role_for_run
        self._state_type = state_type
        self._opening = None if opening is None else frozenset(opening)
        self._roles: OrderedDict[int, NodeRole[Any]] = OrderedDict()
        self._states: dict[int, StateT] = {}
        self._log = log
        self.answered = 0
        self.ready = threading.Event()  # set once the socket accepts connections

    # -- state ---------------------------------------------------------------------------------
    def _load(self, run_id: int, message_type: str) -> StateT:
        if run_id in self._states:
            return self._states[run_id]
        path = self.paths.state(run_id)
        if path.exists():
            with np.load(path, allow_pickle=False) as stored:
                arrays = {name: stored[name] for name in stored.files if name != "__config__"}
                config = _untyped(json.loads(bytes(stored["__config__"]).decode()))
            state = self._state_type.from_records(arrays, config)
            self._log(f"[site] run {run_id}: state restored from {path}")
        elif self._opening is None or message_type in self._opening:
            state = self._state_type()
        else:
            raise ProtocolError(
                f"this site knows no run {run_id}: {message_type} needs the state an earlier "
                f"message of the run left, and {path} does not exist (was the site folder "
                "replaced, or the run started elsewhere?)"
            )
        self._states[run_id] = state
        return state

    def _save(self, run_id: int, state: StateT) -> None:
        arrays, config = state.to_records()
        config_bytes = np.frombuffer(json.dumps(_typed(config)).encode(), dtype=np.uint8)
        path = self.paths.state(run_id)
        partial = path.with_suffix(".partial")
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            stored: dict[str, Any] = {"__config__": config_bytes, **arrays}
            np.savez(out, **stored)
        os.replace(partial, path)  # a crash mid-write leaves the previous state intact
        self._states[run_id] = state

    # -- one message ---------------------------------------------------------------------------
    def answer(
        self, run_id: int, run_config: Mapping[str, ConfigValue], envelope: Envelope
    ) -> Envelope:
        """Answer one request of run ``run_id`` (what a connection carries), keeping the state.

        A refused request leaves the state as it was, except a :class:`ProtocolAbort`, whose
        state (the role leaving the run) is kept, as the ClientApp keeps it in ``context.state``.
        """
        state = self._load(run_id, envelope.message_type)
        role = self._roles.get(run_id)
        if role is None:
            role = self._roles[run_id] = self._role_for_run(run_config)
        self._roles.move_to_end(run_id)
        while len(self._roles) > RUNS_IN_MEMORY:  # the least recently served run leaves memory
            old, _ = self._roles.popitem(last=False)
            self._states.pop(old, None)
        try:
            reply, new_state = role.handle(envelope, state)
        except ProtocolAbort as error:
            self._save(run_id, cast(StateT, error.state))
            raise
        if new_state is not state:  # a refresh changes nothing: no write
            self._save(run_id, new_state)
        return reply

    def _serve_connection(self, connection: socket.socket) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        connection.settimeout(REQUEST_SECONDS)
        connection.sendall(MAGIC + nonce)
        body, tag = _receive_frame(connection)
        if not hmac.compare_digest(tag, _tag(self._key, b"request", nonce, body)):
            self._log("[site] refused a request that fails authentication with the site key")
            return
        header, arrays = _parse_body(body)
        if header.get("kind") != "request":
            raise ProtocolError("a site frame that is not a request")
        run_id = int(header["run_id"])
        request = Envelope(
            str(header["message_type"]),
            int(header["node_id"]),
            int(header["round"]),
            arrays,
            _untyped(header.get("config", {})),
        )
        started = time.perf_counter()
        try:
            reply = self.answer(run_id, _untyped(header.get("run_config", {})), request)
            answer: dict[str, Any] = {
                "ok": True,
                "message_type": reply.message_type,
                "round": reply.round,
                "config": _typed(reply.config),
            }
            reply_arrays = reply.arrays
        except FedfmError as error:
            reason = f"{type(error).__name__}: {error}"
            self._log(f"[site] run {run_id}: refused {request.message_type}: {reason}")
            answer, reply_arrays = {"ok": False, "reason": reason}, {}
        except Exception as error:  # a bug in the role must not end the long-lived site
            _LOG.exception("the role failed on %s of run %d", request.message_type, run_id)
            reason = f"internal error in the site's role: {type(error).__name__}: {error}"
            self._log(f"[site] run {run_id}: failed {request.message_type}: {reason}")
            answer, reply_arrays = {"ok": False, "reason": reason}, {}
        self.answered += 1
        self._log(
            f"[site] run {run_id}: answered {request.message_type} (round {request.round}) in "
            f"{time.perf_counter() - started:.2f} s"
        )
        reply_body = _body(answer, reply_arrays)
        connection.settimeout(None)
        _send_frame(connection, reply_body, _tag(self._key, b"reply", nonce, reply_body))

    def _bind(self) -> socket.socket:
        path = self.paths.socket
        if path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # a socket left by a site that died
            else:
                raise SiteError(f"another site process is already serving {path}")
            finally:
                probe.close()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600: no window with a looser mode
        try:
            server.bind(str(path))
        finally:
            os.umask(old)
        server.listen(8)
        return server

    def serve(self, *, stop: Callable[[], bool] = lambda: False, poll: float = 0.5) -> None:
        """Answer connections one after another until ``stop()`` (checked every ``poll`` s)."""
        server = self._bind()
        server.settimeout(poll)
        self.ready.set()
        self._log(f"[site] serving {self.paths.socket}")
        try:
            while not stop():
                try:
                    connection, _ = server.accept()
                except TimeoutError:
                    continue
                with connection:
                    try:
                        self._serve_connection(connection)
                    except (OSError, ProtocolError) as error:
                        # a ClientApp that died or sent garbage: the next message is served
                        self._log(f"[site] dropped a connection: {error}")
        finally:
            self.ready.clear()
            server.close()
            self.paths.socket.unlink(missing_ok=True)
