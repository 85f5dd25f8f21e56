"""Roles, which compute role serves which pair, and segment order (spec 002 §5.1, §5.3, §5.4).

Roles: ``coordinator`` (the inquirer of the query segment and of decoding; it owns the query),
``owner_0 .. owner_{n-1}`` (context owners; ``owner_j`` owns input segment ``j + 1``; the
coordinator's query is the last segment, §5.3), and compute roles. A compute role serves
unordered pairs of the other roles (an inquirer and a context owner); it must never be either of
them (§5.4), which the declaration's ``separated`` pairs make the runtime enforce: a node
configured to host a compute role and a role it serves is refused before anything is sent.

Plans:

``dedicated``
    One role ``compute`` serves every pair. It needs its own node: at least ``n + 2`` nodes.
``rotating``
    Three nodes that all own segments (§5.4): ``n = 2`` owners and one compute role per pair,
    each to be hosted by the third node of its pair: ``compute_owner_1_coordinator`` on
    ``owner_0``'s node (the node with the smallest highest segment index, §5.4's permanent compute
    node), ``compute_owner_0_coordinator`` on ``owner_1``'s node and ``compute_owner_0_owner_1``
    (owner_1's prefill against owner_0's segment) on the coordinator's node. ``owner_0``'s keys
    and values are therefore replicated to two compute nodes (§5.4: "the KV Cache for certain
    segments must be replicated").
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfm.errors import ConfigError

COORDINATOR = "coordinator"
DEDICATED_COMPUTE = "compute"
PLANS = ("dedicated", "rotating")


def owner_role(index: int) -> str:
    return f"owner_{index}"


@dataclass(frozen=True)
class RolePlan:
    """The roles of a run with ``owners`` context owners under compute plan ``plan``."""

    owners: int
    plan: str

    def __post_init__(self) -> None:
        if self.plan not in PLANS:
            raise ConfigError(f"compute-plan must be one of {PLANS}, got {self.plan!r}")
        if self.owners < 2:
            raise ConfigError(
                f"FedRAG needs at least 2 context owners, got {self.owners}: with one, the "
                "coordinator would learn what the attention over its segment reveals"
            )
        if self.plan == "rotating" and self.owners != 2:
            raise ConfigError(
                f"the rotating compute plan (§5.4) is for three nodes, i.e. 2 owners, got "
                f"{self.owners}; use compute-plan 'dedicated'"
            )

    @property
    def owner_roles(self) -> tuple[str, ...]:
        return tuple(owner_role(i) for i in range(self.owners))

    @property
    def inquirers(self) -> tuple[str, ...]:
        """Segment owners in sequence order: the owners, then the coordinator (§5.3)."""
        return (*self.owner_roles, COORDINATOR)

    def compute_role(self, first: str, second: str) -> str:
        """The compute role serving the pair ``{first, second}``."""
        if first == second:
            raise ConfigError(f"a pair needs two different roles, got {first!r} twice")
        if self.plan == "dedicated":
            return DEDICATED_COMPUTE
        a, b = sorted((first, second), key=self.inquirers.index)
        return f"compute_{a}_{b}"

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """(inquirer, context owner) pairs of the generation, and the re-ranking's
        (coordinator, owner) pairs (the same unordered pairs)."""
        order = self.inquirers
        return tuple((order[j], order[i]) for j in range(len(order)) for i in range(j))

    @property
    def compute_roles(self) -> tuple[str, ...]:
        found: list[str] = []
        for inquirer, owner in self.pairs:
            role = self.compute_role(inquirer, owner)
            if role not in found:
                found.append(role)
        return tuple(found)

    @property
    def roles(self) -> tuple[str, ...]:
        return (COORDINATOR, *self.owner_roles, *self.compute_roles)

    def served(self, compute: str) -> tuple[tuple[str, str], ...]:
        return tuple(pair for pair in self.pairs if self.compute_role(*pair) == compute)

    def separated(self) -> tuple[tuple[str, str], ...]:
        """A compute role never shares a node with a role whose keys it would hold (§5.4)."""
        found = []
        for compute in self.compute_roles:
            for role in sorted({r for pair in self.served(compute) for r in pair}):
                found.append((compute, role))
        return tuple(found)

    def parties_apart(self) -> tuple[tuple[str, str], ...]:
        """The coordinator and the owners are distinct institutions: no two on one node.

        This is what makes "at least three nodes" hold wherever roles are placed (a Flower
        deployment's node configs, not only :meth:`placement`): with the compute role(s) kept
        apart from the parties they serve, two nodes cannot host a run."""
        parties = self.inquirers
        return tuple((parties[j], parties[i]) for j in range(len(parties)) for i in range(j))

    def channels(self) -> tuple[tuple[str, str], ...]:
        found = list(self.pairs)
        found += [(compute, role) for compute, role in self.separated()]
        return tuple(found)

    def minimum_nodes(self) -> int:
        return self.owners + 2 if self.plan == "dedicated" else 3

    def placement(self, nodes: int) -> list[frozenset[str]]:
        """A valid placement of the roles on ``nodes`` nodes, or :class:`ConfigError`."""
        if nodes < 3:
            raise ConfigError(
                f"FedRAG needs at least three nodes (§5.4: the compute node must be neither the "
                f"inquirer nor the context owner), got {nodes}"
            )
        if nodes < self.minimum_nodes():
            raise ConfigError(
                f"the {self.plan} compute plan with {self.owners} owners needs "
                f"{self.minimum_nodes()} nodes, got {nodes}"
                + (" (use compute-plan 'rotating' with three nodes)" if nodes == 3 else "")
            )
        if self.plan == "rotating":
            first, second = self.owner_roles
            return [
                frozenset({COORDINATOR, self.compute_role(first, second)}),
                frozenset({first, self.compute_role(COORDINATOR, second)}),
                frozenset({second, self.compute_role(COORDINATOR, first)}),
            ]
        roles = [frozenset({role}) for role in self.roles]
        return roles + [frozenset()] * (nodes - len(roles))
