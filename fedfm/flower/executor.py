"""A warm ClientApp executor: one long-lived process runs a SuperNode's ClientApp tasks.

On Flower's Deployment Engine a SuperNode started with ``--isolation subprocess`` (the default)
launches ``flower-superexec``, which polls the SuperNode's Runtime API every second and starts a
fresh ``flwr-clientapp`` process per message: that process imports Flower (about 3 s of CPU on
the 2-core development machine), installs the run's FAB and imports the ClientApp before it
answers, and three sites on two cores pay it three times per round trip.

With ``flower-supernode --isolation process`` Flower expects the operator to run that executor
side. :class:`ClientAppExecutor` is that side, kept warm: it imports Flower once, polls the
SuperNode's Runtime API for ClientApp tasks every ``poll_interval`` seconds (0.05 s by default),
installs and loads each FAB's ClientApp once (cached by FAB hash) and runs every task in this
process through the same Runtime API calls as ``flwr-clientapp`` (pull the message and context,
call the ClientApp, push the reply, then the task's status and context). A task whose ClientApp
raises gets Flower's error reply and a failed status; the executor goes on with the next task.

What runs here is the run's ClientApp code, as in a ``flwr-clientapp`` process: it holds no key
of the data owner. With a site process (``fedfm site``) the ClientApp only forwards each message
to it, so keys and data stay in that process, never in this one.

The Runtime API calls come from Flower 1.41's own client (``flwr.supercore.runtime``) and
``flwr.supernode.runtime.run_clientapp``'s pull and push helpers: pinned with ``flwr==1.41.0``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from flwr.app import Context, Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import ClientApp, LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    AcquireTaskRequest,  # pylint: disable=E0611
    PullAppMessagesRequest,
    PullTaskInputRequest,
)
from flwr.supercore.constant import TaskType
from flwr.supercore.fab import Fab
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
)
from flwr.supercore.run import Run
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

from fedfm.errors import ConfigError, FedfmError

DEFAULT_POLL_INTERVAL = 0.05  # seconds between AcquireTask calls while idle
OUTCOMES_KEPT = 1000  # a long-lived executor keeps only its latest tasks' outcomes
# A task is handed out as soon as the SuperNode creates it, before the SuperNode has fetched the
# message's objects from the SuperLink: Flower's pull then waits 1 s before its first retry
# (PULL_INITIAL_BACKOFF), about a second per message on localhost. Retry sooner.
OBJECT_PULL_BACKOFF = 0.02
OBJECT_PULL_BACKOFF_CAP = 0.5
# The Runtime API call a SuperNode with --superexec-auth-secret-file accepts only when signed with
# that secret (the one flower-superexec signs).
_SIGNED_METHODS = frozenset({"/flwr.proto.Runtime/AcquireTask"})


class ExecutorError(FedfmError):
    """The executor cannot reach or use its SuperNode's Runtime API."""


@dataclass(frozen=True)
class TaskOutcome:
    """One ClientApp task this executor ran."""

    task_id: int
    run_id: int
    message_type: str
    seconds: float
    completed: bool
    details: str = ""


class ClientAppExecutor:
    """Run a SuperNode's ClientApp tasks in this long-lived process.

    Parameters
    ----------
    runtime_api_address:
        ``host:port`` of the SuperNode's Runtime API (``flower-supernode --port``).
    root_certificates:
        The CA of the Runtime API's TLS certificate (``flower-supernode --ssl-certfile``);
        ``None`` talks plain HTTP, as ``flower-superexec --insecure`` does on one host.
    auth_secret_file:
        The secret of ``flower-supernode --superexec-auth-secret-file``: the SuperNode then hands
        tasks only to a process holding it, not to any local process that reaches the port. It
        must be the operator's alone (no group or other permission bits).
    poll_interval:
        Seconds between two AcquireTask calls while no task waits.
    log:
        Called with one line per task and per notable event.
    """

    def __init__(
        self,
        runtime_api_address: str,
        *,
        root_certificates: Path | None = None,
        auth_secret_file: Path | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        log: Callable[[str], None] = print,
    ) -> None:
        if not 0.0 < poll_interval <= 10.0:
            raise ConfigError(f"poll interval must be in (0, 10] seconds, got {poll_interval}")
        if root_certificates is not None and not root_certificates.is_file():
            raise ConfigError(f"root certificates {root_certificates} is not a file")
        self.address = runtime_api_address
        self.poll_interval = poll_interval
        self._insecure = root_certificates is None
        self._certificates = (
            root_certificates.read_bytes() if root_certificates is not None else None
        )
        self._log = log
        self._apps: dict[str, ClientApp] = {}
        self.tasks_run = 0
        self.outcomes: deque[TaskOutcome] = deque(maxlen=OUTCOMES_KEPT)  # the latest tasks
        acquiring: list[Any] = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if auth_secret_file is not None:
            acquiring.append(
                SuperExecAuthHttpInterceptor(
                    master_secret=_read_secret(auth_secret_file), protected_methods=_SIGNED_METHODS
                )
            )
        self._acquirer = self._client(*acquiring)

    def _client(self, *interceptors: Any) -> RuntimeHttpClient:
        # No retry invoker: a refused or unreachable Runtime API surfaces here at once.
        return RuntimeHttpClient.from_server_address(
            server_address=self.address,
            insecure=self._insecure,
            root_certificates=self._certificates,
            interceptors=list(interceptors),
        )

    # -- tasks -----------------------------------------------------------------------------------

    def acquire(self) -> str | None:
        """The token of the next ClientApp task waiting at the SuperNode, or ``None``."""
        try:
            response = self._acquirer.AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
            )
        except httpx.TransportError as error:
            raise ExecutorError(
                f"no SuperNode Runtime API answers at {self.address} ({error}); start "
                "`flower-supernode --isolation process --port <port>` and pass "
                "--runtime-api-address 127.0.0.1:<port>"
            ) from error
        except httpx.HTTPStatusError as error:
            raise ExecutorError(
                f"the SuperNode at {self.address} refused this executor "
                f"(HTTP {error.response.status_code}: {error.response.text[:200]})"
            ) from error
        if response.HasField("task") and response.token:
            return str(response.token)
        return None

    def _client_app(
        self, fab_id: str, fab_version: str, fab_hash: str, content: bytes
    ) -> ClientApp:
        """The FAB's ClientApp, installed and imported once per FAB hash."""
        if fab_hash not in self._apps:
            install_from_fab(content, skip_prompt=True)
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self._apps[fab_hash] = load(fab_id, fab_version, fab_hash)
            self._log(f"[executor] loaded the ClientApp of {fab_id} {fab_version}")
        return self._apps[fab_hash]

    def run_task(self, token: str) -> TaskOutcome:
        """Run the task ``token`` names, as one ``flwr-clientapp`` process would."""
        started = time.perf_counter()
        client = self._client(
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
            RuntimeTokenHttpInterceptor(token),
        )
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        message: Message | None = None
        context: Context | None = None
        reply: Message | None = None
        task_id = run_id = 0
        status, details = SubStatus.FAILED, "ClientApp task failed"
        phases: dict[str, float] = {}
        try:
            heartbeat.start()
            message, context, run, fab = _pull_task_input(client)
            phases["pull"] = time.perf_counter() - started
            task_id, run_id = int(TaskIdentity.task_id), run.run_id
            app = self._client_app(run.fab_id, run.fab_version, fab.hash_str, fab.content)
            reply = app(message=message, context=context)
            phases["app"] = time.perf_counter() - started - phases["pull"]
            status, details = SubStatus.COMPLETED, ""
        except Exception as error:  # a failing task gets Flower's error reply, as in flwr-clientapp
            code = (
                ErrorCode.LOAD_CLIENT_APP_EXCEPTION
                if isinstance(error, LoadClientAppError)
                else ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            )
            details = f"{type(error)}:<'{error}'>"
            self._log(f"[executor] task failed: {details}")
            if message is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:
            try:
                mark = time.perf_counter()
                try:
                    if reply is not None and context is not None:
                        push_message(client, reply, context)
                except Exception as error:  # the SuperNode or the run went away: next task
                    status, details = SubStatus.FAILED, f"pushing the reply failed: {error}"
                    self._log(f"[executor] {details}")
                phases["push"] = time.perf_counter() - mark
                mark = time.perf_counter()
                push_task_output(client=client, context=context, sub_status=status, details=details)
                phases["output"] = time.perf_counter() - mark
            finally:
                mark = time.perf_counter()
                if heartbeat.is_running:
                    heartbeat.stop()
                client.close()
                phases["close"] = time.perf_counter() - mark
        outcome = TaskOutcome(
            task_id=task_id,
            run_id=run_id,
            message_type=message.metadata.message_type if message is not None else "",
            seconds=time.perf_counter() - started,
            completed=status == SubStatus.COMPLETED,
            details=details,
        )
        self.outcomes.append(outcome)
        self.tasks_run += 1
        self._log(
            f"[executor] run {outcome.run_id}: {outcome.message_type or '?'} "
            f"{'answered' if outcome.completed else 'failed'} in {outcome.seconds:.3f} s "
            f"({', '.join(f'{name} {value:.3f}' for name, value in phases.items())})"
        )
        return outcome

    def serve(
        self, stop: Callable[[], bool] = lambda: False, *, max_tasks: int | None = None
    ) -> None:
        """Run tasks until ``stop()`` is true (checked between tasks and polls) or ``max_tasks``
        ran. An unreachable SuperNode at the first poll raises :class:`ExecutorError`; later it
        is retried every second (a restarted SuperNode is picked up again)."""
        ran = 0
        first = True
        while not stop() and (max_tasks is None or ran < max_tasks):
            try:
                token = self.acquire()
            except ExecutorError as error:
                if first:
                    raise
                self._log(f"[executor] {error}; retrying")
                time.sleep(1.0)
                continue
            if first:
                self._log(f"[executor] serving the SuperNode at {self.address}")
                first = False
            if token is None:
                time.sleep(self.poll_interval)
                continue
            self.run_task(token)
            ran += 1

    def close(self) -> None:
        """Close the Runtime API connection."""
        self._acquirer.close()


def _read_secret(path: Path) -> bytes:
    """The SuperExec auth secret in ``path``, refused if missing, empty or readable by others."""
    try:
        mode = path.stat().st_mode & 0o777
        secret = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read the SuperExec auth secret {path}: {error}") from error
    if mode & 0o077:
        raise ConfigError(
            f"the SuperExec auth secret {path} has mode {mode:o}: group or others can read it "
            f"(chmod 600 {path})"
        )
    if not secret:
        raise ConfigError(f"the SuperExec auth secret {path} is empty")
    return secret


def _pull_task_input(client: RuntimeHttpClient) -> tuple[Message, Context, Run, Fab]:
    """The task's message, context, run and FAB, as ``flwr-clientapp`` pulls them
    (``flwr.supernode.runtime.run_clientapp.pull_task_input``), with a short first retry."""
    task_input = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = task_input.task_id
    TaskIdentity.run_id = task_input.run.run_id
    TaskIdentity.node_id = task_input.context.node_id
    context = context_from_proto(task_input.context)
    run = run_from_proto(task_input.run)
    fab = fab_from_proto(task_input.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise ExecutorError(f"task {task_input.task_id} came with no message")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(
            client.ConfirmMessageReceived, node, context.run_id
        ),
        return_type=Message,
        max_tries_per_object=None,
        initial_backoff=OBJECT_PULL_BACKOFF,
        backoff_cap=OBJECT_PULL_BACKOFF_CAP,
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # not part of the deflated message
    return message, context, run, fab
