"""Baselines over the same data and model as double-blind adaptation (spec ``001`` App. A, D).

Three methods, one harness for the data: every method reads its clients from
:func:`~fedfm.protocols.double_blind.runner.federation_data` (same partitions, same train/held-out
split per client), starts from the same FHE-friendly student and reports the same
:class:`~fedfm.protocols.double_blind.driver.RoundRecord` history, with balanced accuracy (the
paper's metric) over the union of the clients' held-out data.

``ours``
    The double-blind protocol with low-rank parallel side adapters and a head
    (:func:`~fedfm.protocols.double_blind.runner.run_in_process`).
``linear-probe``
    The same protocol with ``rank=0``: no adapter, the head reads ``B_L`` (transfer learning in
    the same harness: same encryption flow, permutations, round trips and optimiser).
``full-finetune``
    Vanilla federated adaptation (App. A) with plain FedAvg: each client holds a *plaintext copy of
    the whole model* (so neither data nor model privacy holds; a baseline only), fine-tunes every
    weight and returns them for the weighted average of Eq. 7.

Full fine-tuning sees the same samples per round as ours: each client draws ``batches_per_round``
batches of ``batch_size`` samples from its training data (without replacement, seeded like the
protocol's server). By default (``local_steps="batch"``, vanilla FedAvg) it takes one SGD step with
momentum per batch; ``local_steps="round"`` takes one step on the batches' mean loss instead,
exactly as the protocol's client updates its adapter (a single encrypted loss per round). The
momentum buffer stays on the client between rounds, as in the protocol. Clients with fewer
training (held-out) samples than a batch sit out training (evaluation), as in the protocol. The
head is the student's own classifier re-initialised (seeded) for the task's classes (the
adapter's head starts fresh too). The learning rate follows the paper's ratio (App. D.2: SGD
0.001 for linear probing and ours, ``5e-5`` for full fine-tuning, 20 times smaller): fedfm's
protocol default is 0.05 (the paper's 0.001 scaled up for 20 rounds of a single step), hence
:data:`DEFAULT_FINETUNE_LR` = 0.0025.

Every method runs its plaintext torch on one device (``device``: ``auto``, ``cpu``, ``cuda``,
``cuda:N``, see :mod:`fedfm.models.device`); full fine-tuning may add bf16 autocast on a GPU
(``precision="bf16"``, opt-in). The protocol's methods never use mixed precision.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedfm.crypto.randomness import ResearchStream
from fedfm.data import DataSplits
from fedfm.errors import ConfigError
from fedfm.models.device import MixedPrecision, mixed_precision, resolve_device, to_numpy
from fedfm.models.fhe_vit import FheViT
from fedfm.protocols.double_blind.adapter import SideAdapterHead
from fedfm.protocols.double_blind.client import ClientData
from fedfm.protocols.double_blind.config import DoubleBlindConfig, revealed_blocks
from fedfm.protocols.double_blind.driver import RoundRecord, RunState, load_state, save_state
from fedfm.protocols.double_blind.policy import DataOwnerPolicy
from fedfm.protocols.double_blind.runner import Federation, federation_data, run_in_process
from fedfm.protocols.double_blind.server import balanced_accuracy
from fedfm.runtime.transport import InProcessTransport

METHODS: tuple[str, ...] = ("ours", "linear-probe", "full-finetune")
DEFAULT_FINETUNE_LR = 0.0025
LOCAL_STEPS: tuple[str, ...] = ("batch", "round")


@dataclass(frozen=True)
class FineTuneConfig:
    """Optimiser of the full fine-tuning baseline (the rest comes from the protocol's config).

    ``local_steps``: ``"batch"`` (one SGD step per batch, vanilla FedAvg) or ``"round"`` (one
    step per round on the mean loss of the round's batches, the protocol's schedule).
    """

    lr: float = DEFAULT_FINETUNE_LR
    momentum: float = 0.9
    local_steps: str = "batch"

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"learning rate must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.local_steps not in LOCAL_STEPS:
            raise ConfigError(
                f"local_steps must be one of {list(LOCAL_STEPS)}, got {self.local_steps!r}"
            )


# The data owners of an in-process experiment, all played by one researcher: they accept what
# the experiment runs (the plaintext ``simulate`` backend, a single client without secure
# aggregation). Their server draws from ``ResearchStream(seed)`` (reproducible, not secret).
# Right for measuring the protocol, never for a run with other parties.
RESEARCHER_POLICY = DataOwnerPolicy(allow_plaintext=True, require_secure_aggregation=False)


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"unknown adaptation method {method!r}; choose one of {list(METHODS)}")


def run_linear_probe(
    model: FheViT,
    splits: DataSplits,
    config: DoubleBlindConfig,
    federation: Federation,
    *,
    seed: int = 0,
    checkpoint_dir: Path | None = None,
    log: Callable[[str], None] = print,
    device: str | torch.device | None = "auto",
) -> tuple[list[RoundRecord], InProcessTransport]:
    """Linear probing in the protocol's harness: ``config`` with ``rank=0``."""
    return run_in_process(
        model,
        splits,
        replace(config, rank=0),
        federation,
        checkpoint_dir=checkpoint_dir,
        log=log,
        policy=RESEARCHER_POLICY,
        randomness=ResearchStream(seed),
        device=device,
    )


def finetune_model(student: FheViT, num_classes: int, *, seed: int) -> FheViT:
    """A copy of ``student`` whose classifier is re-initialised (seeded) for ``num_classes``."""
    model = copy.deepcopy(student)
    vit = model.vit
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        vit.reset_classifier(num_classes)
    return model


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def weighted_average(
    states: list[dict[str, torch.Tensor]], weights: list[int]
) -> dict[str, torch.Tensor]:
    """Eq. 7: ``sum_k N_k / N * state_k`` for floating tensors; others taken from the first."""
    total = float(sum(weights))
    averaged = {}
    for name, first in states[0].items():
        if not first.is_floating_point():
            averaged[name] = first.clone()
            continue
        value = torch.zeros_like(first)
        for state, weight in zip(states, weights, strict=True):
            value += state[name] * (weight / total)
        averaged[name] = value
    return averaged


def _confusion(
    model: FheViT, data: ClientData, num_classes: int, precision: MixedPrecision
) -> np.ndarray:
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    model.eval()
    device = precision.device
    with torch.no_grad(), precision.autocast():
        images = torch.from_numpy(data.eval_images)
        predicted = to_numpy(
            torch.cat(
                [
                    model(images[i : i + 128].to(device)).argmax(dim=1)
                    for i in range(0, len(images), 128)
                ]
            )
        )
    np.add.at(confusion, (data.eval_labels, predicted), 1)
    return confusion


def run_full_finetune(
    student: FheViT,
    splits: DataSplits,
    config: DoubleBlindConfig,
    federation: Federation,
    *,
    finetune: FineTuneConfig | None = None,
    seed: int = 0,
    checkpoint_dir: Path | None = None,
    log: Callable[[str], None] = print,
    device: str | torch.device | None = "auto",
    precision: str = "off",
) -> tuple[list[RoundRecord], FheViT]:
    """Vanilla FedAvg full fine-tuning of a copy of ``student`` (plaintext, a baseline).

    Returns the history and the final global model on the CPU (``student`` itself is not
    modified). The copy trains on ``device``; ``precision="bf16"`` adds bf16 autocast there (a
    GPU only; fp16 would need a loss scaler this manual SGD does not have, so it is refused).

    Uses ``config``'s rounds, batch size, batches per round and held-out fraction, and ``seed``
    for the batch draws and the head; the adapter settings and the learning rate of ``config``
    do not apply (see ``finetune``).
    """
    finetune = finetune or FineTuneConfig()
    if precision == "fp16":
        raise ConfigError("full fine-tuning takes precision off or bf16, not fp16 (no loss scaler)")
    target = resolve_device(device)
    amp = mixed_precision(precision, target, log=log)
    num_classes = splits.pool.num_classes
    datasets = federation_data(splits, federation, config)
    model = finetune_model(student, num_classes, seed=seed).to(target)
    identity = {
        "method": "full-finetune",
        "seed": seed,
        "config": config.to_config(),
        "federation": asdict(federation),
        "finetune": asdict(finetune),
        **({"precision": amp.mode} if amp.enabled else {}),
    }
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    history: list[RoundRecord] = []
    start_round = 1
    rng = np.random.default_rng(seed)
    saved = load_state(checkpoint_dir, identity) if checkpoint_dir is not None else None
    if saved is not None:
        global_state = {k: torch.from_numpy(v).to(target) for k, v in saved.global_arrays.items()}
        history, start_round = saved.history, saved.round + 1
        rng.bit_generator.state = saved.rng_state
        log(f"[fedfm] resuming after round {saved.round} from {checkpoint_dir}")
    momenta: dict[int, list[torch.Tensor]] = {}
    n = config.batch_size
    log(
        f"[fedfm] full fine-tuning (plaintext FedAvg baseline): {len(datasets)} clients, "
        f"{config.rounds} rounds, batch {n} x {config.batches_per_round}, lr {finetune.lr}, "
        f"on {target} (mixed precision: {amp.describe()})"
    )
    for server_round in range(start_round, config.rounds + 1):
        started = time.perf_counter()
        states, weights, losses = [], [], []
        for client, data in enumerate(datasets):
            total = len(data.train_labels)
            if total < n:
                continue
            count = min(config.batches_per_round, total // n)
            chosen = rng.choice(total, size=count * n, replace=False)
            model.load_state_dict(global_state)
            model.train()
            params = [p for p in model.parameters() if p.requires_grad]
            buffers = momenta.setdefault(client, [torch.zeros_like(p) for p in params])
            steps = [chosen] if finetune.local_steps == "round" else np.split(chosen, count)
            step_size = finetune.lr * config.lr_factor(server_round)
            step_losses = []
            for step in steps:
                images = torch.from_numpy(data.train_images[step]).to(target)
                labels = torch.from_numpy(data.train_labels[step]).long().to(target)
                with amp.autocast():
                    loss = F.cross_entropy(model(images), labels)
                model.zero_grad()
                loss.backward()
                with torch.no_grad():
                    for parameter, velocity in zip(params, buffers, strict=True):
                        gradient = parameter.grad  # None: the loss does not use it
                        velocity.mul_(finetune.momentum).add_(0.0 if gradient is None else gradient)
                        parameter.sub_(step_size * velocity)
                step_losses.append(loss.item())
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            weights.append(count * n)
            losses.append(float(np.mean(step_losses)))
        if not states:
            raise ConfigError(f"no client has {n} training samples (the batch size)")
        global_state = weighted_average(states, weights)
        model.load_state_dict(global_state)
        confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
        evaluated = 0
        for data in datasets:
            if len(data.eval_labels) >= n:
                confusion += _confusion(model, data, num_classes, amp)
                evaluated += 1
        record = RoundRecord(
            round=server_round,
            train_loss=float(np.average(losses, weights=weights)),
            balanced_accuracy=balanced_accuracy(confusion),
            accuracy=float(np.trace(confusion) / max(confusion.sum(), 1)),
            clients_trained=len(states),
            clients_evaluated=evaluated,
            failures=[],
            seconds=time.perf_counter() - started,
            round_trips=2,  # fit and evaluate, one message each way per client
        )
        history.append(record)
        if checkpoint_dir is not None:
            arrays = {k: to_numpy(v) for k, v in global_state.items()}
            state = RunState(server_round, arrays, history, dict(rng.bit_generator.state))
            save_state(checkpoint_dir, state, identity)
        log(
            f"[fedfm] round {server_round}/{config.rounds} [full fine-tuning, plaintext]: "
            f"train loss {record.train_loss:.4f}, balanced accuracy "
            f"{record.balanced_accuracy:.4f} ({record.seconds:.1f} s)"
        )
    model.load_state_dict(global_state)
    return history, model.eval().cpu()


@dataclass
class AdaptationResult:
    """One method's run: its history and, for the protocol's methods, the transport."""

    method: str
    history: list[RoundRecord]
    transport: InProcessTransport | None
    trainable_parameters: int

    @property
    def final_balanced_accuracy(self) -> float:
        return self.history[-1].balanced_accuracy


def protocol_trainable_parameters(
    model: FheViT, num_classes: int, config: DoubleBlindConfig
) -> int:
    """Adapter and head parameters of the protocol's client for ``config`` (``rank=0``: head)."""
    dim = model.vit.embed_dim
    adapter = SideAdapterHead(
        num_blocks=len(revealed_blocks(config.reveal, model.num_blocks)),
        dim=dim,
        num_classes=num_classes,
        rank=config.rank,
        alpha=config.alpha,
    )
    return trainable_parameters(adapter)


def run_adaptation(
    method: str,
    student: FheViT,
    splits: DataSplits,
    config: DoubleBlindConfig,
    federation: Federation,
    *,
    finetune: FineTuneConfig | None = None,
    seed: int = 0,
    checkpoint_dir: Path | None = None,
    log: Callable[[str], None] = print,
    device: str | torch.device | None = "auto",
    precision: str = "off",
) -> AdaptationResult:
    """Run ``method`` (one of :data:`METHODS`) over the federation; ``linear-probe`` forces
    ``rank=0``, ``full-finetune`` ignores the adapter settings and ``config.lr``. Plaintext torch
    runs on ``device``; ``precision`` (bf16 autocast on a GPU) applies to full fine-tuning
    only."""
    check_method(method)
    classes = splits.pool.num_classes
    if method == "full-finetune":
        history, _ = run_full_finetune(
            student,
            splits,
            config,
            federation,
            finetune=finetune,
            seed=seed,
            checkpoint_dir=checkpoint_dir,
            log=log,
            device=device,
            precision=precision,
        )
        params = trainable_parameters(finetune_model(student, classes, seed=seed))
        return AdaptationResult(method, history, None, params)
    if method == "linear-probe":
        config = replace(config, rank=0)
    history, transport = run_in_process(
        student,
        splits,
        config,
        federation,
        checkpoint_dir=checkpoint_dir,
        log=log,
        policy=RESEARCHER_POLICY,
        randomness=ResearchStream(seed),
        device=device,
    )
    params = protocol_trainable_parameters(student, classes, config)
    return AdaptationResult(method, history, transport, params)
