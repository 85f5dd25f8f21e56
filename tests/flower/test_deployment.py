"""fedfm on Flower's Deployment Engine: a SuperLink and SuperNodes as separate local processes.

Every test here starts real ``flower-superlink`` / ``flower-supernode`` processes on 127.0.0.1
with free ports, TLS on every connection and SuperNode authentication on, through
``simulations/deploy/local_federation.py`` (the module the rehearsal script uses), and checks
that none of their processes is left afterwards. Select them with ``-m deployment``, skip them
with ``-m 'not deployment'``. The CKKS variant is also marked ``slow`` and runs only when the
``-m`` expression names ``slow`` (``pytest -m slow``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedfm.crypto.randomness import SecretStream, write_secret_file
from fedfm.data import load_splits
from fedfm.distillation.pipeline import load_student
from fedfm.flower.codec import HOLD_MESSAGE_TYPE
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.runner import run_in_process
from fedfm.protocols.double_blind.settings import app_settings
from fedfm_strategies.double_blind import SERVER_SECRET_ENV
from tests.helpers import save_micro_student

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "simulations" / "deploy"
NODES = 3
MAX_SAMPLES = 360  # 120 pool samples per node: at least one train and one evaluate batch of 16

pytestmark = pytest.mark.deployment

# Opt-in only (hours on 2 cores: every masked refresh is a round trip that starts a ClientApp
# process per node): run it by selecting its marker, `pytest -m opt_in`. CI's lanes
# ("not slow and not deployment", "slow or deployment") name no opt_in, so they skip it.
only_if_opted_in = pytest.mark.skipif(
    "'opt_in' not in config.getoption('markexpr')",
    reason="hours-long deployment test: select it with -m opt_in",
)


@pytest.fixture(scope="module")
def deploy(monkeypatch_module, tmp_path_factory):
    """The modules of ``simulations/deploy`` (scripts, not an installed package); the SuperLink
    these tests start keys the server's draws by a secret file of its own environment, so that
    its runs can be compared with in-process runs."""
    secret = tmp_path_factory.mktemp("server") / "server.secret"
    write_secret_file(secret)
    monkeypatch_module.setenv(SERVER_SECRET_ENV, str(secret))
    monkeypatch_module.syspath_prepend(str(DEPLOY))
    import certificates
    import local_federation

    return certificates, local_federation


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def credentials(deploy, tmp_path_factory):
    """A CA, the SuperLink's certificate, four node keys (the fourth is never registered)."""
    certificates, _ = deploy
    return certificates.make_credentials(tmp_path_factory.mktemp("credentials"), nodes=NODES + 1)


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory) -> Path:
    """An untrained, calibrated two-block micro student: these tests check plumbing."""
    splits = load_splits("digits", image_size=8, max_samples=MAX_SAMPLES, seed=0)
    return save_micro_student(tmp_path_factory.mktemp("micro-student"), splits)


def run_config(student_dir: Path, checkpoint: Path, **changes: object) -> dict[str, object]:
    """One round of one batch on the micro model with three clients, checkpointed.

    Every round trip starts a ClientApp process per node (10-30 s on a loaded 2-core machine),
    and Flower drops a message whose TTL (the round trip's timeout) has passed: the secure
    aggregation stages get the same timeout as the other round trips.
    """
    timeout = float(changes.get("timeout", 180.0))  # type: ignore[arg-type]
    values: dict[str, object] = {
        "num-clients": NODES,
        "rounds": 1,
        "batches-per-round": 1,
        "model": "vit_fedfm_micro",
        "image-size": 8,
        "max-samples": MAX_SAMPLES,
        "partition": "iid",
        "workdir": str(student_dir),
        "timeout": timeout,
        "connect-timeout": 60.0,
        "checkpoint-dir": str(checkpoint),
        "secagg-timeout": timeout,
    }
    return values | changes


def live_descendants() -> dict[int, str]:
    """The live (not zombie) processes below this test process, with their command lines."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = {}, [os.getpid()]
    while stack:
        for pid in children.get(stack.pop(), []):
            stack.append(pid)
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            found[pid] = command.decode().strip()
    return found


def start_federation(deploy, credentials, workspace: Path):
    """A SuperLink and three registered, authenticated SuperNodes, all online."""
    _, local_federation = deploy
    federation = local_federation.LocalFederation(workspace, credentials)
    try:
        federation.start_superlink()
        federation.register_all(NODES)
        # each site's own policy: it accepts the plaintext simulate backend of these tests
        federation.start_supernodes(NODES, node_config={"allow-plaintext": True})
        federation.wait_for_nodes(NODES)
    except BaseException:
        federation.close()
        raise
    return federation


@pytest.fixture(scope="module")
def federation(deploy, credentials, tmp_path_factory):
    """One SuperLink and three SuperNodes, shared by the tests that leave them intact.

    Torn down last in this module: then no process of any federation of this module may be
    left, nor any child of the test process that was not there before (earlier test modules may
    keep worker processes of their own).
    """
    before = set(live_descendants())
    running = start_federation(deploy, credentials, tmp_path_factory.mktemp("federation"))
    yield running
    running.close()
    assert running.processes() == []
    new = {pid: command for pid, command in live_descendants().items() if pid not in before}
    assert new == {}


def in_process_history(config: dict[str, object], student_dir: Path) -> list:
    """The in-process runner's history for the same run config and student."""
    settings = app_settings(config)
    splits, _ = settings.student.load_data()
    history, _ = run_in_process(
        load_student(student_dir / "student.pt"),
        splits,
        settings.protocol,
        settings.federation,
        policy=DataOwnerPolicy(allow_plaintext=True),
        randomness=SecretStream.from_file(Path(os.environ[SERVER_SECRET_ENV])),
        log=lambda _line: None,
    )
    return history


def history(checkpoint: Path) -> list[dict]:
    """The per-round records the ServerApp saved (it runs on this machine)."""
    return json.loads((checkpoint / "state.json").read_text())["history"]


# -- a round over TLS with authenticated nodes ---------------------------------------------------


def test_three_supernodes_run_a_round_over_tls_with_authenticated_nodes(
    federation, student_dir, tmp_path
) -> None:
    nodes = federation.nodes()
    assert sorted(nodes) == sorted(federation.node_ids)
    assert set(nodes.values()) == {"online"}
    checkpoint = tmp_path / "checkpoint"
    config = run_config(student_dir, checkpoint)
    run_id = federation.submit(config)
    status = federation.wait_for_run(run_id, seconds=600)
    log = federation.run_log(run_id)
    assert status == "finished:completed", log[-3000:]

    (record,) = history(checkpoint)
    assert (record["clients_trained"], record["clients_evaluated"]) == (NODES, NODES)
    assert record["failures"] == []
    assert math.isfinite(record["train_loss"]) and 0.0 <= record["balanced_accuracy"] <= 1.0
    assert "round 1/1 [simulate]" in log and f"({NODES} trained, {NODES} evaluated" in log
    for node in federation.supernodes.values():
        assert "Receiving: query.setup" in node.log() and "Receiving: train.block" in node.log()
    # Node k holds partition k (from its --node-config) and the server orders clients by
    # partition: the same batches, permutations and metrics as the in-process runner's client k.
    # The metrics are ratios of counts and match exactly; the loss up to float summation order.
    (expected,) = in_process_history(config, student_dir)
    assert record["balanced_accuracy"] == expected.balanced_accuracy
    assert record["accuracy"] == expected.accuracy
    assert record["train_loss"] == pytest.approx(expected.train_loss, rel=1e-5)
    row = federation.run_info(run_id)
    assert row["network-traffic"]["total-bytes"] > 0


# -- refused nodes and CLI connections ----------------------------------------------------------


def test_supernodes_without_the_right_certificate_or_key_are_refused(
    deploy, federation, credentials, tmp_path
) -> None:
    certificates, local_federation = deploy
    stranger = certificates.make_credentials(tmp_path / "stranger", nodes=0)
    key, ca = credentials.node_keys[0], credentials.ca_cert  # a registered key, the right CA
    cases = {
        "another CA": ({"private_key": key, "root_certificates": stranger.ca_cert}, 305),
        "no CA (system trust store)": ({"private_key": key, "root_certificates": None}, 305),
        "server certificate as CA": (
            {"private_key": key, "root_certificates": credentials.server_cert},
            305,
        ),
        "unregistered key": (
            {"private_key": credentials.node_keys[NODES], "root_certificates": ca},
            305,
        ),
        "no key": ({"private_key": None, "root_certificates": ca}, 305),
        "no TLS, with key": (
            {"private_key": key, "root_certificates": None, "insecure": True},
            303,
        ),
        "no TLS, no key": (
            {
                "private_key": None,
                "root_certificates": None,
                "insecure": True,
                "extra_args": ("--max-retries", "2"),
            },
            305,
        ),
    }
    before = federation.nodes()
    started = {
        name: federation.start_supernode(100 + k, num_partitions=NODES, **kwargs)
        for k, (name, (kwargs, _)) in enumerate(cases.items())
    }
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and any(n.process.poll() is None for n in started.values()):
        time.sleep(0.2)
    try:
        for name, (_, code) in cases.items():
            node = started[name]
            assert node.process.poll() not in (None, 0), f"{name}: still running or exited 0"
            assert f"Exit Code: {code}" in node.log(), f"{name}:\n{node.log()[-2000:]}"
        for name in ("another CA", "no CA (system trust store)", "server certificate as CA"):
            assert "CERTIFICATE_VERIFY_FAILED" in started[name].log()
        assert "Failed to activate SuperNode" in started["unregistered key"].log()
        assert federation.nodes() == before  # no node was added, none came online
    finally:
        for node in started.values():
            federation.kill(node)
            del federation.supernodes[node.index]

    # the operator's CLI is refused too without the CA that signed the SuperLink's certificate
    home = tmp_path / "stranger-home"
    home.mkdir()
    (home / "config.toml").write_text(
        (federation.operator_home / "config.toml")
        .read_text()
        .replace(str(credentials.ca_cert), str(stranger.ca_cert))
    )
    result = subprocess.run(
        [str(local_federation.BIN / "flwr"), "ls", local_federation.CONNECTION],
        env=federation.environment(home),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    # Flower 1.41's CLI reports a failed certificate check as an unreachable SuperLink
    assert "Connection to the SuperLink is unavailable" in result.stdout + result.stderr
    federation.nodes()  # the same address with the right CA answers


# -- CKKS (opt-in) -------------------------------------------------------------------------------


@pytest.mark.ckks
@pytest.mark.slow
@pytest.mark.opt_in
@only_if_opted_in
def test_three_supernodes_run_a_round_under_ckks(federation, student_dir, tmp_path) -> None:
    """The same round under real CKKS (N = 8192): over a hundred round trips of masked
    refreshes, each a ClientApp process per node, so no evaluation (too few held-out samples
    for a batch). The loss equals the simulate backend's within CKKS precision."""
    checkpoint = tmp_path / "checkpoint"
    config = run_config(
        student_dir, checkpoint, backend="ckks-8192", timeout=1800.0, **{"eval-fraction": 0.05}
    )
    run_id = federation.submit(config)
    status = federation.wait_for_run(run_id, seconds=4 * 3600, poll=10.0)
    log = federation.run_log(run_id)
    assert status == "finished:completed", log[-3000:]
    (record,) = history(checkpoint)
    assert (record["clients_trained"], record["clients_evaluated"]) == (NODES, 0)
    (expected,) = in_process_history(config | {"backend": "simulate"}, student_dir)
    assert abs(record["train_loss"] - expected.train_loss) < 1e-3
    assert "backend=ckks-8192" in log and "round 1/1 [ckks-8192]" in log


# -- a SuperNode killed mid-run ------------------------------------------------------------------

# The run config's round-trip timeout in the kill test: long enough for the live nodes' round
# trips on a loaded machine, about when Flower itself declares a killed node unavailable.
KILL_TIMEOUT = 60.0
# The same with warm executors: a round trip takes seconds there (no process per message), and
# the SuperNode whose executor died stays up, so only the server's timeout notices.
WARM_KILL_TIMEOUT = 30.0


def wait_for_line(node, text: str, *, count: int = 1, seconds: float = 300.0) -> float:
    """Wait until ``text`` occurs ``count`` times in the node's log; the time it took."""
    started = time.monotonic()
    while node.log().count(text) < count:
        if time.monotonic() - started > seconds:
            raise AssertionError(f"no {count}x {text!r} in SuperNode {node.index}'s log")
        if node.process.poll() is not None:
            raise AssertionError(f"SuperNode {node.index} exited:\n{node.log()[-2000:]}")
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_killed_supernode_leaves_the_run_which_completes_without_it(
    deploy, credentials, student_dir, tmp_path
) -> None:
    """SIGKILL one SuperNode (and its ClientApp processes) in the middle of its first training
    message: after the run config's timeout the run goes on with the other two and completes.
    A run started afterwards that needs all three stops at its connect timeout, with a message
    naming the shortfall."""
    federation = start_federation(deploy, credentials, tmp_path / "federation")
    try:
        checkpoint = tmp_path / "checkpoint"
        # too few held-out samples for a batch: no evaluation round trips (they are not the
        # point here, and every round trip costs a ClientApp process per node)
        config = run_config(
            student_dir,
            checkpoint,
            timeout=KILL_TIMEOUT,
            **{"min-clients": 2, "eval-fraction": 0.05},
        )
        run_id = federation.submit(config)
        victim, survivor = federation.supernodes[NODES - 1], federation.supernodes[0]
        victim_id = federation.node_ids[NODES - 1]
        wait_for_line(victim, "Receiving: train.block")
        federation.kill(victim, signal.SIGKILL)
        assert victim.process.returncode == -signal.SIGKILL
        # the survivors get their next training message once the first round trip gave up (the
        # micro student reveals one block by default: the next message is the loss step)
        waited = wait_for_line(survivor, "Receiving: train.loss")
        print(f"[deployment] the survivors' next message came {waited:.0f} s after the kill")
        assert waited < KILL_TIMEOUT + 60, f"the round waited {waited:.0f} s for the dead node"

        status = federation.wait_for_run(run_id, seconds=600)
        log = federation.run_log(run_id)
        assert status == "finished:completed", log[-3000:]
        (record,) = history(checkpoint)
        assert (record["clients_trained"], record["clients_evaluated"]) == (NODES - 1, 0)
        assert any(str(victim_id) in failure for failure in record["failures"])
        assert f"node {victim_id} left the round" in log

        # Flower marks the dead node offline once its heartbeats stop (at most 60 s); a run that
        # needs all three nodes then stops at its connect timeout with a clear message
        deadline = time.monotonic() + 120
        while federation.nodes()[victim_id] == "online" and time.monotonic() < deadline:
            time.sleep(2)
        assert federation.nodes()[victim_id] == "offline"
        strict = run_config(
            student_dir, tmp_path / "strict", **{"min-clients": NODES, "connect-timeout": 5.0}
        )
        run_id = federation.submit(strict)
        status = federation.wait_for_run(run_id, seconds=180)
        log = federation.run_log(run_id)
        assert status == "finished:failed", log[-3000:]
        assert f"{NODES - 1} nodes connected within 5 s, need {NODES}" in log
    finally:
        federation.close()
    assert federation.processes() == []


# -- data owners' site processes -----------------------------------------------------------------


def wait_for_log(process, text: str, *, seconds: float = 300.0) -> None:
    deadline = time.monotonic() + seconds
    while text not in process.log():
        assert time.monotonic() < deadline, f"no {text!r} in {process.log_path}"
        time.sleep(0.1)


def test_site_processes_answer_a_round_as_the_clientapps_would_and_a_killed_site_drops_out(
    deploy, credentials, student_dir, tmp_path
) -> None:
    """Each data owner runs ``fedfm site`` beside its SuperNode (node config: only ``site-dir``):
    the round gives the in-process runner's metrics; a site killed mid-round fails its node's
    next message at once (no timeout to wait for) and the run completes without it."""
    _, local_federation = deploy
    federation = local_federation.LocalFederation(tmp_path / "federation", credentials)
    try:
        federation.start_superlink()
        federation.register_all(NODES)
        federation.start_supernodes(NODES, node_config={"allow-plaintext": True}, sites=True)
        federation.wait_for_nodes(NODES)
        for node in federation.supernodes.values():  # the policy is the site's, not the node's
            node_config = node.command[node.command.index("--node-config") + 1]
            assert "site-dir" in node_config and "allow-plaintext" not in node_config

        checkpoint = tmp_path / "checkpoint"
        config = run_config(student_dir, checkpoint)
        started = time.monotonic()
        run_id = federation.submit(config)
        status = federation.wait_for_run(run_id, seconds=600)
        log = federation.run_log(run_id)
        assert status == "finished:completed", log[-3000:]
        print(f"[deployment] a round with site processes: {time.monotonic() - started:.0f} s")
        (record,) = history(checkpoint)
        (expected,) = in_process_history(config, student_dir)
        assert (record["clients_trained"], record["clients_evaluated"]) == (NODES, NODES)
        assert record["balanced_accuracy"] == expected.balanced_accuracy
        assert record["train_loss"] == pytest.approx(expected.train_loss, rel=1e-5)
        for site in federation.sites.values():
            assert f"run {run_id}: answered query.setup" in site.log()
            assert f"run {run_id}: answered train.secagg" in site.log()
            assert (site.folder / "state" / f"run-{run_id}.npz").stat().st_mode & 0o777 == 0o600

        checkpoint = tmp_path / "killed"
        config = run_config(
            student_dir,
            checkpoint,
            timeout=KILL_TIMEOUT,
            **{"min-clients": 2, "eval-fraction": 0.05},
        )
        run_id = federation.submit(config)
        victim = federation.sites[NODES - 1]
        wait_for_log(victim, f"run {run_id}: answered train.block")
        victim.process.kill()
        victim.process.wait()
        status = federation.wait_for_run(run_id, seconds=600)
        log = federation.run_log(run_id)
        assert status == "finished:completed", log[-3000:]
        (record,) = history(checkpoint)
        assert (record["clients_trained"], record["clients_evaluated"]) == (NODES - 1, 0)
        (failure,) = record["failures"]
        assert "site process" in failure and "down" in failure, failure
    finally:
        federation.close()
    assert federation.processes() == []
    assert not any(site.folder.exists() for site in federation.sites.values())


def test_warm_executors_answer_a_round_as_clientapp_processes_would_and_a_killed_one_drops_out(
    deploy, credentials, student_dir, tmp_path
) -> None:
    """Each SuperNode runs with ``--isolation process`` beside a warm ClientApp executor
    (``fedfm executor``) and a site process: the round (pipelined, with keep-warm holds)
    gives the in-process runner's metrics, every message ran in an executor and the holds were
    answered there without reaching the site. An executor killed mid-round leaves
    its node's next message unanswered: the server drops the node after the run config's
    timeout and the run completes with the other two; a restarted executor serves the node
    again."""
    _, local_federation = deploy
    federation = local_federation.LocalFederation(tmp_path / "federation", credentials)
    try:
        federation.start_superlink()
        federation.register_all(NODES)
        federation.start_supernodes(
            NODES, node_config={"allow-plaintext": True}, sites=True, executors=True
        )
        federation.wait_for_nodes(NODES)
        for node in federation.supernodes.values():
            assert node.command[node.command.index("--isolation") + 1] == "process"

        checkpoint = tmp_path / "checkpoint"
        # pipelined: each site's next request goes out as soon as its reply is answered;
        # keep-warm: a hold after each request keeps the SuperNode from its 3-s idle sleep
        config = run_config(student_dir, checkpoint, pipelined=True, **{"keep-warm": True})
        started = time.monotonic()
        run_id = federation.submit(config)
        status = federation.wait_for_run(run_id, seconds=600)
        log = federation.run_log(run_id)
        assert status == "finished:completed", log[-3000:]
        print(f"[deployment] a round with warm executors: {time.monotonic() - started:.0f} s")
        (record,) = history(checkpoint)
        (expected,) = in_process_history(config, student_dir)
        assert (record["clients_trained"], record["clients_evaluated"]) == (NODES, NODES)
        assert record["balanced_accuracy"] == expected.balanced_accuracy
        assert record["train_loss"] == pytest.approx(expected.train_loss, rel=1e-5)
        for index, executor in federation.executors.items():
            requests = record["round_trips"] + 1  # the round's round trips and the setup
            ran = executor.log().count(f"run {run_id}: ") - executor.log().count(HOLD_MESSAGE_TYPE)
            answered = federation.sites[index].log().count(f"run {run_id}: answered")
            assert ran == answered == requests, executor.log()[-2000:]
            # one hold after each request (the last may come after the run ended)
            holds = executor.log().count(f"run {run_id}: {HOLD_MESSAGE_TYPE} answered")
            assert requests - 1 <= holds <= requests, executor.log()[-2000:]
            assert "failed" not in executor.log()

        checkpoint = tmp_path / "killed"
        config = run_config(
            student_dir,
            checkpoint,
            timeout=WARM_KILL_TIMEOUT,
            **{"min-clients": 2, "eval-fraction": 0.05},
        )
        run_id = federation.submit(config)
        victim = federation.executors[NODES - 1]
        wait_for_log(victim, f"run {run_id}: train.block answered")
        victim.process.kill()
        victim.process.wait()
        status = federation.wait_for_run(run_id, seconds=600)
        log = federation.run_log(run_id)
        assert status == "finished:completed", log[-3000:]
        (record,) = history(checkpoint)
        assert (record["clients_trained"], record["clients_evaluated"]) == (NODES - 1, 0)
        victim_id = federation.node_ids[NODES - 1]
        assert any(str(victim_id) in failure for failure in record["failures"])

        restarted = federation.start_executor(federation.supernodes[NODES - 1])
        checkpoint = tmp_path / "restarted"
        # training alone shows the node served again (no evaluation round trips)
        config = run_config(
            student_dir,
            checkpoint,
            pipelined=True,
            **{"keep-warm": True, "eval-fraction": 0.05},
        )
        run_id = federation.submit(config)
        status = federation.wait_for_run(run_id, seconds=600)
        log = federation.run_log(run_id)
        assert status == "finished:completed", log[-3000:]
        (record,) = history(checkpoint)
        assert record["clients_trained"] == NODES, (record, restarted.log()[-2000:])
    finally:
        federation.close()
    assert federation.processes() == []


# -- the multi-party runtime on the Deployment Engine -------------------------------------------


def test_a_runtime_protocol_runs_with_roles_identities_and_pins_from_node_config(
    deploy, credentials, tmp_path
) -> None:
    """The masked-sum example of the runtime (``simulations/runtime_demo``) across three
    SuperNodes, each site configured only by its own ``--node-config``: its role, its identity
    key file and the pinned fingerprints of the other roles (nothing in the run config). Every
    message runs in a fresh ClientApp process, so the session keys and sequence numbers must
    survive in ``context.state``: alice publishes the exact sum, and the ServerApp, which relays
    every frame, never sees either vector."""
    import numpy as np

    from fedfm.runtime import create_identity_file, format_pins

    _, local_federation = deploy
    roles = ("alice", "bob", "carol")
    sites = {role: tmp_path / role for role in roles}
    fingerprints = {}
    for role, folder in sites.items():
        folder.mkdir()
        fingerprints[role] = create_identity_file(folder / "identity.key")
    rng = np.random.default_rng(7)
    vectors = {role: rng.integers(-(2**40), 2**40, size=16) for role in roles[:2]}
    for role, vector in vectors.items():
        (sites[role] / "inputs").mkdir()
        np.savez(sites[role] / "inputs" / f"{role}.npz", x=vector)

    federation = local_federation.LocalFederation(tmp_path / "federation", credentials)
    try:
        federation.start_superlink()
        federation.register_all(NODES)
        for index, role in enumerate(roles):
            site = {
                "roles": role,
                "identity-key": str(sites[role] / "identity.key"),
                "pins": format_pins({r: fp for r, fp in fingerprints.items() if r != role}),
            }
            if role in vectors:
                site["inputs-dir"] = str(sites[role] / "inputs")
            federation.start_supernode(
                index,
                num_partitions=NODES,
                private_key=credentials.node_keys[index],
                root_certificates=credentials.ca_cert,
                node_config=site,
            )
        federation.wait_for_nodes(NODES)
        result_file = tmp_path / "result.json"
        run_id = federation.submit(
            {"results-file": str(result_file), "timeout": 180.0},
            app=ROOT / "simulations" / "runtime_demo",
        )
        status = federation.wait_for_run(run_id, seconds=600)
        log = federation.run_log(run_id)
        assert status == "finished:completed", log[-3000:]
    finally:
        federation.close()
    assert federation.processes() == []

    result = json.loads(result_file.read_text())
    published = result["outputs"]["alice"]["sum"]["values"]
    assert published == (vectors["alice"] + vectors["bob"]).tolist()
    # what the relay wrote down about the run names neither private vector
    relay_view = result_file.read_text() + log
    for vector in vectors.values():
        assert str(vector.tolist()[0]) not in relay_view
