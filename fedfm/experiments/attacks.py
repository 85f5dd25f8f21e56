"""Model-extraction attacks from a curious client's view of the double-blind protocol (App. C).

A semi-honest client follows the protocol but keeps everything it decrypts. Per batch and round it
holds, in plaintext, every block's output ``b_l`` with rows in the server's order ``pi_l`` (which
it never receives), the relative permutations ``wrap = pi_L^{-1} pi_1`` and
``steps[l-1] = pi_l^{-1} pi_{l+1}`` and, in evaluation, its labels in order ``pi_{L+1}``. It also
knows its own images, and which of them an evaluation batch holds: the server sends every
held-out sample once, in batches ``np.array_split(arange(N_eval), N_eval // n)`` (only the order
within a batch is hidden, by ``pi_l``).

:class:`CuriousClient` collects that view from a run
(:func:`fedfm.experiments.observed.run_observed`). The attacks fit what the client could learn about
the server's model and report the coefficient of determination ``R^2 = 1 - SSE / SST`` on held-out
samples, with ``SST`` taken around the per-token means of the fitting data (so the position
embeddings alone score 0):

(a) :func:`embedding_block1_attack`: the embedding plus block 1, ``x -> b_1``, by ridge regression
    from each image patch to its token of ``b_1`` (one map shared by all tokens plus per-token
    means), pairing the evaluation batches' images with the received rows *in the order received*.
    With permutations off (``DoubleBlindConfig(permute=False)``, a debug switch) the pairs are
    right; with them, row ``j`` holds sample ``pi_1[j]`` and the fit fails.
    :func:`align_rows` goes further and undoes the permutation from the data: it alternates
    fitting that map and re-matching rows to images (Hungarian algorithm), from a few random
    starts. With ``use_labels`` it first restricts matches to rows of the same class: the client
    knows the label of every received row (evaluation labels arrive in order ``pi_{L+1}`` and the
    steps move them to ``pi_1``; in training the logit gradient ``(p - y)/n`` gives them too) and
    of each of its images, so only permutations within a class remain, far fewer than ``n!``.
    :func:`recovered_orders` then rebuilds every absolute ``pi_l`` of the evaluation batches and
    :func:`identify_training_rows` which training image each training row holds.
(b) :func:`block_attack`: block ``l >= 2`` from the pairs ``(b_{l-1}, b_l)`` that ``steps`` align
    row by row (the adapter needs exactly this alignment, so the protocol must give it): ridge
    regression (and a small MLP) per token from ``[b_{l-1}[t], mean_t b_{l-1}]`` to the block's
    residual ``b_l - b_{l-1}``, fitted on training-round pairs and tested on evaluation-round
    pairs (disjoint samples). Proposition 1 does not cover this: the permutations hide which
    sample a row is, not which rows of consecutive blocks belong together.

:func:`permutation_exposure` checks the permutation claim itself: every integer array a client
receives is a relative permutation and none equals an absolute ``pi_l`` the server drew.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from fedfm.crypto.backend import CryptoBackend
from fedfm.errors import ConfigError, InvariantError, ProtocolError
from fedfm.experiments.observed import BLOCK_MESSAGES, DrawnBatches
from fedfm.protocols.double_blind.client import KEPT, ClientData, ClientState
from fedfm.protocols.double_blind.config import EVALUATE_BLOCK, TRAIN_SECAGG
from fedfm.protocols.double_blind.messages import SIZE_ARRAYS, BlockRequest
from fedfm.protocols.double_blind.permutation import relative
from fedfm.runtime.transport import Envelope


@dataclass(frozen=True)
class BatchView:
    """One batch as the client holds it after the last block of a round.

    ``blocks[l-1]`` is ``b_l`` with rows in order ``pi_l``; ``labels`` (evaluation only) are the
    decrypted labels in order ``pi_{L+1}``.
    """

    kind: str
    round: int
    index: int
    blocks: list[np.ndarray]
    wrap: np.ndarray
    steps: np.ndarray
    labels: np.ndarray | None = None

    def labels_in_block_order(self, block: int) -> np.ndarray:
        """The labels moved from order ``pi_{L+1}`` to ``pi_block`` with the received steps."""
        if self.labels is None:
            raise ProtocolError("training views carry no labels")
        # X[pi_{L+1}] = X[pi_b][s_b][s_{b+1}]...[s_L]: compose, then invert
        order = np.arange(len(self.labels))
        for step in self.steps[block - 1 :][::-1]:
            order = step[order]
        return self.labels[np.argsort(order)]


@dataclass
class CuriousClient:
    """An observer keeping everything one client receives and decrypts.

    ``integer_arrays`` holds the integer arrays of the adaptation's messages; the SecAgg stages'
    (``train.secagg``: node ids, public keys, share ciphertexts, all of the aggregation) are left
    out of it.
    """

    node_id: int
    backend: CryptoBackend
    views: list[BatchView] = field(default_factory=list)
    integer_arrays: list[tuple[str, int, str, np.ndarray]] = field(default_factory=list)
    config_keys: set[str] = field(default_factory=set)

    def __call__(self, node: int, request: Envelope, reply: Envelope, state: ClientState) -> None:
        if node != self.node_id:
            return
        self.config_keys |= set(request.config)
        adaptation_arrays = {} if request.message_type == TRAIN_SECAGG else request.arrays
        for key, value in adaptation_arrays.items():
            if (
                np.asarray(value).dtype.kind in "iu"
                and not key.endswith("key_id")
                and key not in SIZE_ARRAYS  # the batches' public sizes
            ):
                self.integer_arrays.append((request.message_type, request.round, key, value))
        if request.message_type not in BLOCK_MESSAGES:
            return
        block, num_blocks = int(request.config["block"]), int(request.config["num_blocks"])
        if block != num_blocks:
            return
        count = int(request.config["num_batches"])
        # held-out batches: all of an evaluation's, the last ones of a training round they
        # ride along (the client then keeps them under ``kept``, the training ones stay)
        riding = int(request.config.get("evaluation_batches", 0))
        training = 0 if request.message_type == EVALUATE_BLOCK else count - riding
        labels: list[np.ndarray | None] = [None] * count
        if training < count:
            key_owner = self.backend.restore_key_owner(state.group("key"))
            packed = BlockRequest.from_envelope(request, key_owner.load)
            rows = np.concatenate([key_owner.decrypt(batch) for batch in packed.labels])
            splits = np.cumsum(packed.batch_sizes)[:-1]
            labels = [part.argmax(axis=1) for part in np.split(rows, splits)]
        for i in range(count):
            kind, index = ("train", i) if i < training else ("evaluate", i - training)
            source = state if i < training or training == 0 else _kept(state)
            perms = source.group("perm")
            blocks = [source.group(f"block{b}")[str(index)] for b in range(1, num_blocks + 1)]
            self.views.append(
                BatchView(
                    kind,
                    request.round,
                    index,
                    blocks,
                    perms[f"wrap.{index}"],
                    perms[f"steps.{index}"],
                    labels[i] if kind == "evaluate" else None,
                )
            )

    def evaluation_views(self, server_round: int | None = None) -> list[BatchView]:
        """Evaluation batches of one round (the first by default), in batch order."""
        rounds = sorted({v.round for v in self.views if v.kind == "evaluate"})
        if not rounds:
            raise ProtocolError(f"node {self.node_id} received no evaluation batch")
        chosen = rounds[0] if server_round is None else server_round
        return [v for v in self.views if v.kind == "evaluate" and v.round == chosen]


def _kept(state: ClientState) -> ClientState:
    """The held-out outputs a client keeps, as a state whose groups are theirs."""
    return replace(state, arrays=state.group(KEPT))


def evaluation_batches(num_eval: int, batch_size: int) -> list[np.ndarray]:
    """The server's public rule for evaluation batches: every held-out sample once, in order."""
    return list(np.array_split(np.arange(num_eval), num_eval // batch_size))


# -- regression -----------------------------------------------------------------------------------
def patches(images: np.ndarray, num_patches: int) -> np.ndarray:
    """Images ``(N, C, H, W)`` cut into a square grid of ``num_patches``: ``(N, P, C p p)``."""
    count, channels, height, width = images.shape
    grid = round(num_patches**0.5)
    if grid * grid != num_patches or height % grid or width % grid or height != width:
        raise ConfigError(f"{num_patches} tokens do not tile {height}x{width} images")
    p = height // grid
    cut = images.reshape(count, channels, grid, p, grid, p).transpose(0, 2, 4, 1, 3, 5)
    return cut.reshape(count, num_patches, channels * p * p)


@dataclass(frozen=True)
class TokenRegression:
    """A map shared by all tokens plus per-token means: ``y[t] = (x[t] - mx[t]) W + my[t]``."""

    weight: np.ndarray
    mean_x: np.ndarray
    mean_y: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, *, ridge: float = 1e-2) -> TokenRegression:
        """Ridge fit on ``x (N, T, F)``, ``y (N, T, D)``; ``ridge`` relative to mean variance."""
        mean_x, mean_y = x.mean(axis=0), y.mean(axis=0)
        a = (x - mean_x).reshape(-1, x.shape[-1]).astype(np.float64)
        b = (y - mean_y).reshape(-1, y.shape[-1]).astype(np.float64)
        gram = a.T @ a
        penalty = ridge * np.trace(gram) / len(gram)
        weight = np.linalg.solve(gram + penalty * np.eye(len(gram)), a.T @ b)
        return cls(weight, mean_x, mean_y)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return (x - self.mean_x) @ self.weight + self.mean_y


def r_squared(truth: np.ndarray, predicted: np.ndarray, mean: np.ndarray) -> float:
    """``1 - SSE / SST`` with ``SST`` around ``mean`` (the fitting data's per-token means)."""
    total = float(((truth - mean) ** 2).sum())
    return 1.0 - float(((truth - predicted) ** 2).sum()) / total if total > 0 else float("nan")


# -- (a) embedding + block 1 ---------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddingPairs:
    """Images and received ``b_1`` rows of the evaluation batches, in received order."""

    images: np.ndarray  # (N, C, H, W), row i paired with outputs[i] by the naive attack
    outputs: np.ndarray  # (N, P, D): b_1 without the class token
    labels: np.ndarray  # the images' labels (the client's own)
    row_labels: np.ndarray  # the received rows' labels (from the permuted evaluation labels)
    batch: np.ndarray  # batch number of each pair


def embedding_pairs(client: CuriousClient, data: ClientData, batch_size: int) -> EmbeddingPairs:
    """The naive pairing: image ``split[k][j]`` with row ``j`` of ``b_1`` of evaluation batch
    ``k``."""
    views = client.evaluation_views()
    split = evaluation_batches(len(data.eval_labels), batch_size)
    if len(views) != len(split):
        raise ProtocolError(f"{len(views)} evaluation batches received, expected {len(split)}")
    images, outputs, labels, row_labels, batch = [], [], [], [], []
    for number, (view, members) in enumerate(zip(views, split, strict=True)):
        images.append(data.eval_images[members])
        outputs.append(view.blocks[0][:, 1:])  # drop the class token
        labels.append(data.eval_labels[members])
        row_labels.append(view.labels_in_block_order(1))
        batch.append(np.full(len(members), number))
    return EmbeddingPairs(
        np.concatenate(images),
        np.concatenate(outputs),
        np.concatenate(labels),
        np.concatenate(row_labels),
        np.concatenate(batch),
    )


def _split_samples(count: int, seed: int, fit_fraction: float = 2 / 3) -> tuple[np.ndarray, ...]:
    order = np.random.default_rng(seed).permutation(count)
    cut = round(count * fit_fraction)
    return np.sort(order[:cut]), np.sort(order[cut:])


def embedding_block1_attack(
    pairs: EmbeddingPairs, *, seed: int = 0, ridge: float = 1e-2
) -> dict[str, float]:
    """Fit ``patch -> b_1 token`` on 2/3 of the pairs, ``R^2`` on the rest (as paired)."""
    x = patches(pairs.images, pairs.outputs.shape[1])
    fit, test = _split_samples(len(x), seed)
    model = TokenRegression.fit(x[fit], pairs.outputs[fit], ridge=ridge)
    return {
        "r2_held_out": r_squared(pairs.outputs[test], model.predict(x[test]), model.mean_y),
        "r2_fit": r_squared(pairs.outputs[fit], model.predict(x[fit]), model.mean_y),
        "pairs": float(len(x)),
    }


@dataclass(frozen=True)
class Alignment:
    """The label-aware attack's outcome: ``matched[i]`` is the row it pairs with image ``i``."""

    matched: np.ndarray
    model: TokenRegression
    log2_candidates_with_labels: float
    log2_candidates_without_labels: float


def _log2_factorial(count: int) -> float:
    return float(np.log2(np.arange(1, count + 1)).sum())


def align_rows(
    pairs: EmbeddingPairs,
    *,
    iterations: int = 10,
    restarts: int = 5,
    use_labels: bool = True,
    seed: int = 0,
    ridge: float = 1e-2,
) -> Alignment:
    """Re-pair images and rows using the labels the client learns, then refine by fitting.

    Starts from a random matching within (batch, label) groups (``use_labels=False``: within
    whole batches), then alternates: fit the patch-to-token map on the fitting images (2/3 of
    them), re-match each group's rows to images by minimum squared error (Hungarian algorithm).
    Of ``restarts`` random starts it keeps the one whose final map fits its matching best (the
    client's own criterion: no ground truth involved).
    """
    if restarts < 1 or iterations < 0:
        raise ConfigError(f"need restarts >= 1 and iterations >= 0, got {restarts}, {iterations}")
    x = patches(pairs.images, pairs.outputs.shape[1])
    rng = np.random.default_rng(seed)
    labels = pairs.labels if use_labels else np.zeros_like(pairs.labels)
    row_labels = pairs.row_labels if use_labels else np.zeros_like(pairs.row_labels)
    groups = []
    for number in np.unique(pairs.batch):
        for label in np.unique(labels[pairs.batch == number]):
            images = np.flatnonzero((pairs.batch == number) & (labels == label))
            rows = np.flatnonzero((pairs.batch == number) & (row_labels == label))
            if len(images) != len(rows):
                raise ProtocolError("received labels disagree with the client's own labels")
            groups.append((images, rows))
    fit, _ = _split_samples(len(x), seed)
    flat = pairs.outputs.reshape(len(x), -1)
    best: tuple[float, np.ndarray, TokenRegression] | None = None
    for _ in range(restarts):
        matched = np.empty(len(x), dtype=np.int64)
        for images, rows in groups:
            matched[images] = rng.permutation(rows)
        for _ in range(iterations):
            model = TokenRegression.fit(x[fit], pairs.outputs[matched[fit]], ridge=ridge)
            predicted = model.predict(x).reshape(len(x), -1)
            for images, rows in groups:
                cost = ((predicted[images, None, :] - flat[None, rows, :]) ** 2).sum(axis=2)
                assigned, chosen = linear_sum_assignment(cost)
                matched[images[assigned]] = rows[chosen]
        model = TokenRegression.fit(x[fit], pairs.outputs[matched[fit]], ridge=ridge)
        error = float(((model.predict(x).reshape(len(x), -1) - flat[matched]) ** 2).sum())
        if best is None or error < best[0]:
            best = (error, matched, model)
    if best is None:
        raise InvariantError("no restart ran (restarts >= 1 is checked)")
    _, matched, model = best
    batches = np.unique(pairs.batch)
    return Alignment(
        matched=matched,
        model=model,
        log2_candidates_with_labels=sum(_log2_factorial(len(r)) for _, r in groups) / len(batches)
        if use_labels
        else float("nan"),
        log2_candidates_without_labels=sum(
            _log2_factorial(int((pairs.batch == b).sum())) for b in batches
        )
        / len(batches),
    )


def alignment_metrics(
    pairs: EmbeddingPairs, alignment: Alignment, true_rows: np.ndarray, *, seed: int = 0
) -> dict[str, float]:
    """Share of images matched to their true row, and the fitted map's held-out ``R^2`` against
    the true rows (``true_rows`` is an oracle from the server's record, for measurement only)."""
    x = patches(pairs.images, pairs.outputs.shape[1])
    _, test = _split_samples(len(x), seed)
    truth = pairs.outputs[true_rows]
    model = alignment.model
    return {
        "matched_correctly": float(np.mean(alignment.matched == true_rows)),
        "r2_held_out": r_squared(truth[test], model.predict(x[test]), model.mean_y),
        "log2_candidates_with_labels": alignment.log2_candidates_with_labels,
        "log2_candidates_without_labels": alignment.log2_candidates_without_labels,
    }


def recovered_orders(
    pairs: EmbeddingPairs, alignment: Alignment, views: Sequence[BatchView]
) -> list[list[np.ndarray]]:
    """The absolute ``pi_1 .. pi_{L+1}`` of each evaluation batch, as the client reconstructs
    them: ``pi_1`` from the matching (row ``r`` holds batch member ``pi_1[r]``), the others by
    chaining the received steps (``pi_{l+1} = pi_l[steps[l-1]]``)."""
    orders = []
    for number, view in enumerate(views):
        members = np.flatnonzero(pairs.batch == number)
        offset = members.min()
        first = np.empty(len(members), dtype=np.int64)
        first[alignment.matched[members] - offset] = members - offset
        chain = [first]
        for step in view.steps:
            chain.append(chain[-1][step])
        orders.append(chain)
    return orders


def identify_training_rows(
    client: CuriousClient, data: ClientData, model: TokenRegression
) -> list[np.ndarray]:
    """For each training batch received, which training image each row of ``b_1`` holds, by
    matching the rows to the map's predictions for all training images (Hungarian)."""
    train = [v for v in client.views if v.kind == "train"]
    if not train:
        return []
    tokens = train[0].blocks[0].shape[1] - 1
    predicted = model.predict(patches(data.train_images, tokens)).reshape(
        len(data.train_images), -1
    )
    identified = []
    for view in train:
        rows = view.blocks[0][:, 1:].reshape(len(view.blocks[0]), -1)
        cost = ((rows[:, None, :] - predicted[None, :, :]) ** 2).sum(axis=2)
        row_index, image_index = linear_sum_assignment(cost)
        found = np.empty(len(rows), dtype=np.int64)
        found[row_index] = image_index
        identified.append(found)
    return identified


def true_rows_of(drawn: Sequence[DrawnBatches], node_id: int, server_round: int) -> np.ndarray:
    """Oracle: for each pair's image, the received row holding it (from the server's ``pi_1``)."""
    batches = [
        d
        for d in drawn
        if d.kind == "evaluate" and d.round == server_round and d.node_id == node_id
    ]
    if len(batches) != 1:
        raise ProtocolError(
            f"expected one recorded evaluation draw for node {node_id} in round {server_round}"
        )
    rows, offset = [], 0
    for perms in batches[0].permutations:
        order = perms.after_block(1)  # row j holds batch member order[j]
        rows.append(offset + np.argsort(order))
        offset += len(order)
    return np.concatenate(rows)


# -- (b) block l >= 2 from aligned consecutive outputs -------------------------------------------
def block_pairs(
    views: Sequence[BatchView], block: int, *, aligned: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """``(b_{l-1}, b_l)`` row pairs; ``aligned`` applies ``steps[l-2]`` to ``b_{l-1}``."""
    if block < 2:
        raise ConfigError("block pairs start at block 2 (block 1's input is the embedding)")
    inputs, outputs = [], []
    for view in views:
        previous = view.blocks[block - 2]
        inputs.append(previous[view.steps[block - 2]] if aligned else previous)
        outputs.append(view.blocks[block - 1])
    return np.concatenate(inputs), np.concatenate(outputs)


def _token_features(hidden: np.ndarray) -> np.ndarray:
    """Each token with the mean over tokens (a crude summary of what attention mixes in)."""
    mean = np.broadcast_to(hidden.mean(axis=1, keepdims=True), hidden.shape)
    return np.concatenate([hidden, mean], axis=2)


def _mlp_r2(
    x_fit: np.ndarray,
    y_fit: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    hidden: int = 256,
    steps: int = 400,
    seed: int = 0,
) -> float:
    """A per-token MLP (shared across tokens, per-token means removed) trained with MSE."""
    mean_x, mean_y = x_fit.mean(axis=0), y_fit.mean(axis=0)
    scale = float(np.sqrt(((x_fit - mean_x) ** 2).mean())) or 1.0
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = torch.nn.Sequential(
            torch.nn.Linear(x_fit.shape[-1], hidden),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, y_fit.shape[-1]),
        )
    inputs = torch.from_numpy(((x_fit - mean_x) / scale).reshape(-1, x_fit.shape[-1])).float()
    targets = torch.from_numpy((y_fit - mean_y).reshape(-1, y_fit.shape[-1])).float()
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(steps):
        chosen = torch.randint(len(inputs), (min(1024, len(inputs)),), generator=generator)
        loss = torch.nn.functional.mse_loss(net(inputs[chosen]), targets[chosen])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        test = torch.from_numpy(((x_test - mean_x) / scale).reshape(-1, x_test.shape[-1])).float()
        predicted = net(test).numpy().reshape(y_test.shape) + mean_y
    return r_squared(y_test, predicted, mean_y)


def block_attack(
    client: CuriousClient,
    block: int,
    *,
    aligned: bool = True,
    mlp: bool = False,
    ridge: float = 1e-2,
    seed: int = 0,
) -> dict[str, float]:
    """Fit block ``block``'s residual on training-round pairs; ``R^2`` on evaluation pairs.

    ``r2_residual``: linear map per token from ``[b_{l-1}[t], mean_t b_{l-1}]`` to
    ``b_l[t] - b_{l-1}[t]``; ``r2_residual_mlp`` the same with a small MLP; ``r2_output``: the
    linear fit's prediction of ``b_l`` itself (the identity path makes this easy). With
    ``aligned=False`` (the control: rows paired as received, without the step) only
    ``r2_output`` is reported.
    """
    train = [v for v in client.views if v.kind == "train"]
    evaluate = [v for v in client.views if v.kind == "evaluate"]
    if not train or not evaluate:
        raise ProtocolError("the block attack needs training and evaluation views")
    x_fit, y_fit = block_pairs(train, block, aligned=aligned)
    x_test, y_test = block_pairs(evaluate, block, aligned=aligned)
    features_fit, features_test = _token_features(x_fit), _token_features(x_test)
    residual_fit, residual_test = y_fit - x_fit, y_test - x_test
    model = TokenRegression.fit(features_fit, residual_fit, ridge=ridge)
    predicted = model.predict(features_test)
    result = {
        "r2_output": r_squared(y_test, x_test + predicted, y_fit.mean(axis=0)),
        "fit_pairs": float(len(x_fit)),
        "test_pairs": float(len(x_test)),
    }
    if not aligned:  # the "residual" of a misaligned pair is mostly the input row negated
        return result
    result["r2_residual"] = r_squared(residual_test, predicted, model.mean_y)
    if mlp:
        result["r2_residual_mlp"] = _mlp_r2(
            features_fit, residual_fit, features_test, residual_test, seed=seed
        )
    return result


# -- permutations the client receives ------------------------------------------------------------
def permutation_exposure(client: CuriousClient, drawn: Sequence[DrawnBatches]) -> dict[str, int]:
    """Compare every integer array the client received with the server's permutations.

    Returns counts: ``received`` integer arrays, how many are ``relative`` permutations of the
    same batch (``wrap`` or a row of ``steps``), and ``absolute_hits``: arrays (or rows) equal to
    any ``pi_l`` the server drew for this client in any round.
    """
    mine = [d for d in drawn if d.node_id == client.node_id]
    absolute = {p.tobytes() for d in mine for perms in d.permutations for p in perms.orders}
    relatives = set()
    for d in mine:
        for perms in d.permutations:
            view = perms.client_view()
            relatives.add(view["wrap"].tobytes())
            relatives.update(row.tobytes() for row in view["steps"])
    received = relative_rows = hits = 0
    for _, _, _, array in client.integer_arrays:
        rows = np.atleast_2d(np.asarray(array, dtype=np.int64))
        for row in rows:
            received += 1
            relative_rows += row.tobytes() in relatives
            hits += row.tobytes() in absolute
    return {"received": received, "relative": relative_rows, "absolute_hits": hits}


def relative_views_equal_under(orders: Sequence[np.ndarray], shift: np.ndarray) -> bool:
    """Proposition 1: ``S pi_l`` (``shift[pi_l]``) gives the same relatives as ``pi_l``."""
    for a, b in itertools.pairwise(orders):
        if not np.array_equal(relative(a, b), relative(shift[a], shift[b])):
            return False
    return np.array_equal(
        relative(orders[-2], orders[0]), relative(shift[orders[-2]], shift[orders[0]])
    )
