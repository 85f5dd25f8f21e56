"""Settings of secure aggregation and the bounds that keep its ``uint64`` sums exact."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from fedfm.errors import ConfigError, ProtocolError
from fedfm.secagg.graph import neighbour_degree
from fedfm.secagg.layout import ArrayLayout
from fedfm.secagg.quantization import Quantizer
from fedfm.secagg.records import ConfigValue, read_float, read_int, read_str

UINT64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class ClientSettings:
    """What the server tells every client in ``advertise_keys``: how to encode its update."""

    CONFIG_NAMES: ClassVar[tuple[str, ...]] = (
        "clipping_range",
        "quantization_bits",
        "max_weight",
        "layout",
    )

    quantizer: Quantizer
    max_weight: int
    layout: ArrayLayout

    def __post_init__(self) -> None:
        check_max_weight(self.max_weight)
        if self.max_weight * self.quantizer.max_level > UINT64_MAX:
            raise ConfigError(
                f"max_weight={self.max_weight} times 2**{self.quantizer.bits} - 1 overflows "
                "uint64 even for one client"
            )

    @property
    def vector_length(self) -> int:
        """Length of a masked input: every value, plus one element for the weight."""
        return self.layout.size + 1

    def to_config(self, prefix: str) -> dict[str, ConfigValue]:
        """The settings as config entries named ``prefix + name`` for each of ``CONFIG_NAMES``."""
        return {
            f"{prefix}clipping_range": self.quantizer.clipping_range,
            f"{prefix}quantization_bits": self.quantizer.bits,
            f"{prefix}max_weight": self.max_weight,
            f"{prefix}layout": self.layout.to_json(),
        }

    @classmethod
    def from_config(
        cls, config: Mapping[str, ConfigValue], prefix: str, what: str
    ) -> ClientSettings:
        """Read :meth:`to_config` entries; :class:`ProtocolError` naming any problem."""
        try:
            return cls(
                Quantizer(
                    read_float(config, f"{prefix}clipping_range", what),
                    read_int(config, f"{prefix}quantization_bits", what),
                ),
                read_int(config, f"{prefix}max_weight", what),
                ArrayLayout.from_json(read_str(config, f"{prefix}layout", what)),
            )
        except ConfigError as error:
            raise ProtocolError(f"{what}: {error}") from error


def check_max_weight(max_weight: int) -> None:
    if isinstance(max_weight, bool) or not isinstance(max_weight, int) or max_weight < 1:
        raise ConfigError(f"max_weight must be a positive int, got {max_weight!r}")


@dataclass(frozen=True)
class RoundParameters:
    """The neighbour graph's degree and the Shamir threshold for one round's participants."""

    degree: int
    threshold: int


@dataclass(frozen=True)
class SecAggConfig:
    """Settings of secure aggregation (the server's side; clients receive what they need).

    Parameters
    ----------
    clipping_range:
        ``c``: each value is clipped to ``[-c, c]`` before quantization.
    quantization_bits:
        Values are quantized to ``[0, 2**bits - 1]``; one step is ``2c / (2**bits - 1)``, the
        bound on each averaged value's rounding error.
    max_weight:
        The largest number of training examples ``N_k`` a client may weight its update by. The
        server checks ``K * max_weight * (2**bits - 1) < 2**64`` so the masked sum never wraps.
    num_neighbours:
        ``k``, the SecAgg+ neighbour count. ``None`` (or ``>= K - 1``) uses the complete graph,
        i.e. Bonawitz et al.'s protocol. Odd ``k`` with odd ``K`` becomes ``k + 1``.
    reconstruction_threshold:
        ``t``: shares of a client's secrets (held by its neighbours only) needed to rebuild them.
        ``None`` picks ``floor(k/2) + 1``. Must satisfy ``k/2 < t <= k``: more than half, so
        that the neighbours that are told a node survived and those told it dropped cannot both
        reach ``t``.
    min_clients:
        Fewest clients whose updates may form an aggregate; the round stops with a
        :class:`ProtocolError` as soon as fewer remain.
    """

    clipping_range: float = 1.0
    quantization_bits: int = 24
    max_weight: int = 1 << 20
    num_neighbours: int | None = None
    reconstruction_threshold: int | None = None
    min_clients: int = 2

    def __post_init__(self) -> None:
        quantizer = self.quantizer  # validates clipping_range and bits
        check_max_weight(self.max_weight)
        if self.num_neighbours is not None and (
            isinstance(self.num_neighbours, bool)
            or not isinstance(self.num_neighbours, int)
            or self.num_neighbours < 2
        ):
            raise ConfigError(
                f"num_neighbours must be None or an int >= 2, got {self.num_neighbours!r}"
            )
        if self.reconstruction_threshold is not None:
            if (
                isinstance(self.reconstruction_threshold, bool)
                or not isinstance(self.reconstruction_threshold, int)
                or self.reconstruction_threshold < 1
            ):
                raise ConfigError(
                    "reconstruction_threshold must be None or a positive int, got "
                    f"{self.reconstruction_threshold!r}"
                )
            if self.num_neighbours is not None:
                check_threshold(self.reconstruction_threshold, self.num_neighbours)
        if isinstance(self.min_clients, bool) or not isinstance(self.min_clients, int):
            raise ConfigError(f"min_clients must be an int, got {self.min_clients!r}")
        if self.min_clients < 2:
            raise ConfigError(
                f"min_clients must be >= 2 (an aggregate of one client is its update), got "
                f"{self.min_clients}"
            )
        if self.max_clients < self.min_clients:
            raise ConfigError(
                f"max_weight={self.max_weight} and quantization_bits={quantizer.bits} leave room "
                f"in uint64 for {self.max_clients} clients, fewer than min_clients="
                f"{self.min_clients}"
            )

    @property
    def quantizer(self) -> Quantizer:
        return Quantizer(self.clipping_range, self.quantization_bits)

    @property
    def max_clients(self) -> int:
        """Most clients whose weighted quantized values can be summed without wrapping uint64."""
        return UINT64_MAX // (self.max_weight * self.quantizer.max_level)

    def client_settings(self, layout: ArrayLayout) -> ClientSettings:
        return ClientSettings(self.quantizer, self.max_weight, layout)

    def check_capacity(self, num_clients: int) -> None:
        """Raise :class:`ConfigError` if ``num_clients`` clients could overflow the sum."""
        if num_clients > self.max_clients:
            raise ConfigError(
                f"{num_clients} clients with max_weight={self.max_weight} and "
                f"quantization_bits={self.quantization_bits} could overflow the uint64 sum; at "
                f"most {self.max_clients} clients fit (lower the bits or max_weight)"
            )

    def round_parameters(self, num_clients: int) -> RoundParameters:
        """Degree and threshold for ``num_clients`` participants, or :class:`ConfigError`."""
        degree = neighbour_degree(num_clients, self.num_neighbours)
        threshold = self.reconstruction_threshold or degree // 2 + 1
        check_threshold(threshold, degree, num_clients=num_clients)
        return RoundParameters(degree, threshold)


def check_threshold(threshold: int, degree: int, *, num_clients: int | None = None) -> None:
    """``degree/2 < threshold <= degree``, else :class:`ConfigError` naming the problem."""
    where = f" with {num_clients} clients" if num_clients is not None else ""
    if threshold > degree:
        raise ConfigError(
            f"reconstruction_threshold={threshold} exceeds the {degree} neighbours each client "
            f"has{where}: no client's secrets could ever be rebuilt"
        )
    if 2 * threshold <= degree:
        raise ConfigError(
            f"reconstruction_threshold={threshold} is not more than half of the {degree} "
            f"neighbours{where}: a server could collect both kinds of shares of one client"
        )
