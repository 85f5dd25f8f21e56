"""Network profiles, and an in-process transport that accounts the time a network would take.

Nothing sleeps: :class:`EmulatedTransport` delivers envelopes in-process and adds, per profile,
the time the round trip would take if each node sat behind its own link of that profile to the
relay and the nodes of a round trip worked in parallel:

    round trip = max over its nodes of (RTT + 8 (bytes down + bytes up) / bandwidth + compute)

where *compute* is the handler's measured time. Presets: ``lan`` and ``wan`` are the LAN
(3 Gbps, 0.8 ms) and WAN (100 Mbps, 80 ms) of spec 004 §5.1 (CENTAUR; both delays read as
round-trip times); ``rtt-1ms`` and ``rtt-10ms`` are the round-trip times of spec 002 §7.3
(FedRAG), which varies latency alone, so their bandwidth is unlimited.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fedfm.runtime.transport import (
    ClientHandler,
    Envelope,
    Failure,
    InProcessTransport,
)


@dataclass(frozen=True)
class NetworkProfile:
    """A link: round-trip time and bandwidth (``None``: unlimited)."""

    name: str
    rtt_seconds: float
    bandwidth_bits_per_second: float | None

    def transfer_seconds(self, nbytes: int) -> float:
        """Time to push ``nbytes`` through the link (serialisation delay)."""
        if self.bandwidth_bits_per_second is None:
            return 0.0
        return 8 * nbytes / self.bandwidth_bits_per_second

    def round_trip_seconds(self, bytes_down: int, bytes_up: int) -> float:
        """One request and its reply over this link, without compute."""
        return self.rtt_seconds + self.transfer_seconds(bytes_down + bytes_up)


PRESETS: dict[str, NetworkProfile] = {
    profile.name: profile
    for profile in (
        NetworkProfile("lan", 0.8e-3, 3e9),
        NetworkProfile("wan", 80e-3, 100e6),
        NetworkProfile("rtt-1ms", 1e-3, None),
        NetworkProfile("rtt-10ms", 10e-3, None),
    )
}


class EmulatedTransport:
    """:class:`~fedfm.runtime.transport.InProcessTransport` plus simulated time per profile.

    ``network_seconds[name]`` sums the links' time alone (deterministic: bytes and RTTs);
    ``projected_seconds[name]`` adds the nodes' measured compute time, per round trip the
    slowest node's.
    """

    def __init__(
        self,
        handlers: Mapping[int, ClientHandler],
        profiles: Sequence[NetworkProfile] = tuple(PRESETS.values()),
    ) -> None:
        self._compute: dict[int, float] = {}
        self.inner = InProcessTransport(
            {node: self._timed(node, h) for node, h in handlers.items()}
        )
        self.profiles = tuple(profiles)
        self.network_seconds = {profile.name: 0.0 for profile in self.profiles}
        self.projected_seconds = {profile.name: 0.0 for profile in self.profiles}

    def _timed(self, node: int, handler: ClientHandler) -> ClientHandler:
        def timed(envelope: Envelope) -> Envelope:
            started = time.perf_counter()
            try:
                return handler(envelope)
            finally:
                self._compute[node] = time.perf_counter() - started

        return timed

    def send_and_receive(
        self, envelopes: Iterable[Envelope], *, timeout: float | None = None
    ) -> list[Envelope | Failure]:
        envelopes = list(envelopes)
        self._compute.clear()
        replies = self.inner.send_and_receive(envelopes, timeout=timeout)
        for profile in self.profiles:
            links = [
                (
                    profile.round_trip_seconds(
                        request.nbytes, reply.nbytes if isinstance(reply, Envelope) else 0
                    ),
                    self._compute.get(request.node_id, 0.0),
                )
                for request, reply in zip(envelopes, replies, strict=True)
            ]
            if links:
                self.network_seconds[profile.name] += max(link for link, _ in links)
                self.projected_seconds[profile.name] += max(sum(pair) for pair in links)
        return replies
