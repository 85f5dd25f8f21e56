"""A fedfm federation on one machine: a SuperLink and SuperNodes as separate processes.

Each process is what one site of a real deployment runs (``docs/deployment.md``): the server
runs ``flower-superlink`` with TLS and SuperNode authentication on, every data owner runs
``flower-supernode`` with the CA certificate, its own private key and its own node config, and
the operator drives runs with the ``flwr`` CLI (``flwr supernode register``, ``flwr run``,
``flwr ls``, ``flwr log``). Here they all run on 127.0.0.1 with free ports, each process with its
own ``FLWR_HOME`` and working folder under one workspace, as if on separate machines.

:class:`LocalFederation` starts and watches these processes and stops them all again: every
process starts in a session (process group) of its own, and :meth:`LocalFederation.close` ends
the groups, then any process that inherited this federation's ``FEDFM_DEPLOYMENT`` environment
marker (Flower starts its SuperExec in a session of its own). ``rehearse.py`` and
``tests/flower/test_deployment.py`` build on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from certificates import Credentials

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "simulations" / "double_blind"
BIN = Path(sys.executable).parent
CONNECTION = "fedfm-deploy"
MARKER = "FEDFM_DEPLOYMENT"
FINISHED = "finished"
COMPLETED = "finished:completed"

RunValue = int | float | str | bool


class DeploymentError(RuntimeError):
    """A process of the local federation did not start, answer or finish as expected."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def toml_value(value: RunValue) -> str:
    """``value`` as a TOML scalar for ``flwr run --run-config``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # a TOML basic string


def run_config_overrides(config: Mapping[str, RunValue]) -> str:
    """``{"rounds": 1, "backend": "simulate"}`` as ``rounds=1 backend="simulate"``."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in config.items())


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class SuperNode:
    """One ``flower-supernode`` process: one site with its partition of the data."""

    index: int
    process: subprocess.Popen[bytes]
    log_path: Path
    command: list[str]
    runtime_port: int

    def log(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(errors="replace")


@dataclass
class _LoggedProcess:
    """A process this federation started, with the log it writes."""

    index: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        """Everything the process wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Executor(_LoggedProcess):
    """One warm ClientApp executor (``fedfm executor``) beside a SuperNode started with
    ``--isolation process``."""


@dataclass
class Site(_LoggedProcess):
    """One data owner's site process (``fedfm site``): its role, keys and data in memory."""

    folder: Path


class LocalFederation:
    """A SuperLink, its SuperNodes and the operator's ``flwr`` CLI, all on 127.0.0.1.

    Parameters
    ----------
    workspace:
        An empty folder for the processes' ``FLWR_HOME`` folders, working folders and logs.
    credentials:
        The CA, the SuperLink's certificate and key, the SuperNodes' keys
        (``certificates.make_credentials``).
    echo:
        Called with each command line (shell-quoted) before it runs; the rehearsal prints them.
    environment:
        Extra environment variables for every process.
    """

    def __init__(
        self,
        workspace: Path,
        credentials: Credentials,
        *,
        echo: Callable[[str], None] | None = None,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        self.workspace = workspace.resolve()
        self.credentials = credentials
        self.port: int | None = None
        self.superlink: subprocess.Popen[bytes] | None = None
        self.supernodes: dict[int, SuperNode] = {}
        self.sites: dict[int, Site] = {}
        self.executors: dict[int, Executor] = {}
        self.node_ids: list[int] = []
        self.marker = f"{MARKER}={uuid.uuid4().hex}"
        self._echo = echo or (lambda _line: None)
        self._extra = dict(environment or {})
        self.operator_home = self._folder("operator")

    # -- processes ------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The SuperLink's ``host:port`` (Fleet, Control and Runtime APIs share it)."""
        if self.port is None:
            raise DeploymentError("the SuperLink has not been started")
        return f"127.0.0.1:{self.port}"

    def _folder(self, name: str) -> Path:
        folder = self.workspace / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def environment(self, home: Path) -> dict[str, str]:
        """The environment of a process whose ``FLWR_HOME`` is ``home``."""
        env = dict(os.environ)
        key, value = self.marker.split("=", 1)
        env.update(
            {
                "FLWR_HOME": str(home),
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
                # the apps import the fedfm of this environment; no `uv sync` of the app
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                "FLWR_TELEMETRY_ENABLED": "0",
                "FLWR_DISABLE_UPDATE_CHECK": "1",
                "PYTHONUNBUFFERED": "1",
                key: value,
            }
        )
        env.update(self._extra)
        return env

    def _spawn(self, command: list[str], name: str) -> tuple[subprocess.Popen[bytes], Path]:
        """Start ``command`` in a session of its own, in ``workspace/name``, logging there."""
        folder = self._folder(name)
        log_path = folder / "process.log"
        self._echo(shlex.join(command))
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                command,
                cwd=folder,
                env=self.environment(folder / "flwr-home"),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_terminate_with_parent if sys.platform == "linux" else None,
            )
        return process, log_path

    def start_superlink(self, *, seconds: float = 60.0) -> None:
        """Start ``flower-superlink`` with TLS and SuperNode authentication; wait until healthy."""
        if self.superlink is not None:
            raise DeploymentError("the SuperLink is already running")
        self.port = free_port()
        creds = self.credentials
        command = [
            str(BIN / "flower-superlink"),
            "--ssl-ca-certfile",
            str(creds.ca_cert),
            "--ssl-certfile",
            str(creds.server_cert),
            "--ssl-keyfile",
            str(creds.server_key),
            "--enable-supernode-auth",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.superlink, log_path = self._spawn(command, "superlink")
        self._write_cli_config()
        context = ssl.create_default_context(cafile=str(creds.ca_cert))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.superlink.poll() is not None:
                raise DeploymentError(
                    f"flower-superlink exited with status {self.superlink.returncode}:\n"
                    f"{_tail(log_path)}"
                )
            try:
                url = f"https://{self.address}/health"
                with urllib.request.urlopen(url, timeout=2, context=context):
                    return
            except OSError:
                time.sleep(0.2)
        raise DeploymentError(
            f"flower-superlink did not answer on {self.address} within {seconds:.0f} s:\n"
            f"{_tail(log_path)}"
        )

    def _write_cli_config(self) -> None:
        """The operator's ``$FLWR_HOME/config.toml``: one TLS connection to the SuperLink."""
        text = (
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f"[superlink.{CONNECTION}]\n"
            f'address = "{self.address}"\n'
            f"root-certificates = {json.dumps(str(self.credentials.ca_cert))}\n"
        )
        (self.operator_home / "config.toml").write_text(text)

    def start_supernode(
        self,
        index: int,
        *,
        num_partitions: int,
        private_key: Path | None,
        root_certificates: Path | None,
        insecure: bool = False,
        node_config: Mapping[str, RunValue] | None = None,
        extra_args: Sequence[str] = (),
    ) -> SuperNode:
        """Start ``flower-supernode`` number ``index`` holding partition ``index``.

        ``private_key=None`` starts it without authentication, ``root_certificates=None``
        without the CA (it then trusts the system's CAs), ``insecure=True`` without TLS: the
        tests use these to check that the SuperLink refuses such nodes. ``extra_args`` go to
        ``flower-supernode`` as they are (e.g. ``--max-retries 2``).
        """
        config = {"partition-id": index, "num-partitions": num_partitions, **(node_config or {})}
        runtime_port = free_port()
        command = [
            str(BIN / "flower-supernode"),
            "--superlink",
            self.address,
            "--port",
            str(runtime_port),  # the SuperNode's own Runtime API, for its ClientApp processes
            "--node-config",
            run_config_overrides(config),
        ]
        if insecure:
            command.append("--insecure")
        if root_certificates is not None:
            command += ["--root-certificates", str(root_certificates)]
        if private_key is not None:
            command += ["--auth-supernode-private-key", str(private_key)]
        command += list(extra_args)
        process, log_path = self._spawn(command, f"supernode-{index}")
        node = SuperNode(index, process, log_path, command, runtime_port)
        self.supernodes[index] = node
        return node

    def start_executor(self, node: SuperNode, *, seconds: float = 120.0) -> Executor:
        """Start a warm ClientApp executor (``fedfm executor``) for ``node``, a SuperNode started
        with ``--isolation process``; returns once it serves the node's Runtime API."""
        command = [
            str(BIN / "fedfm"),
            "executor",
            "--runtime-api-address",
            f"127.0.0.1:{node.runtime_port}",
        ]
        process, log_path = self._spawn(command, f"executor-{node.index}")
        started = Executor(node.index, process, log_path)
        self.executors[node.index] = started
        deadline = time.monotonic() + seconds
        while "[executor] serving" not in started.log():
            if process.poll() is not None:
                if time.monotonic() > deadline:
                    raise DeploymentError(f"executor {node.index} exited:\n{_tail(log_path)}")
                # the SuperNode's Runtime API may not listen yet: start the executor again
                time.sleep(0.5)
                process, log_path = self._spawn(command, f"executor-{node.index}")
                started = Executor(node.index, process, log_path)
                self.executors[node.index] = started
                continue
            if time.monotonic() > deadline:
                raise DeploymentError(f"executor {node.index} did not start:\n{_tail(log_path)}")
            time.sleep(0.2)
        return started

    def data_owner_configs(self, count: int) -> list[dict[str, RunValue]]:
        """Each site's SecAgg identity (made in its own folder) and pins of the other sites.

        What the data owners of a deployment set up among themselves, out of band: node config
        ``identity-key`` and ``secagg-pins`` (see ``docs/deployment.md``).
        """
        from fedfm.runtime import create_identity_file, format_pins

        keys = [self._folder(f"supernode-{index}") / "identity.key" for index in range(count)]
        if existing := [str(key) for key in keys if key.exists()]:
            raise DeploymentError(f"identity keys exist already ({existing}): a fresh workspace")
        fingerprints = {
            f"site-{index}": create_identity_file(key) for index, key in enumerate(keys)
        }
        return [
            {
                "identity-key": str(key),
                "secagg-pins": format_pins(
                    {name: pin for name, pin in fingerprints.items() if name != f"site-{index}"}
                ),
            }
            for index, key in enumerate(keys)
        ]

    def start_site(
        self, index: int, node_config: Mapping[str, RunValue], *, seconds: float = 120.0
    ) -> Site:
        """Start data owner ``index``'s site process (``fedfm site``) with its own node config.

        Its folder is a fresh ``0700`` one under the system's temporary folder (a Unix socket's
        path must stay under 108 bytes); the SuperNode then needs only ``site-dir``.
        """
        folder = Path(tempfile.mkdtemp(prefix=f"fedfm-site-{index}-")) / "site"
        command = [
            str(BIN / "fedfm"),
            "site",
            "--dir",
            str(folder),
            "--node-config",
            run_config_overrides(node_config),
        ]
        process, log_path = self._spawn(command, f"site-{index}")
        started = Site(index, process, log_path, folder)
        self.sites[index] = started
        deadline = time.monotonic() + seconds
        while "[site] serving" not in started.log():
            if process.poll() is not None:
                raise DeploymentError(f"site {index} exited:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise DeploymentError(f"site {index} did not start:\n{_tail(log_path)}")
            time.sleep(0.2)
        return started

    def start_supernodes(
        self,
        count: int,
        *,
        node_config: Mapping[str, RunValue] | None = None,
        sites: bool = False,
        executors: bool = False,
    ) -> list[SuperNode]:
        """Start SuperNodes ``0 .. count-1`` with the CA, their registered keys and their SecAgg
        identities and pins (:meth:`data_owner_configs`); each site's own ``node_config`` (e.g.
        its privacy policy) joins them on ``--node-config``.

        ``sites=True``: each data owner's settings go to a long-lived site process instead
        (:meth:`start_site`), and its SuperNode's ClientApp forwards every message there.
        ``executors=True``: each SuperNode runs with ``--isolation process`` and a warm ClientApp
        executor (:meth:`start_executor`) instead of a fresh ClientApp process per message.
        """
        owners = [{**site, **(node_config or {})} for site in self.data_owner_configs(count)]
        nodes = []
        for index in range(count):
            own: Mapping[str, RunValue] = owners[index]
            if sites:
                full = {"partition-id": index, "num-partitions": count, **own}
                own = {"site-dir": str(self.start_site(index, full).folder)}
            nodes.append(
                self.start_supernode(
                    index,
                    num_partitions=count,
                    private_key=self.credentials.node_keys[index],
                    root_certificates=self.credentials.ca_cert,
                    node_config=own,
                    extra_args=("--isolation", "process") if executors else (),
                )
            )
        if executors:
            for node in nodes:
                self.start_executor(node)
        return nodes

    def kill(self, node: SuperNode, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to the SuperNode's whole process group (with its ClientApp processes)."""
        _signal_group(node.process, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                node.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(node.process, signal.SIGKILL)
                node.process.wait()

    # -- the operator's CLI ---------------------------------------------------------------------

    def flwr(
        self, *args: str, timeout: float | None = 120.0, check: bool = True, capture: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``flwr ARGS`` as the operator (its ``FLWR_HOME`` holds the connection).

        ``capture=False`` lets the output through to this process's terminal.
        """
        command = [str(BIN / "flwr"), *args]
        self._echo(shlex.join(command))
        result = subprocess.run(
            command,
            cwd=ROOT,
            env=self.environment(self.operator_home),
            capture_output=capture,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise DeploymentError(
                f"{shlex.join(command)} exited with {result.returncode}:\n"
                f"{(result.stdout or '')[-2000:]}{(result.stderr or '')[-2000:]}"
            )
        return result

    def _json(self, *args: str) -> dict:
        result = self.flwr(*args, "--format", "json")
        try:
            return json.loads(result.stdout)
        except ValueError as error:
            raise DeploymentError(
                f"flwr {' '.join(args)} printed no JSON: {result.stdout}"
            ) from error

    def register(self, public_key: Path) -> int:
        """``flwr supernode register``: allow the SuperNode holding this key; its node id."""
        answer = self._json("supernode", "register", str(public_key), CONNECTION)
        if not answer.get("success"):
            raise DeploymentError(f"registering {public_key} failed: {answer}")
        return int(answer["node-id"])

    def register_all(self, count: int) -> list[int]:
        """Register the public keys of SuperNodes ``0 .. count-1``; their node ids, in order.

        The ids are kept in :attr:`node_ids` (SuperNode ``k`` gets ``node_ids[k]``).
        """
        self.node_ids = [self.register(key) for key in self.credentials.node_public_keys[:count]]
        return self.node_ids

    def nodes(self) -> dict[int, str]:
        """``flwr supernode ls``: every registered node id and its status."""
        answer = self._json("supernode", "ls", CONNECTION)
        return {int(node["node-id"]): str(node["status"]) for node in answer.get("nodes", [])}

    def wait_for_nodes(self, count: int, *, seconds: float = 60.0) -> list[int]:
        """The ids of the online nodes once ``count`` are online."""
        deadline = time.monotonic() + seconds
        while True:
            online = sorted(node for node, status in self.nodes().items() if status == "online")
            if len(online) >= count:
                return online
            for node in self.supernodes.values():
                if node.process.poll() is not None:
                    raise DeploymentError(
                        f"SuperNode {node.index} exited with status {node.process.returncode}:\n"
                        f"{_tail(node.log_path)}"
                    )
            if time.monotonic() >= deadline:
                raise DeploymentError(
                    f"{len(online)} of {count} SuperNodes online after {seconds:.0f} s"
                )
            time.sleep(1.0)

    def submit(self, run_config: Mapping[str, RunValue], app: Path = APP) -> int:
        """``flwr run APP`` with these run config overrides; the new run's id."""
        args = ["run", str(app), CONNECTION]
        if run_config:
            args += ["--run-config", run_config_overrides(run_config)]
        answer = self._json(*args)
        if not answer.get("success"):
            raise DeploymentError(f"flwr run failed: {answer}")
        return int(answer["run-id"])

    def run_info(self, run_id: int) -> dict:
        """``flwr ls --run-id``: the run's row (status, elapsed time, traffic, ...)."""
        runs = self._json("ls", CONNECTION, "--run-id", str(run_id)).get("runs", [])
        if not runs:
            raise DeploymentError(f"the SuperLink knows no run {run_id}")
        return runs[0]

    def wait_for_run(self, run_id: int, *, seconds: float, poll: float = 2.0) -> str:
        """The run's final status (``finished:completed``, ``finished:failed``, ...).

        Raises
        ------
        DeploymentError
            If the run has not finished within ``seconds``.
        """
        deadline = time.monotonic() + seconds
        while True:
            status = str(self.run_info(run_id)["status"])
            if status.startswith(FINISHED):
                return status
            if time.monotonic() >= deadline:
                raise DeploymentError(
                    f"run {run_id} is still {status!r} after {seconds:.0f} s:\n"
                    f"{self.run_log(run_id)[-3000:]}"
                )
            time.sleep(poll)

    def run_log(self, run_id: int, *, timeout: float = 60.0) -> str:
        """``flwr log RUN_ID``: the ServerApp's log of a run (all of it, once it has finished)."""
        result = self.flwr("log", str(run_id), CONNECTION, "--stream", timeout=timeout, check=False)
        return result.stdout + result.stderr

    # -- shutting down --------------------------------------------------------------------------

    def _marked(self) -> dict[int, str]:
        """Live processes carrying this federation's marker, with their command lines (Linux)."""
        found = {}
        marker = f"{self.marker}\0".encode()
        for entry in Path("/proc").glob("[0-9]*"):
            if entry.name == str(os.getpid()):
                continue
            try:
                if marker in (entry / "environ").read_bytes():  # a zombie has no environment
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    found[int(entry.name)] = command.strip()
            except OSError:  # gone meanwhile, or not ours to read
                continue
        return found

    def processes(self) -> list[str]:
        """Command lines of the live processes this federation started (Linux; none elsewhere)."""
        return sorted(self._marked().values())

    def close(self, *, seconds: float = 30.0) -> None:
        """Stop the SuperNodes, then the SuperLink, then whatever they left behind.

        SIGTERM to each process group; SIGKILL to a group still there after ``seconds``; then
        SIGTERM and SIGKILL, by pid, to any other process of this federation (the SuperLink
        starts its SuperExec in a session of its own; it would notice a few seconds later that
        its parent is gone). Where ``/proc`` exists those are the processes carrying this
        federation's marker; elsewhere the descendants seen before the first signal.
        """
        started = [node.process for node in self.supernodes.values()]
        started += [site.process for site in self.sites.values()]
        started += [executor.process for executor in self.executors.values()]
        if self.superlink is not None:
            started.append(self.superlink)
        below = _descendants([p.pid for p in started if p.poll() is None])
        for process in started:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + seconds
        for process in started:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
            _signal_group(process, signal.SIGKILL)  # stragglers of the group, if any
        if Path("/proc/self/environ").exists():
            _end_pids(lambda: set(self._marked()), seconds=10.0)
        else:
            _end_pids(lambda: {pid for pid in below if _alive(pid)}, seconds=10.0)
        for site in self.sites.values():  # its keys and states go with it
            shutil.rmtree(site.folder.parent, ignore_errors=True)

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _terminate_with_parent() -> None:
    """In the child, before ``exec`` (Linux): SIGTERM when the parent process dies.

    :meth:`LocalFederation.close` stops everything in order; this covers the parent being killed
    before it can (a test runner's timeout, SIGKILL). Flower's SuperExec, ServerApp and ClientApp
    processes watch their own parent (``--parent-pid``) and follow.
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the process group led by ``process`` (it was started in a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _parents() -> dict[int, int]:
    """Every process id with its parent's, from ``/proc`` or, elsewhere, ``ps``."""
    table: dict[int, int] = {}
    if Path("/proc/self/stat").exists():
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            table[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        return table
    listing = subprocess.run(
        ["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True, text=True, check=False
    )
    for line in listing.stdout.splitlines():
        fields = line.split()
        if len(fields) == 2:
            table[int(fields[0])] = int(fields[1])
    return table


def _descendants(roots: Sequence[int]) -> set[int]:
    """The processes below ``roots`` right now (not the roots themselves)."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True  # no /proc: assume alive
    return state != "Z"


def _end_pids(alive: Callable[[], set[int]], *, seconds: float) -> None:
    """Wait up to ``seconds`` until ``alive()`` is empty; then SIGTERM, then SIGKILL, the rest."""
    deadline = time.monotonic() + seconds
    while (pids := alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                continue
        deadline = time.monotonic() + 3.0
        while (pids := alive()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pids:
            return
