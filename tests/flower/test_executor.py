"""The warm ClientApp executor (``fedfm executor``) against a SuperNode's Runtime API.

A round through it runs in ``tests/flower/test_deployment.py``; here: what it refuses and how it
serves a live SuperNode that has no task for it (no SuperLink needed).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedfm.cli import main
from fedfm.errors import ConfigError
from fedfm.flower.executor import ClientAppExecutor, ExecutorError

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_executor_without_a_supernode_names_the_address_and_how_to_start_one() -> None:
    port = free_port()
    executor = ClientAppExecutor(f"127.0.0.1:{port}", log=lambda _line: None)
    with pytest.raises(ExecutorError, match=rf"127\.0\.0\.1:{port}.*--isolation process"):
        executor.serve(max_tasks=1)
    assert list(executor.outcomes) == [] and executor.tasks_run == 0


def test_an_executor_refuses_a_bad_poll_interval_or_a_missing_certificate(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="poll interval"):
        ClientAppExecutor("127.0.0.1:1", poll_interval=0.0)
    with pytest.raises(ConfigError, match="is not a file"):
        ClientAppExecutor("127.0.0.1:1", root_certificates=tmp_path / "missing.pem")


def test_the_executor_command_refuses_an_unreachable_supernode_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["executor", "--runtime-api-address", f"127.0.0.1:{free_port()}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no SuperNode Runtime API answers" in lines[0]


def test_an_executor_refuses_a_secret_others_can_read(tmp_path: Path) -> None:
    secret = tmp_path / "superexec.secret"
    secret.write_bytes(b"")
    secret.chmod(0o600)
    with pytest.raises(ConfigError, match="is empty"):
        ClientAppExecutor("127.0.0.1:1", auth_secret_file=secret)
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        ClientAppExecutor("127.0.0.1:1", auth_secret_file=secret)
    with pytest.raises(ConfigError, match="cannot read"):
        ClientAppExecutor("127.0.0.1:1", auth_secret_file=tmp_path / "missing")


def test_an_executor_serves_a_live_supernodes_runtime_api_only_with_its_secret(
    tmp_path: Path,
) -> None:
    """A SuperNode with ``--isolation process`` and a SuperExec auth secret (its SuperLink
    unreachable: no task comes) refuses an executor without the secret, answers one with it;
    that executor keeps polling, runs nothing and stops when told."""
    port = free_port()
    secret = tmp_path / "superexec.secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    supernode = subprocess.Popen(
        [
            str(BIN / "flower-supernode"),
            "--insecure",
            "--superlink",
            f"127.0.0.1:{free_port()}",
            "--isolation",
            "process",
            "--port",
            str(port),
            "--superexec-auth-secret-file",
            str(secret),
        ],
        env={**os.environ, "FLWR_HOME": str(tmp_path / "home"), "FLWR_TELEMETRY_ENABLED": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        executor = ClientAppExecutor(
            f"127.0.0.1:{port}", auth_secret_file=secret, poll_interval=0.01, log=lines.append
        )
        deadline = time.monotonic() + 60
        while True:  # the SuperNode's Runtime API takes a few seconds to listen
            try:
                assert executor.acquire() is None
                break
            except ExecutorError as error:
                assert "no SuperNode Runtime API answers" in str(error), error
                assert time.monotonic() < deadline, "the SuperNode's Runtime API never answered"
                time.sleep(0.2)
        stranger = ClientAppExecutor(f"127.0.0.1:{port}", log=lambda _line: None)
        with pytest.raises(ExecutorError, match="refused this executor"):
            stranger.acquire()
        polls = 0

        def stop() -> bool:
            nonlocal polls
            polls += 1
            return polls > 20

        executor.serve(stop)
        executor.close()
    finally:
        supernode.terminate()
        supernode.wait(30)
    assert lines == [f"[executor] serving the SuperNode at 127.0.0.1:{port}"]
    assert list(executor.outcomes) == [] and executor.tasks_run == 0


def test_a_task_whose_clientapp_raises_or_whose_reply_is_lost_fails_and_the_executor_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Runtime API calls are replaced by recorders; the task's ClientApp raises: the reply
    pushed is Flower's error reply to the task's message, the task's status is failed, and the
    next task (whose ClientApp answers) completes."""
    from types import SimpleNamespace

    from flwr.app import Context, Message, RecordDict
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.task_identity import TaskIdentity

    from fedfm.flower import executor as module

    def task_input(_client: object) -> tuple[Message, Context, object, object]:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 9, 4, 5
        message = Message(RecordDict(), dst_node_id=5, message_type="train.block")
        message.metadata.__dict__["_message_id"] = "m-1"
        context = Context(run_id=4, node_id=5, node_config={}, state=RecordDict(), run_config={})
        run = SimpleNamespace(run_id=4, fab_id="fedfm/app", fab_version="0.1")
        return message, context, run, SimpleNamespace(hash_str="h", content=b"")

    answers = iter([RuntimeError("the role refused"), None, None])

    def app(message: Message, context: Context) -> Message:
        if (error := next(answers)) is not None:
            raise error
        return Message(RecordDict(), reply_to=message)

    pushed: list[Message] = []
    statuses: list[tuple[str, str]] = []
    monkeypatch.setattr(module, "_pull_task_input", task_input)
    monkeypatch.setattr(ClientAppExecutor, "_client_app", lambda *_args: app)

    def push(_client: object, reply: Message, _context: Context) -> None:
        if len(pushed) == 2:
            raise ConnectionError("the SuperNode went away")
        pushed.append(reply)

    monkeypatch.setattr(module, "push_message", push)
    monkeypatch.setattr(
        module,
        "push_task_output",
        lambda **kwargs: statuses.append((kwargs["sub_status"], kwargs["details"])),
    )
    lines: list[str] = []
    executor = ClientAppExecutor(f"127.0.0.1:{free_port()}", log=lines.append)
    failed = executor.run_task("token-1")
    answered = executor.run_task("token-2")
    lost = executor.run_task("token-3")  # its reply cannot be pushed: logged, the executor goes on

    assert not failed.completed and "the role refused" in failed.details
    assert answered.completed and answered.details == ""
    assert (failed.task_id, failed.run_id, failed.message_type) == (9, 4, "train.block")
    error_reply, reply = pushed
    assert (
        error_reply.has_error() and error_reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    )
    assert error_reply.metadata.reply_to_message_id == "m-1"
    assert not reply.has_error()
    assert not lost.completed and "the SuperNode went away" in lost.details
    assert [status for status, _ in statuses] == [
        SubStatus.FAILED,
        SubStatus.COMPLETED,
        SubStatus.FAILED,
    ]
    assert executor.tasks_run == 3
    assert any("task failed" in line and "the role refused" in line for line in lines)
