"""``fedfm bench-runtime``: the channel benchmark writes its JSON and Markdown."""

from __future__ import annotations

import json

from fedfm.cli import main as cli_main


def test_bench_runtime_writes_json_and_markdown(tmp_path, capsys) -> None:
    arguments = ["bench-runtime", "--sizes", "256", "4096", "--repeats", "2"]
    arguments += ["--vector-length", "8", "--results-dir", str(tmp_path)]
    assert cli_main(arguments) == 0
    payload = json.loads((tmp_path / "runtime_channel.json").read_text())
    rows = payload["rows"]
    assert [row["payload_bytes"] for row in rows] == [256, 4096]
    for row in rows:
        assert row["plain_bytes"] == row["payload_bytes"]
        # nonce and tag, frame header, array header: constant, not proportional
        assert 28 < row["overhead_bytes"] < 160
        assert row["wan_channel_ms"] > row["wan_plain_ms"] > 80
    assert payload["masked_sum"]["round_trips"] == 4
    assert payload["command"].startswith("fedfm bench-runtime --sizes 256 4096")
    markdown = (tmp_path / "runtime_channel.md").read_text()
    assert "| payload (B) |" in markdown and "Regenerate: `fedfm bench-runtime" in markdown
    assert "regenerate with: fedfm bench-runtime" in capsys.readouterr().out
