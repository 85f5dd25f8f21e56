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
    assert executor.outcomes == []


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


def test_an_executor_serves_a_live_supernodes_runtime_api_until_told_to_stop(
    tmp_path: Path,
) -> None:
    """A SuperNode with ``--isolation process`` (its SuperLink unreachable: no task comes)
    answers the executor's polls; the executor keeps polling, runs nothing, stops when told."""
    port = free_port()
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
        ],
        env={**os.environ, "FLWR_HOME": str(tmp_path / "home"), "FLWR_TELEMETRY_ENABLED": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        executor = ClientAppExecutor(f"127.0.0.1:{port}", poll_interval=0.01, log=lines.append)
        deadline = time.monotonic() + 60
        while True:  # the SuperNode's Runtime API takes a few seconds to listen
            try:
                assert executor.acquire() is None
                break
            except ExecutorError:
                assert time.monotonic() < deadline, "the SuperNode's Runtime API never answered"
                time.sleep(0.2)
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
    assert executor.outcomes == []
