"""Rehearse a multi-site fedfm deployment on one machine, then stop everything again.

Usage (from the repository root, after the README's install command)::

    .venv/bin/python simulations/deploy/rehearse.py [--nodes K] [--run-config "rounds=3 ..."]

Every step is a command of ``docs/deployment.md``, printed before it runs, with 127.0.0.1 and free
ports in place of the sites' addresses:

1. throw-away credentials (``certificates.py``): a CA, the SuperLink's TLS certificate for
   127.0.0.1/localhost and one ECDSA P-384 key pair per SuperNode;
2. ``flower-superlink`` with TLS and SuperNode authentication;
3. ``flwr supernode register`` of each SuperNode's public key;
4. ``K`` ``flower-supernode`` processes, node ``k`` with the CA certificate, its private key and
   ``--node-config 'partition-id=k num-partitions=K allow-plaintext=true'`` (the site's own
   privacy policy: ``--site-config``; ``allow-plaintext=true`` by default because the default
   backend ``simulate`` sends images in plaintext, which a data owner must accept explicitly);
5. ``flwr run simulations/double_blind`` (double-blind adaptation, ``K`` clients, 1 round unless
   ``--run-config`` says otherwise), ``flwr log RUN_ID --stream`` until it ends, ``flwr ls``.

Each process has its own working folder and ``FLWR_HOME`` under the workspace (a temporary
folder, deleted at the end, unless ``--workspace DIR``), with its log in ``process.log``. The
ServerApp reads the distilled student from ``runs/distill`` (``fedfm distill``; without one it
refuses to start and names that command). The exit status is 0 only if Flower reports
the run ``finished:completed``; Ctrl-C stops every process.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from certificates import make_credentials
from flwr.common.config import parse_config_args
from local_federation import APP, COMPLETED, ROOT, DeploymentError, LocalFederation, RunValue

from fedfm.protocols.double_blind.settings import DEFAULTS


def _say(line: str) -> None:
    print(f"[rehearse] {line}", flush=True)


def _command(line: str) -> None:
    print(f"$ {line}", flush=True)


def _stop_on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def rehearse(
    workspace: Path,
    nodes: int,
    overrides: dict[str, RunValue],
    *,
    keep: bool,
    site_config: dict[str, RunValue] | None = None,
    warm: bool = False,
) -> int:
    """Run the whole rehearsal in ``workspace``; 0 if the run completed. ``warm``: every site
    with a site process and a warm ClientApp executor, the server pipelined and keeping the
    SuperNodes warm (``docs/deployment.md``, steps 5b, 5c)."""
    started = time.monotonic()
    _say(f"credentials in {workspace / 'credentials'}")
    credentials = make_credentials(workspace / "credentials", nodes=nodes)
    with LocalFederation(workspace / "sites", credentials, echo=_command) as federation:
        _say("server: the SuperLink (TLS, SuperNode authentication)")
        federation.start_superlink()
        _say(f"operator: register the sites' public keys ({federation.operator_home}/config.toml)")
        federation.register_all(nodes)
        _say(f"sites: {nodes} SuperNodes, each with the CA certificate and its own key")
        if warm:
            _say("each site also runs `fedfm site` and `fedfm executor` (--isolation process)")
        federation.start_supernodes(nodes, node_config=site_config, sites=warm, executors=warm)
        federation.wait_for_nodes(nodes)
        federation.flwr("supernode", "ls", "fedfm-deploy", capture=False)
        _say(f"all {nodes} SuperNodes online after {time.monotonic() - started:.0f} s")

        config: dict[str, RunValue] = {
            "num-clients": nodes,
            "rounds": 1,
            "workdir": str(ROOT / "runs" / "distill"),
        }
        # each message starts a ClientApp process (10-30 s under load); Flower drops a
        # message after its timeout, so the 30-s default of the SecAgg stages is too short
        config["secagg-timeout"] = float(overrides.get("timeout", DEFAULTS["timeout"]))
        if warm:  # step 5c's recommended scheduling for warm executors
            config.update({"pipelined": True, "keep-warm": True})
        config.update(overrides)
        run_id = federation.submit(config, APP)
        _say(f"run {run_id} submitted; its log follows")
        federation.flwr("log", str(run_id), "fedfm-deploy", "--stream", timeout=None, capture=False)
        status = federation.wait_for_run(run_id, seconds=120)
        federation.flwr("ls", "fedfm-deploy", "--run-id", str(run_id), capture=False)
        _say("stopping the SuperNodes and the SuperLink")
    where = f"logs in {workspace}" if keep else "--workspace DIR keeps the logs"
    _say(f"run {run_id}: {status} ({time.monotonic() - started:.0f} s in all); {where}")
    return 0 if status == COMPLETED else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="SuperNodes, i.e. sites (3)")
    parser.add_argument(
        "--workspace",
        type=Path,
        help="keep credentials and logs here (default: a temporary folder)",
    )
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        help="run config overrides for flwr run, e.g. \"rounds=3 strategy='fedadam'\"",
    )
    parser.add_argument(
        "--site-config",
        default="allow-plaintext=true",
        help='every site\'s own node config (its privacy policy), e.g. "min-aggregate=3" '
        "(default: allow-plaintext=true, for the default simulate backend)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="every site with a long-lived site process and a warm ClientApp executor "
        "(SuperNodes with --isolation process): the recommended deployment",
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    overrides = parse_config_args(args.run_config) if args.run_config else {}
    site_config = parse_config_args([args.site_config]) if args.site_config else {}
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        if args.workspace is not None:
            args.workspace.mkdir(parents=True, exist_ok=True)
            return rehearse(
                args.workspace.resolve(),
                args.nodes,
                overrides,
                keep=True,
                site_config=site_config,
                warm=args.warm,
            )
        with tempfile.TemporaryDirectory(prefix="fedfm-rehearsal-") as workspace:
            return rehearse(
                Path(workspace),
                args.nodes,
                overrides,
                keep=False,
                site_config=site_config,
                warm=args.warm,
            )
    except DeploymentError as error:
        _say(f"failed: {error}")
        return 1
    except KeyboardInterrupt:
        _say("interrupted; every process was stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
