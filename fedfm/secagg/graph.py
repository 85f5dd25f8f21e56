"""The SecAgg+ neighbour graph: who shares keys and pairwise masks with whom.

Bell et al. (2020) replace Bonawitz et al.'s complete graph by a sparse random graph, so each
client does work proportional to its number of neighbours ``k`` instead of ``K - 1``. Here the
server draws a Harary graph (each node joined to the ``k/2`` nodes on either side of it on a
cycle, plus the opposite node when ``k`` is odd) over a uniformly random ordering of the
participants, fresh every round. The graph is ``k``-regular; ``k`` odd with ``K`` odd has no
regular graph, so there the degree is raised to ``k + 1``.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Sequence

from fedfm.errors import ConfigError

Graph = dict[int, tuple[int, ...]]


def neighbour_degree(num_clients: int, num_neighbours: int | None) -> int:
    """The degree of every node in a round with ``num_clients`` clients.

    ``num_neighbours=None`` or ``>= num_clients - 1`` gives the complete graph (plain
    Bonawitz et al.).
    """
    if num_clients < 2:
        raise ConfigError(f"a neighbour graph needs at least 2 clients, got {num_clients}")
    if num_neighbours is None or num_neighbours >= num_clients - 1:
        return num_clients - 1
    if num_neighbours % 2 == 1 and num_clients % 2 == 1:
        return num_neighbours + 1
    return num_neighbours


def harary_graph(ordered_ids: Sequence[int], degree: int) -> Graph:
    """The Harary graph of ``degree`` over ``ordered_ids`` in the given cyclic order.

    ``degree`` must be what :func:`neighbour_degree` returns (odd only when the number of nodes
    is even); every node then has exactly ``degree`` distinct neighbours.
    """
    count = len(ordered_ids)
    if len(set(ordered_ids)) != count:
        raise ConfigError("node ids in a neighbour graph must be distinct")
    if not 1 <= degree <= count - 1 or (degree % 2 == 1 and count % 2 == 1):
        raise ConfigError(f"no {degree}-regular Harary graph on {count} nodes")
    offsets = set(range(1, degree // 2 + 1)) | {count - d for d in range(1, degree // 2 + 1)}
    if degree % 2 == 1:
        offsets.add(count // 2)
    return {
        node: tuple(sorted(ordered_ids[(position + offset) % count] for offset in offsets))
        for position, node in enumerate(ordered_ids)
    }


def random_neighbour_graph(node_ids: Collection[int], degree: int) -> Graph:
    """A Harary graph of ``degree`` over a uniformly random ordering of ``node_ids``.

    The ordering comes from the operating system's generator: a predictable graph would let
    colluding clients arrange to surround an honest one.
    """
    order = sorted(node_ids)
    secrets.SystemRandom().shuffle(order)
    return harary_graph(order, degree)
