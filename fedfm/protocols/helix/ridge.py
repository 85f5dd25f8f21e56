"""The alignment HELIX learns: an affine map from the client's embeddings to the provider's.

Objective (spec 000, App. G.5), over the public samples' embeddings ``Z_B`` (client, ``N x d_B``)
and ``Z_A`` (provider, ``N x d_A``)::

    min_{W, b} || Z_B W + 1 b^T - Z_A ||_F^2 + lambda ||W||_F^2        (b not penalised)

Its solution needs only sufficient statistics: with means ``mu_B``, ``mu_A`` and centred
moments ``S_BB = Z_B^T Z_B - N mu_B mu_B^T``, ``S_BA = Z_B^T Z_A - N mu_B mu_A^T``::

    W* = (S_BB + lambda I)^-1 S_BA,      b* = mu_A - mu_B W*

which is Eq. (1) of the paper on centred embeddings, with the bias of Sec. 4.4,
``b* = (1/N) 1^T (Z_A - Z_B W*)``. The client holds ``Z_B`` (so ``Z_B^T Z_B`` and ``mu_B``);
the encrypted protocol gives it ``Z_A^T Z_B`` and the column sums of ``Z_A``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedfm.errors import ConfigError, ProtocolError


def check_ridge(ridge: float) -> float:
    """``ridge`` as a float; :class:`ConfigError` unless it is a finite positive number."""
    value = float(ridge)
    if not np.isfinite(value) or value <= 0:
        raise ConfigError(f"the ridge coefficient lambda must be > 0, got {ridge!r}")
    return value


def check_embeddings(name: str, values: np.ndarray) -> np.ndarray:
    """``values`` as a finite float64 matrix with at least one row and column."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise ConfigError(f"{name} must be a non-empty 2-D matrix, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ConfigError(f"{name} contains NaN or infinite values")
    return array


def minimum_public_samples(client_features: int) -> int:
    """Fewest public samples the provider accepts for a client with ``client_features`` columns.

    With ``N <= d_B`` samples and ``Z_B`` of rank ``N``, the client could solve
    ``Z_A = pinv(Z_B)^T (Z_A^T Z_B)^T`` exactly: the provider's public embeddings would leak, and
    the map would be fixed by ``lambda`` rather than by data. One more sample than features (and
    the intercept) is the least that keeps ``Z_A`` underdetermined.
    """
    return client_features + 2


@dataclass(frozen=True)
class AffineMap:
    """``x -> x @ weight + bias``: ``weight`` is ``d_B x d_A``, ``bias`` has ``d_A`` entries."""

    weight: np.ndarray
    bias: np.ndarray

    def apply(self, embeddings: np.ndarray) -> np.ndarray:
        """Map client embeddings (``n x d_B``) into the provider's space (``n x d_A``)."""
        values = np.asarray(embeddings, dtype=np.float64)
        if values.ndim != 2 or values.shape[1] != self.weight.shape[0]:
            raise ConfigError(
                f"the map takes {self.weight.shape[0]}-dimensional embeddings, got shape "
                f"{values.shape}"
            )
        return values @ self.weight + self.bias


@dataclass(frozen=True)
class AlignmentStatistics:
    """What the client needs to solve for the map: ``Z_B`` moments, ``Z_A^T Z_B`` and
    ``1^T Z_A``."""

    samples: int
    client_gram: np.ndarray  # Z_B^T Z_B, d_B x d_B
    client_sum: np.ndarray  # 1^T Z_B, d_B
    cross: np.ndarray  # Z_A^T Z_B, d_A x d_B
    provider_sum: np.ndarray  # 1^T Z_A, d_A

    @classmethod
    def from_client(
        cls, client_public: np.ndarray, cross: np.ndarray, provider_sum: np.ndarray
    ) -> AlignmentStatistics:
        """The client's statistics: its own embeddings plus what the provider returned."""
        client = check_embeddings("the client's public embeddings", client_public)
        cross = np.asarray(cross, dtype=np.float64)
        provider_sum = np.asarray(provider_sum, dtype=np.float64).reshape(-1)
        if cross.shape != (provider_sum.size, client.shape[1]):
            raise ProtocolError(
                f"Z_A^T Z_B has shape {cross.shape}; expected ({provider_sum.size}, "
                f"{client.shape[1]}) for {provider_sum.size} provider and {client.shape[1]} "
                "client features"
            )
        return cls(client.shape[0], client.T @ client, client.sum(axis=0), cross, provider_sum)


def fit_from_statistics(statistics: AlignmentStatistics, ridge: float) -> AffineMap:
    """``(W*, b*)`` of the module docstring from the sufficient statistics."""
    ridge = check_ridge(ridge)
    n = statistics.samples
    if n < 2:
        raise ConfigError(f"the alignment needs at least 2 public samples, got {n}")
    client_mean = statistics.client_sum / n
    provider_mean = statistics.provider_sum / n
    centred_gram = statistics.client_gram - n * np.outer(client_mean, client_mean)
    centred_cross = statistics.cross.T - n * np.outer(client_mean, provider_mean)
    system = centred_gram + ridge * np.eye(centred_gram.shape[0])
    weight = np.linalg.solve(system, centred_cross)
    return AffineMap(weight, provider_mean - client_mean @ weight)


def fit_alignment(
    client_public: np.ndarray, provider_public: np.ndarray, ridge: float
) -> AffineMap:
    """The plaintext reference: the same map computed with both parties' embeddings in hand."""
    client = check_embeddings("the client's public embeddings", client_public)
    provider = check_embeddings("the provider's public embeddings", provider_public)
    if client.shape[0] != provider.shape[0]:
        raise ConfigError(
            f"the parties embedded different numbers of public samples: {client.shape[0]} "
            f"(client) and {provider.shape[0]} (provider)"
        )
    statistics = AlignmentStatistics.from_client(client, provider.T @ client, provider.sum(axis=0))
    return fit_from_statistics(statistics, ridge)
