"""``fedfm bench-round`` and ``fedfm site``: what they read, compute and refuse (no federation)."""

from __future__ import annotations

import math
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from fedfm.cli import main
from fedfm.data.text_task import TEXT_DATASET
from fedfm.errors import ConfigError
from fedfm.experiments.bench_round import _row, _site_seconds
from fedfm.runtime.site import Site, forward
from fedfm.runtime.transport import Envelope


class _Echo:
    def __init__(self, _run_config: object) -> None:
        pass

    def handle(self, envelope: Envelope, state: _State) -> tuple[Envelope, _State]:
        return Envelope(envelope.message_type, envelope.node_id, envelope.round, {}, {}), _State()


class _State:
    def to_records(self) -> tuple[dict[str, np.ndarray], dict[str, object]]:
        return {}, {}

    @classmethod
    def from_records(cls, _arrays: object, _config: object) -> _State:
        return cls()


def test_the_sites_answering_time_is_read_from_the_lines_a_site_writes() -> None:
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="site-") as name:
        site = Site(Path(name) / "s", _Echo, _State, log=lines.append)
        stop = threading.Event()
        thread = threading.Thread(target=site.serve, kwargs={"stop": stop.is_set, "poll": 0.05})
        thread.start()
        try:
            assert site.ready.wait(10)
            for message_type in ("query.setup", "train.block", "query.refresh"):
                forward(
                    Path(name) / "s",
                    run_id=5,
                    run_config={},
                    envelope=Envelope(message_type, 1, 1, {}, {}),
                    timeout=10,
                )
        finally:
            stop.set()
            thread.join(10)
    total, count = _site_seconds("\n".join(lines))
    assert count == 3 and 0.0 <= total < 5.0
    text = "\n".join(lines)
    assert _site_seconds(text, 1)[1] == 3 and _site_seconds(text, 2) == (0, 0)  # one round's


def test_a_rows_messaging_time_is_the_round_trips_minus_the_busiest_site() -> None:
    record = {
        "seconds": 100.0,
        "wall_seconds": 120.0,
        "round_trips": 10,
        "transport_seconds": 80.0,
        "median_round_trip_seconds": 7.5,
        "site_seconds": [12.0, 30.0, 20.0],
        "train_loss": 1.0,
        "balanced_accuracy": 0.5,
        "clients_trained": 3,
        "clients_evaluated": 3,
    }
    row = _row("deployment, site processes", "ckks", record)
    assert row["server_seconds"] == 20.0 and row["messaging_seconds"] == 50.0
    assert row["mean_round_trip_seconds"] == 8.0 and row["slowest_site_seconds"] == 30.0
    in_process = _row("in process", "ckks", {**record, "site_seconds": []})
    assert math.isnan(in_process["messaging_seconds"])


def test_bench_round_and_site_refuse_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(argv: list[str]) -> str:
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in lines[0]
        return lines[0]

    assert "--clients must be at least 2" in refused(["bench-round", "--clients", "1"])
    assert "no distilled student" in refused(["bench-round", "--workdir", str(tmp_path)])
    assert "--rounds must be at least 1" in refused(["bench-round", "--rounds", "0"])
    with tempfile.TemporaryDirectory(prefix="site-") as name:  # a short path: a Unix socket's
        loose = Path(name) / "site"
        loose.mkdir()
        loose.chmod(0o755)
        assert "chmod 700" in refused(["site", "--dir", str(loose)])


def test_the_in_process_round_refuses_a_text_run_config(tmp_path, monkeypatch) -> None:
    from fedfm.experiments.bench_round import in_process_round
    from fedfm.models.student import TextStudentSource

    def text_task(_source: object) -> tuple[object, None]:
        return object(), None  # what a text task loads: not the images bench-round times

    monkeypatch.setattr(TextStudentSource, "load_data", text_task)
    config = {"dataset": TEXT_DATASET, "model": "minilm", "workdir": str(tmp_path)}
    with pytest.raises(ConfigError, match="bench-round times the image path"):
        in_process_round(config, tmp_path / "secret", log=print)
