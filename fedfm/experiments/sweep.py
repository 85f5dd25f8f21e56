"""Approximation sweeps like Tables 5 and 6 of spec ``001`` (App. "Approximation results").

For every value (exp degree, or Goldschmidt iterations) the student starts from the cached teacher,
is calibrated, runs one epoch of stage-I distillation on ``D_aux``, and is then measured on the
held-out test set:

* attention loss ``L_a`` (Eq. 12) and representation loss ``L_h`` (Eq. 13), per element;
* one-epoch accuracy (test accuracy after that single epoch);
* latency of a forward pass over a batch of 8 (median of repeats, plaintext torch on the run's
  device, ``--device``);
* peak memory of one training step (forward + backward over a batch of 8): the rise of the
  resident-set high-water mark in a fresh process that holds only the student (a CPU has no
  allocator peak counter like ``torch.cuda.max_memory_allocated``; this step runs on the CPU
  whatever the device, and the results record the GPU's own peak separately);
* activation memory: bytes of the tensors autograd saves for that backward pass (deterministic;
  this is what grows with the degree).

Table 5 varies the exp degree with every other non-linearity exact; Table 6 varies the inverse
iterations with the exp of degree 6 and the rest exact (the paper keeps "all other non-linear
components fixed").
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fedfm.approx.modules import calibrate
from fedfm.approx.specs import ApproxConfig, GoldschmidtInverseSpec, taylor_exp
from fedfm.distillation.distill import calibration_batches, layer_losses, run_epoch
from fedfm.distillation.pipeline import DistillRun, load_data, teacher_for
from fedfm.distillation.training import batches, score
from fedfm.errors import ConfigError
from fedfm.experiments.results import write_results
from fedfm.models.device import (
    mixed_precision,
    reset_peak_memory,
    resolve_device,
    synchronize,
)
from fedfm.models.fhe_vit import FheViT, to_fhe_friendly
from fedfm.models.foundation import ModelSpec

PAPER_VALUES = {"exp": [2, 4, 6, 8, 10, 16, None], "inverse": [2, 4, 6, 7, 8, 10, 12, 16, None]}
BENCH_BATCH = 8


def sweep_config(kind: str, value: int | None) -> ApproxConfig:
    """The approximations of one sweep point (see the module docstring)."""
    if kind == "exp":
        exp = None if value is None else taylor_exp(value)
        return ApproxConfig(exp=exp, inverse=None, gelu=None, inv_sqrt=None)
    if kind == "inverse":
        inverse = None if value is None else GoldschmidtInverseSpec(value)
        return ApproxConfig(exp=taylor_exp(6), inverse=inverse, gelu=None, inv_sqrt=None)
    raise ConfigError(f"sweep kind must be 'exp' or 'inverse', got {kind!r}")


def _varied_spec_depth(approx: ApproxConfig, kind: str) -> int | None:
    spec = approx.exp if kind == "exp" else approx.inverse
    return None if spec is None else spec.depth


def median_latency(
    fn: Callable[[], Any], *, repeats: int, device: torch.device | None = None
) -> float:
    """Median wall time of ``fn()`` in seconds, after one warm-up call (on a GPU ``device``,
    each call's queued work is waited for before the clock stops)."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    device = device if device is not None else torch.device("cpu")
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def saved_tensor_bytes(step: Callable[[], Any]) -> int:
    """Bytes autograd keeps for backward passes while ``step()`` runs (distinct storages)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(storages.values())


def saved_activation_bytes(model: FheViT, images: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward pass of ``model(images)`` (distinct storages)."""
    model.train()
    saved = saved_tensor_bytes(lambda: model(images).sum().backward())
    model.zero_grad(set_to_none=True)
    return saved


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ConfigError(f"/proc/self/status has no {field} line")


def _training_step_peak_rss(
    spec: ModelSpec, approx: ApproxConfig, state: dict[str, torch.Tensor], images: torch.Tensor
) -> int | None:
    """In a fresh process: peak resident memory (bytes) above the start of one training step.

    Linux only: writing 5 to ``/proc/self/clear_refs`` resets the high-water mark ``VmHWM`` to
    the current resident size, so that ``VmHWM`` after the step is the step's own peak.
    """
    clear_refs = Path("/proc/self/clear_refs")
    if not clear_refs.exists():
        return None
    student = to_fhe_friendly(spec.build(), approx)
    student.load_state_dict(state)
    student.train()
    before = _status_kib("VmRSS")
    clear_refs.write_text("5")
    student(images).sum().backward()
    return 1024 * (_status_kib("VmHWM") - before)


def peak_step_memory(spec: ModelSpec, student: FheViT, images: torch.Tensor) -> int | None:
    """Peak memory (bytes) of one training step of ``student`` in a fresh process (Linux only).

    The process is gone when this returns, so it cannot disturb later latency measurements.
    """
    state = {key: value.detach().cpu().clone() for key, value in student.state_dict().items()}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as executor:
        return executor.submit(
            _training_step_peak_rss, spec, student.approx, state, images.cpu()
        ).result()


@torch.no_grad()
def evaluation_losses(student: FheViT, teacher: FheViT, images: torch.Tensor) -> dict[str, float]:
    """Mean attention and representation losses over the test images."""
    student.eval()
    device = next(student.parameters()).device
    sums = {"attention": 0.0, "hidden": 0.0}
    for batch_images, _ in batches(images, torch.zeros(len(images)), batch_size=64):
        batch_images = batch_images.to(device)
        terms = layer_losses(
            student.forward_intermediates(batch_images), teacher.forward_intermediates(batch_images)
        )
        for key in sums:
            sums[key] += terms[key].item() * len(batch_images)
    return {key: value / len(images) for key, value in sums.items()}


def run_sweep(
    run: DistillRun,
    *,
    kind: str,
    values: Sequence[int | None] | None = None,
    results_dir: Path = Path("results"),
    repeats: int = 20,
    progress: bool = True,
    log: Callable[[str], None] = print,
    command: str | None = None,
) -> list[dict[str, Any]]:
    """Run one sweep and write ``results/approx_sweep_<kind>.{json,md}``; return its rows.

    Peak memory is measured in spawned processes: call this under ``if __name__ == "__main__":``
    when running it from a script.
    """
    values = list(PAPER_VALUES[kind] if values is None and kind in PAPER_VALUES else values or [])
    configs = [(value, sweep_config(kind, value)) for value in values]  # validate before work
    if not configs:
        raise ConfigError("the sweep needs at least one value")
    device = resolve_device(run.device)
    precision = mixed_precision(run.precision, device, log=log)
    reset_peak_memory(device)
    splits, image_size = load_data(run)
    torch.manual_seed(run.seed)
    teacher_vit, _ = teacher_for(run, splits, image_size, progress=progress, log=log)
    teacher = to_fhe_friendly(teacher_vit, ApproxConfig.exact()).eval().to(device)
    one_epoch = replace(run.distill, epochs=2)  # stage1_epochs == 1
    calibration = [b.to(device) for b in calibration_batches(splits.aux.images, one_epoch)]
    bench_images = splits.test.images[:BENCH_BATCH].to(device)
    spec = ModelSpec(run.model, splits.aux.num_classes, image_size)
    rows = []
    for value, approx in configs:
        student = to_fhe_friendly(teacher_vit, approx).to(device)
        calibrate(student, calibration)
        optimizer = torch.optim.Adam(student.parameters(), lr=one_epoch.lr_stage1)
        run_epoch(
            student,
            teacher,
            splits.aux.images,
            splits.aux.labels,
            stage=1,
            optimizer=optimizer,
            config=one_epoch,
            generator=torch.Generator().manual_seed(run.seed),
            progress=progress,
            description=f"{kind}={value if value is not None else 'exact'}",
            precision=precision,
        )
        calibrate(student, calibration)
        losses = evaluation_losses(student, teacher, splits.test.images)
        accuracy = score(student, splits.test.images, splits.test.labels)
        student.eval()
        with torch.inference_mode():
            latency = median_latency(partial(student, bench_images), repeats=repeats, device=device)
        peak = peak_step_memory(spec, student, bench_images)
        row = {
            kind: "exact" if value is None else value,
            "depth": _varied_spec_depth(approx, kind),
            "attention_loss": losses["attention"],
            "representation_loss": losses["hidden"],
            "one_epoch_accuracy": accuracy.accuracy,
            "one_epoch_balanced_accuracy": accuracy.balanced_accuracy,
            "latency_ms_per_batch": 1000 * latency,
            "peak_step_mib": None if peak is None else peak / 2**20,
            "activation_mib_per_batch": saved_activation_bytes(student, bench_images) / 2**20,
        }
        rows.append(row)
        log(
            f"[fedfm] sweep {kind}={row[kind]}: "
            + ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float))
        )
    title = {
        "exp": "Softmax: Taylor exp degree (Table 5)",
        "inverse": "Inverse: Goldschmidt iterations (Table 6)",
    }[kind]
    write_results(
        results_dir,
        f"approx_sweep_{kind}",
        title=title,
        description=(
            f"Dataset {run.dataset} (D_aux {len(splits.aux)}, test {len(splits.test)}), model "
            f"{run.model} at {image_size}px, one stage-I epoch (batch {one_epoch.batch_size}, Adam "
            f"{one_epoch.lr_stage1}) per row, plaintext torch on "
            f"{'CPU' if device.type == 'cpu' else device}"
            + (f" ({precision.describe()})" if precision.enabled else "")
            + ". Losses are per-element MSE "
            f"on the test set; latency is a forward pass over {BENCH_BATCH} images; peak memory "
            "is the rise of the resident-set high-water mark over one forward + backward pass "
            "on them in a fresh process; activation memory is what autograd saves for that "
            "backward pass. "
            + (
                "Other non-linearities exact."
                if kind == "exp"
                else "Exp of degree 6, other non-linearities exact."
            )
        ),
        rows=rows,
        columns=[
            (kind, "exp degree d" if kind == "exp" else "inverse iterations d"),
            ("depth", "mult. depth"),
            ("peak_step_mib", "peak memory (MiB)"),
            ("activation_mib_per_batch", "activations (MiB)"),
            ("latency_ms_per_batch", "latency (ms / batch of 8)"),
            ("attention_loss", "attention loss L_a"),
            ("representation_loss", "representation loss L_h"),
            ("one_epoch_accuracy", "one-epoch accuracy"),
        ],
        command=command,
        device=device,
    )
    return rows
