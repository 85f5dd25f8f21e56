"""Per-message cost of the runtime's end-to-end channel against plain relaying.

For each payload size, in the same run and interleaved, one message goes from a role on one node
to a role on another through the in-process relay two ways:

* *plain*: the payload array rides in the envelope as it is (what a protocol without channels
  sends; the relay could read it);
* *channel*: the sender packs and seals it (:meth:`fedfm.runtime.Channels.seal`: ChaCha20-Poly1305
  under the pair's key, frame header, sequence number), the relay carries the frame, the receiver
  checks and opens it and unpacks the arrays.

Measured: bytes in the envelope, and the median time per message (the channel's time is its
CPU work; in-process relaying itself costs microseconds either way). Projected per network
preset (:data:`fedfm.runtime.PRESETS`): a message through the relay crosses two links (sender to
relay, relay to receiver) and waits one RTT, so it takes ``RTT + 8 * 2 * bytes / bandwidth`` plus
the measured time. The whole masked-sum example, run over :class:`~fedfm.runtime.EmulatedTransport`,
gives the protocol-level view (round trips, bytes, projected time).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.errors import ProtocolError
from fedfm.experiments.results import write_results
from fedfm.protocols.masked_sum import masked_sum
from fedfm.runtime import (
    PRESETS,
    Channels,
    EmulatedTransport,
    InProcessFederation,
    pack_arrays,
    unpack_arrays,
)
from fedfm.runtime.messages import STEP, frames_from_arrays, frames_to_arrays
from fedfm.runtime.transport import Envelope, InProcessTransport
from fedfm.secagg.channel import new_private_key, public_key_of

DEFAULT_SIZES = (1024, 64 * 1024, 1024**2, 16 * 1024**2)
SENDER, RECEIVER = "sender", "receiver"
_RECEIVER_NODE = 2


def _channel_pair() -> tuple[Channels, Channels]:
    """The sender's and the receiver's channels in one session (the keys a handshake yields)."""
    private = {SENDER: new_private_key(), RECEIVER: new_private_key()}
    session_keys = {role: public_key_of(key) for role, key in private.items()}

    def end(role: str) -> Channels:
        return Channels(
            digest=bytes(32),
            session=bytes(16),
            private_key=private[role],
            session_keys=session_keys,
            pairs=frozenset({frozenset((SENDER, RECEIVER))}),
            hosted=frozenset({role}),
            sent={},
            received={},
        )

    return end(SENDER), end(RECEIVER)


def _timed(send: Callable[[], Envelope]) -> tuple[float, int]:
    started = time.perf_counter()
    nbytes = send().nbytes
    return time.perf_counter() - started, nbytes


def measure_message(size: int, repeats: int) -> dict[str, Any]:
    """One payload size: bytes and median seconds per message, plain and through the channel."""
    payload = {"payload": np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)}
    sender, receiver = _channel_pair()
    received: list[dict[str, np.ndarray]] = []

    def deliver(envelope: Envelope) -> Envelope:
        frames = frames_from_arrays(envelope.arrays)
        if frames:  # the channel: check, decrypt, unpack
            received.append(unpack_arrays(receiver.open(frames[0]).plaintext))
        else:
            received.append(envelope.arrays)
        return Envelope(STEP, envelope.node_id, 0)

    relay = InProcessTransport({_RECEIVER_NODE: deliver})

    def plain() -> Envelope:
        envelope = Envelope(STEP, _RECEIVER_NODE, 0, payload)
        relay.send_and_receive([envelope])
        return envelope

    def sealed() -> Envelope:
        frame = sender.seal(SENDER, RECEIVER, "send", pack_arrays(payload))
        envelope = Envelope(STEP, _RECEIVER_NODE, 0, frames_to_arrays([frame]))
        relay.send_and_receive([envelope])
        return envelope

    plain_times, channel_times = [], []
    for _ in range(repeats):  # interleaved: both see the same machine load
        plain_seconds, plain_bytes = _timed(plain)
        channel_seconds, channel_bytes = _timed(sealed)
        plain_times.append(plain_seconds)
        channel_times.append(channel_seconds)
    if not all(np.array_equal(r["payload"], payload["payload"]) for r in received):
        raise ProtocolError("the receiver got other bytes than were sent")
    row: dict[str, Any] = {
        "payload_bytes": size,
        "plain_bytes": plain_bytes,
        "channel_bytes": channel_bytes,
        "overhead_bytes": channel_bytes - plain_bytes,
        "plain_us": statistics.median(plain_times) * 1e6,
        "channel_us": statistics.median(channel_times) * 1e6,
    }
    row["overhead_us"] = row["channel_us"] - row["plain_us"]
    for name, profile in PRESETS.items():
        for kind in ("plain", "channel"):
            seconds = profile.round_trip_seconds(row[f"{kind}_bytes"], row[f"{kind}_bytes"])
            row[f"{name}_{kind}_ms"] = (seconds + row[f"{kind}_us"] * 1e-6) * 1e3
        row[f"{name}_overhead_pct"] = 100 * (
            row[f"{name}_channel_ms"] / row[f"{name}_plain_ms"] - 1
        )
    return row


def measure_masked_sum(length: int) -> dict[str, Any]:
    """The masked-sum example over the emulated network: round trips, bytes, projected time."""
    rng = np.random.default_rng(0)
    inputs = {role: {"x": rng.integers(-(2**40), 2**40, length)} for role in ("alice", "bob")}
    federation = InProcessFederation(masked_sum(), inputs)
    transport = EmulatedTransport(federation.nodes)
    result = federation.run(transport)
    if not np.array_equal(
        result.outputs["alice"]["sum"], inputs["alice"]["x"] + inputs["bob"]["x"]
    ):
        raise ProtocolError("masked-sum published a wrong sum")
    return {
        "vector_length": length,
        "round_trips": result.traffic.round_trips,
        "bytes": sum(n.bytes_down + n.bytes_up for n in result.traffic.nodes.values()),
        "projected_seconds": transport.projected_seconds,
        "network_seconds": transport.network_seconds,
        "traffic": result.traffic.to_dict(),
    }


def run_runtime_benchmark(
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 20,
    vector_length: int = 1024,
    results_dir: Path = Path("results"),
    command: str | None = None,
) -> tuple[Path, Path]:
    """Measure every size, run the masked-sum example, write ``runtime_channel.{json,md}``."""
    rows = [measure_message(size, repeats) for size in sizes]
    example = measure_masked_sum(vector_length)
    columns = [
        ("payload_bytes", "payload (B)"),
        ("plain_bytes", "plain (B)"),
        ("channel_bytes", "channel (B)"),
        ("plain_us", "plain (µs)"),
        ("channel_us", "channel (µs)"),
    ]
    for name in PRESETS:
        columns += [(f"{name}_channel_ms", f"{name} (ms)"), (f"{name}_overhead_pct", "+%")]
    projected = ", ".join(
        f"{name} {seconds * 1e3:.4g} ms" for name, seconds in example["projected_seconds"].items()
    )
    description = (
        f"One message from a role to another through the in-process relay, plain (the payload "
        f"in the envelope) and sealed by the runtime's channel, interleaved in one run; median of "
        f"{repeats} messages per size. `(B)`: bytes in the envelope; `(µs)`: measured time per "
        "message; per network preset: projected time per message through the relay with the "
        "channel, `RTT + 8 * 2 * bytes / bandwidth + measured time`, and `+%` over plain. "
        "Presets: lan 3 Gbps / 0.8 ms and wan 100 Mbps / 80 ms (spec 004 §5.1), rtt-1ms and "
        "rtt-10ms with unlimited bandwidth (spec 002 §7.3). The masked-sum example "
        f"(vectors of {vector_length} int64, 3 nodes) takes {example['round_trips']} round "
        f"trips and {example['bytes']} bytes; projected: {projected}."
    )
    return write_results(
        results_dir,
        "runtime_channel",
        title="End-to-end channel vs plain relaying, per message",
        description=description,
        rows=rows,
        columns=columns,
        extra={"masked_sum": example, "presets": {n: vars(p) for n, p in PRESETS.items()}},
        command=command,
    )
