"""FedRAG on Flower's Deployment Engine: a TLS SuperLink and four authenticated SuperNodes as
separate local processes (``simulations/deploy/local_federation.py``), each site configured only
by its own ``--node-config`` (its role, identity key, pins of the other roles and its private
inputs), the app of ``simulations/fedrag``. The coordinator's sealed report equals the in-process
run of the same inputs and plaintext RAG. Select with ``-m deployment``.

The micro decoder and two generated tokens keep it short. Each SuperNode runs with
``--isolation process`` beside a warm ClientApp executor (``fedfm executor``) and the run keeps
the SuperNodes warm with holds (run config ``keep-warm``): with Flower's default isolation every
message started a ClientApp process that imported torch and loaded the decoder (197 s for this
test against 92 s warm, on 2026-11-28; the runtime protocols' default isolation is covered by
``test_deployment.py``'s masked-sum run).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedfm.flower.codec import HOLD_MESSAGE_TYPE
from fedfm.models.decoder import DecoderSource, train_decoder
from fedfm.protocols.fedrag.decoder import runner_for
from fedfm.protocols.fedrag.plan import COORDINATOR, RolePlan
from fedfm.protocols.fedrag.protocol import fedrag, open_report
from fedfm.protocols.fedrag.reference import plaintext_generate
from fedfm.runtime import InProcessFederation, create_identity_file, format_pins
from tests.helpers import micro_decoder_source

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "simulations" / "fedrag"
ROLES = (COORDINATOR, "owner_0", "owner_1", "compute")
TOKENS = 2

pytestmark = pytest.mark.deployment


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def local_federation(monkeypatch_module: pytest.MonkeyPatch):
    """``simulations/deploy``'s modules (scripts, not an installed package)."""
    monkeypatch_module.syspath_prepend(str(ROOT / "simulations" / "deploy"))
    import certificates
    import local_federation

    return certificates, local_federation


def test_fedrag_runs_on_four_authenticated_supernodes_and_equals_the_in_process_run(
    local_federation, tmp_path: Path
) -> None:
    certificates, deployment = local_federation
    micro: DecoderSource = micro_decoder_source(tmp_path / "decoder")
    train_decoder(micro, progress=False, log=lambda _: None)
    _, tokenizer = runner_for(micro)
    rng = np.random.default_rng(11)
    vocab = len(tokenizer)
    report_key = os.urandom(32)
    inputs = {
        "owner_0": {"segment": np.concatenate([[0], rng.integers(3, vocab, 6)])},
        "owner_1": {"segment": rng.integers(3, vocab, 6)},
        COORDINATOR: {
            "query": rng.integers(3, vocab, 5),
            "report_key": np.frombuffer(report_key, np.uint8),
        },
    }
    # each site's own folder: identity key, private inputs; pins exchanged out of band
    sites = {role: tmp_path / "sites" / role for role in ROLES}
    fingerprints = {}
    for role, folder in sites.items():
        (folder / "inputs").mkdir(parents=True)
        fingerprints[role] = create_identity_file(folder / "identity.key")
        if role in inputs:
            np.savez(folder / "inputs" / f"{role}.npz", **inputs[role])

    credentials = certificates.make_credentials(tmp_path / "credentials", nodes=len(ROLES))
    federation = deployment.LocalFederation(tmp_path / "federation", credentials)
    result_file = tmp_path / "result.json"
    started = time.monotonic()
    try:
        federation.start_superlink()
        federation.register_all(len(ROLES))
        for index, role in enumerate(ROLES):
            federation.start_supernode(
                index,
                num_partitions=len(ROLES),
                private_key=credentials.node_keys[index],
                root_certificates=credentials.ca_cert,
                node_config={
                    "roles": role,
                    "identity-key": str(sites[role] / "identity.key"),
                    "pins": format_pins({r: fp for r, fp in fingerprints.items() if r != role}),
                    "inputs-dir": str(sites[role] / "inputs"),
                },
                extra_args=("--isolation", "process"),
            )
        for node in federation.supernodes.values():  # a warm ClientApp executor per site
            federation.start_executor(node)
        federation.wait_for_nodes(len(ROLES))
        run_id = federation.submit(
            {
                "results-file": str(result_file),
                "timeout": 300.0,
                "decoder": str(micro.path),
                "max-new-tokens": TOKENS,
                "keep-warm": True,
            },
            app=APP,
        )
        status = federation.wait_for_run(run_id, seconds=900)
        log = federation.run_log(run_id)
        assert status == "finished:completed", log[-3000:]
        for executor in federation.executors.values():  # every message ran warm, holds too
            assert f"run {run_id}: {HOLD_MESSAGE_TYPE} answered" in executor.log()
            assert "failed" not in executor.log(), executor.log()[-2000:]
    finally:
        federation.close()
    elapsed = time.monotonic() - started
    print(f"[deployment] FedRAG on 4 SuperNodes: {elapsed:.0f} s from SuperLink start to close")
    assert federation.processes() == []

    result = json.loads(result_file.read_text())
    assert len(set(result["placement"].values())) == len(ROLES)  # one node per role
    sealed = np.asarray(result["outputs"][COORDINATOR]["report"]["values"], np.uint8)
    deployed = open_report(report_key, sealed)

    protocol = fedrag({"max-new-tokens": TOKENS}, decoders=micro)
    local = InProcessFederation(
        protocol, inputs, placement=RolePlan(2, "dedicated").placement(4)
    ).run()
    in_process = open_report(report_key, local.outputs[COORDINATOR]["report"])
    runner, _ = runner_for(micro)
    segments = [
        inputs["owner_0"]["segment"],
        inputs["owner_1"]["segment"],
        inputs[COORDINATOR]["query"],
    ]
    plain_tokens, plain_logits = plaintext_generate(runner, segments, TOKENS)
    assert np.array_equal(deployed["tokens"], in_process["tokens"])
    assert np.array_equal(deployed["tokens"], plain_tokens)
    assert np.abs(deployed["logits"] - in_process["logits"]).max() <= 1e-4
    assert np.abs(deployed["logits"] - plain_logits).max() <= 1e-4
    # the same messages crossed the relay: equal round trips and role-to-role pairs
    assert result["traffic"]["round_trips"] == local.traffic.round_trips
    assert set(result["traffic"]["pairs"]) == set(local.traffic.to_dict()["pairs"])  # type: ignore[arg-type]
    # what the relay wrote down holds neither the query nor a segment in the clear
    relay_view = result_file.read_text() + log
    for ids in segments:
        assert str(ids.tolist()) not in relay_view
    assert report_key.hex() not in relay_view
