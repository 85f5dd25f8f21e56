"""The ``fedfm`` command line.

``fedfm distill``  the server's offline step: teacher on D_aux, FHE-friendly student, report.
``fedfm sweep``    Tables 5/6 style sweeps of the exp degree or the inverse iterations.
``fedfm bench``    plaintext latency of the FHE-friendly model relative to the exact model.
``fedfm adapt``    federated adaptation in one process: ours, linear probing or full fine-tuning.
``fedfm bench-protocol``    cost per FL round and accuracy of ours vs linear probing vs full FT.
``fedfm bench-extraction``  model-extraction attacks from a curious client's view (App. C).
``fedfm red-team``  every attack on fedfm's promises against the current code, with its outcome.
``fedfm train-llm``  the embedded decoder LLM (FedRAG, SLIP, CENTAUR): train once, cache, report.
``fedfm bench-fedrag``  FedRAG vs secret sharing vs plaintext: TTFT, tok/s, traffic, accuracy.
``fedfm fedrag-ablation``  FedRAG's Table 3: baseline / +distributed / +scrambler (docstrings).
``fedfm fedrag-attacks``  FedRAG §6: the compute node's attacks on the scrambler, as curves.
``fedfm bench-slip``, ``slip-figures``, ``slip-finetune``, ``slip-attacks``  SLIP (issue 21).
``fedfm bench-centaur``  CENTAUR vs full secret sharing: time, bytes, rounds (lan, wan), logits.
``fedfm centaur-accuracy``  CENTAUR's Table 2: plaintext, CENTAUR, MPCFormer quadratics.
``fedfm centaur-attacks``  CENTAUR's Table 1 and the cloud's attacks, faithful and hardened.

The double-blind commands (``distill``, ``adapt``, ``paper``, ``bench-protocol``, ``red-team``,
...), HELIX's and ``train-llm`` take ``--device auto|cpu|cuda|cuda:N`` (default ``auto``: a GPU
when torch sees one); CKKS always runs on the CPU.

Errors fedfm raises on purpose are printed as one line (``fedfm: error: ...``), exit status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from fedfm.errors import FedfmError

if TYPE_CHECKING:  # imported where used: `fedfm --help` loads no torch
    from fedfm.distillation.pipeline import DistillRun
    from fedfm.experiments.baselines import FineTuneConfig
    from fedfm.models.decoder.artefact import DecoderSource
    from fedfm.protocols.double_blind.config import DoubleBlindConfig
    from fedfm.protocols.double_blind.runner import Federation


def _optional_int(text: str) -> int | None:
    """An integer, or ``exact`` for the exact function."""
    if text.lower() in {"exact", "none", "inf"}:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'exact', got {text!r}") from None


# mirrors fedfm.models.device's DEVICE_HELP and PRECISION_HELP without importing torch to build
# the parser (tests/test_cli.py checks they agree)
DEVICE_HELP = (
    "where plaintext torch runs: auto (a GPU when torch sees one, else the CPU), cpu, cuda or "
    "cuda:N; CKKS always runs on the CPU"
)
PRECISION_HELP = (
    "mixed precision for training on a GPU (teacher, distillation, full fine-tuning): off, bf16 "
    "or fp16 autocast; always off on the CPU and in the protocol's own evaluation"
)


def _add_device_argument(parser: argparse._ActionsContainer) -> None:
    """``--device``; checked (one line naming the device and what torch sees) when used."""
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)


def _add_run_arguments(parser: argparse.ArgumentParser, *, protocol: bool = False) -> None:
    """Data, model, approximation and distillation options of the student.

    With ``protocol`` (adaptation commands) ``--batch-size`` and ``--seed`` belong to the protocol,
    so the distillation's are ``--distill-batch-size`` and ``--data-seed``.
    """
    data = parser.add_argument_group("data and model")
    data.add_argument(
        "--dataset",
        default="digits",
        help="digits (embedded), cifar10, cifar100, svhn (local folders) or hf:<name>",
    )
    data.add_argument(
        "--data-root",
        default=None,
        help="folder holding torchvision-format datasets (default $FEDFM_DATA_DIR)",
    )
    data.add_argument("--max-samples", type=int, default=None, help="cap each split (quick runs)")
    data.add_argument(
        "--model",
        default="vit_fedfm_tiny",
        help="embedded ViT (vit_fedfm_tiny, vit_fedfm_micro, vit_fedfm_small) or a timm ViT name",
    )
    data.add_argument(
        "--checkpoint",
        default=None,
        help="local pretrained weights file for a timm model (no download)",
    )
    data.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="model input size (default: the model's native size)",
    )
    if protocol:
        data.add_argument(
            "--data-seed", type=int, default=0, help="seed of the data split and of the student"
        )
    else:
        data.add_argument("--seed", type=int, default=0)
    approx = parser.add_argument_group("approximations (integer or 'exact')")
    approx.add_argument("--exp-degree", type=_optional_int, default=6)
    approx.add_argument("--inverse-iterations", type=_optional_int, default=7)
    approx.add_argument("--inv-sqrt-iterations", type=_optional_int, default=5)
    approx.add_argument("--exact-gelu", action="store_true", help="keep GELU exact")
    train = parser.add_argument_group("training")
    train.add_argument("--teacher-epochs", type=int, default=40)
    train.add_argument("--epochs", type=int, default=8, help="distillation epochs, half per stage")
    train.add_argument("--distill-batch-size" if protocol else "--batch-size", type=int, default=16)
    train.add_argument("--lr-stage1", type=float, default=1e-4)
    train.add_argument("--lr-stage2", type=float, default=1e-5)
    train.add_argument("--temperature", type=float, default=5.0)
    hardware = parser.add_argument_group("hardware")
    _add_device_argument(hardware)
    hardware.add_argument(
        "--precision", choices=("off", "bf16", "fp16"), default="off", help=PRECISION_HELP
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("runs/cache"),
        help="where pretrained teachers are cached",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _run_from_args(args: argparse.Namespace, workdir: Path) -> DistillRun:
    from fedfm.distillation.distill import DistillConfig
    from fedfm.distillation.pipeline import ApproxSettings, DistillRun
    from fedfm.distillation.training import PretrainConfig

    seed = args.data_seed if hasattr(args, "data_seed") else args.seed
    batch_size = args.distill_batch_size if hasattr(args, "distill_batch_size") else args.batch_size
    return DistillRun(
        dataset=args.dataset,
        data_root=args.data_root,
        model=args.model,
        checkpoint=args.checkpoint,
        image_size=args.image_size,
        max_samples=args.max_samples,
        seed=seed,
        approx=ApproxSettings(
            exp_degree=args.exp_degree,
            inverse_iterations=args.inverse_iterations,
            inv_sqrt_iterations=args.inv_sqrt_iterations,
            gelu=not args.exact_gelu,
        ),
        teacher=PretrainConfig(epochs=args.teacher_epochs, seed=seed),
        distill_data=getattr(args, "distill_data", "aux"),
        distill=DistillConfig(
            epochs=args.epochs,
            batch_size=batch_size,
            lr_stage1=args.lr_stage1,
            lr_stage2=args.lr_stage2,
            temperature=args.temperature,
            seed=seed,
        ),
        workdir=workdir,
        cache_dir=args.cache_dir,
        device=args.device,
        precision=args.precision,
    )


def _distill(args: argparse.Namespace) -> None:
    from fedfm.distillation.pipeline import run_distillation

    run_distillation(
        _run_from_args(args, args.workdir), restart=args.restart, progress=not args.no_progress
    )


def _distill_text(args: argparse.Namespace) -> None:
    from fedfm.distillation.distill import DistillConfig
    from fedfm.distillation.text import TextApproxSettings, TextDistillRun
    from fedfm.experiments.text_distillation import run_text_distillation_experiment

    if args.keep_student is not None:
        from fedfm.distillation.text import kept_text_student, student_run

        # the student `fedfm paper-text` and the double-blind apps adapt (its own split): the
        # other options describe `distill-text`'s experiment and do not apply
        kept_text_student(student_run(args.model), args.keep_student, progress=True)
        return

    run = TextDistillRun(
        model=args.model,
        max_tokens=args.max_tokens,
        seed=args.seed,
        aux_per_class=args.aux_per_class,
        pool_per_class=args.pool_per_class,
        test_per_class=args.test_per_class,
        distill_data=args.distill_data,
        distill_texts=args.distill_texts,
        ablation=not args.no_ablation,
        approx=TextApproxSettings(
            gelu_degree=None if args.gelu_degree == 0 else args.gelu_degree,
            gelu_radius=args.gelu_radius,
            gelu_channel_scale=not args.no_gelu_channel_scale and args.gelu_degree != 0,
        ),
        distill=DistillConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr_stage1=args.lr_stage1,
            lr_stage2=args.lr_stage2,
            calibration_batches=args.calibration_batches,
        ),
    )
    run_text_distillation_experiment(
        run,
        results_dir=args.results_dir,
        command=args.command_line,
        progress=not args.no_progress,
    )


def _sweep(args: argparse.Namespace) -> None:
    from fedfm.experiments.sweep import run_sweep

    run_sweep(
        _run_from_args(args, args.workdir),
        kind=args.kind,
        values=args.values,
        results_dir=args.results_dir,
        progress=not args.no_progress,
        command=args.command_line,
    )


def _bench(args: argparse.Namespace) -> None:
    from fedfm.experiments.bench import run_latency_benchmark

    run_latency_benchmark(
        _run_from_args(args, args.workdir),
        batch_size=args.bench_batch_size,
        repeats=args.repeats,
        results_dir=args.results_dir,
        command=args.command_line,
    )


def _add_protocol_arguments(parser: argparse.ArgumentParser, *, rounds: int | None = None) -> None:
    """The protocol's options, with the defaults of the one table
    (:mod:`fedfm.protocols.double_blind.defaults`); ``rounds`` overrides that default for a
    command that deliberately runs fewer (its help says so)."""
    from fedfm.protocols.double_blind.defaults import FEDERATION, PROTOCOL

    group = parser.add_argument_group("federated adaptation")
    group.add_argument(
        "--rounds",
        type=int,
        default=PROTOCOL.rounds if rounds is None else rounds,
        help=None if rounds is None else f"default {rounds} here ({PROTOCOL.rounds} elsewhere)",
    )
    group.add_argument(
        "--clients", type=int, default=FEDERATION.num_clients, help="number of clients K"
    )
    group.add_argument("--partition", default=FEDERATION.scheme, help="iid, dirichlet or natural")
    group.add_argument(
        "--alpha", type=float, default=FEDERATION.alpha, help="Dirichlet concentration"
    )
    group.add_argument(
        "--batch-size",
        type=int,
        default=PROTOCOL.batch_size,
        help="samples per batch n (at least 16, App. C)",
    )
    group.add_argument("--batches-per-round", type=int, default=PROTOCOL.batches_per_round)
    group.add_argument(
        "--evaluate-every",
        type=int,
        default=PROTOCOL.evaluate_every,
        help="evaluate the global model every N rounds and after the last (an encrypted "
        "evaluation costs about a round's training)",
    )
    group.add_argument(
        "--rank", type=int, default=PROTOCOL.rank, help="adapter rank (0: linear probing)"
    )
    group.add_argument(
        "--reveal",
        default=PROTOCOL.reveal,
        help="blocks whose outputs the client sees: all, every-other, last-two, last or '2,4'",
    )
    group.add_argument(
        "--backend",
        default=PROTOCOL.backend,
        help="crypto backend: simulate (plaintext stand-in), ckks (TenSEAL, N=16384), ckks-8192",
    )
    group.add_argument(
        "--adapter-alpha", type=float, default=PROTOCOL.alpha, help="adapter scale (Eq. 5)"
    )
    group.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"SGD learning rate (default {PROTOCOL.lr} for ours and linear probing, 0.0025 for "
        "full FT)",
    )
    group.add_argument(
        "--lr-decay",
        action="store_true",
        help="the paper's schedule: learning rate x0.1 at 50%% and again at 80%% of the rounds",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=FEDERATION.seed,
        help="seeds partitions and, in these in-process runs where you play every party, the "
        "server's draws (reproducible, not secret; a Flower run's server keys its own)",
    )
    secagg = parser.add_argument_group("secure aggregation of the clients' updates")
    secagg.add_argument(
        "--secure-aggregation",
        action=argparse.BooleanOptionalAction,
        default=PROTOCOL.secure_aggregation,
        help="the server learns only the weighted average of the updates (SecAgg+; default on)",
    )
    secagg.add_argument(
        "--secagg-clipping-range",
        type=float,
        default=PROTOCOL.secagg_clipping_range,
        help="each value of an update (new minus received parameters) is clipped to [-c, c]",
    )
    secagg.add_argument(
        "--secagg-bits", type=int, default=PROTOCOL.secagg_bits, help="quantization bits"
    )
    secagg.add_argument(
        "--secagg-neighbours",
        type=int,
        default=PROTOCOL.secagg_neighbours,
        help="SecAgg+ neighbours (0: all clients)",
    )
    secagg.add_argument(
        "--secagg-threshold",
        type=int,
        default=PROTOCOL.secagg_threshold,
        help="shares that rebuild a client's secrets (0: half its neighbours, plus one)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("runs/distill"),
        help="where the student is (distilled there first if absent)",
    )


def _protocol_from_args(
    args: argparse.Namespace, method: str = "ours"
) -> tuple[DoubleBlindConfig, Federation, FineTuneConfig]:
    from fedfm.data.partition import SCHEMES
    from fedfm.errors import ConfigError
    from fedfm.experiments.baselines import DEFAULT_FINETUNE_LR, FineTuneConfig, check_method
    from fedfm.protocols.double_blind.config import DoubleBlindConfig
    from fedfm.protocols.double_blind.defaults import PROTOCOL
    from fedfm.protocols.double_blind.runner import Federation

    check_method(method)
    if args.partition not in SCHEMES:
        raise ConfigError(f"unknown partition {args.partition!r}; choose one of {list(SCHEMES)}")
    if not args.alpha > 0:
        raise ConfigError(f"Dirichlet alpha must be > 0, got {args.alpha}")
    finetune_lr = args.lr if method == "full-finetune" and args.lr is not None else None
    protocol_lr = args.lr if method != "full-finetune" and args.lr is not None else PROTOCOL.lr
    config = DoubleBlindConfig(
        rounds=args.rounds,
        batch_size=args.batch_size,
        batches_per_round=args.batches_per_round,
        evaluate_every=args.evaluate_every,
        rank=0 if method == "linear-probe" else args.rank,
        alpha=args.adapter_alpha,
        lr=protocol_lr,
        lr_decay=args.lr_decay,
        backend=args.backend,
        reveal=args.reveal,
        secure_aggregation=args.secure_aggregation,
        secagg_clipping_range=args.secagg_clipping_range,
        secagg_bits=args.secagg_bits,
        secagg_neighbours=args.secagg_neighbours,
        secagg_threshold=args.secagg_threshold,
    )
    federation = Federation(
        num_clients=args.clients, scheme=args.partition, alpha=args.alpha, seed=args.seed
    )
    finetune = FineTuneConfig(lr=finetune_lr if finetune_lr is not None else DEFAULT_FINETUNE_LR)
    return config, federation, finetune


def _adapt(args: argparse.Namespace) -> None:
    import json
    from dataclasses import asdict

    from fedfm.distillation.pipeline import load_data, obtain_student
    from fedfm.experiments.baselines import run_adaptation
    from fedfm.experiments.results import json_safe
    from fedfm.models.device import device_report, reset_peak_memory, resolve_device

    config, federation, finetune = _protocol_from_args(args, args.method)
    device = resolve_device(args.device)  # before any work: one line if there is no such GPU
    reset_peak_memory(device)
    output = args.output or Path("runs/adapt") / f"{args.method}.json"
    if output.exists() and output.is_dir():
        raise IsADirectoryError(f"--output {output} is a folder, expected a file path")
    run = _run_from_args(args, args.workdir)
    student = obtain_student(run, progress=not args.no_progress)
    splits, _ = load_data(run)
    result = run_adaptation(
        args.method,
        student,
        splits,
        config,
        federation,
        finetune=finetune,
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        device=device,
        precision=args.precision,
    )
    for record in result.history:
        print(f"round {record.round:3d}  balanced accuracy {record.balanced_accuracy:.4f}")
    payload = {
        "command": args.command_line,
        "method": args.method,
        "backend": config.backend
        if args.method != "full-finetune"
        else "plaintext (no encryption, clients hold the model)",
        "config": config.to_config(),
        "federation": asdict(federation),
        "finetune": asdict(finetune) if args.method == "full-finetune" else None,
        "trainable_parameters": result.trainable_parameters,
        "final_balanced_accuracy": result.final_balanced_accuracy,
        "history": [asdict(record) for record in result.history],
        "hardware": device_report(device),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False))
    print(
        f"[fedfm] {args.method}: final balanced accuracy {result.final_balanced_accuracy:.4f}; "
        f"wrote {output}"
    )


def _bench_protocol(args: argparse.Namespace) -> None:
    from fedfm.experiments.bench_protocol import run_protocol_benchmark

    config, federation, finetune = _protocol_from_args(args)
    run_protocol_benchmark(
        _run_from_args(args, args.workdir),
        config,
        federation,
        finetune=finetune,
        repeats=args.repeats,
        threads=args.threads,
        results_dir=args.results_dir,
        progress=not args.no_progress,
        command=args.command_line,
    )


def _bench_extraction(args: argparse.Namespace) -> None:
    from fedfm.experiments.bench_protocol import run_extraction_benchmark

    config, federation, _ = _protocol_from_args(args)
    run_extraction_benchmark(
        _run_from_args(args, args.workdir),
        config,
        federation,
        mlp=not args.no_mlp,
        results_dir=args.results_dir,
        progress=not args.no_progress,
        command=args.command_line,
    )


def _red_team(args: argparse.Namespace) -> None:
    from fedfm.experiments.red_team import run_red_team

    extraction = None
    if not args.skip_extraction:
        config, federation, _ = _protocol_from_args(args)
        extraction = (_run_from_args(args, args.workdir), config, federation)
    protocols = (
        None
        if args.protocols == "all"
        else [name for name in args.protocols.split(",") if name.strip() and name != "none"]
    )
    results = run_red_team(
        extraction=extraction,
        results_dir=args.results_dir,
        command=args.command_line,
        protocols=protocols,
    )
    succeeded = [r.name for r in results if r.outcome != "defended"]
    print(
        f"[fedfm] red team: {len(results) - len(succeeded)} of {len(results)} defended; "
        f"succeeding: {', '.join(succeeded) or 'none'}"
    )


def _bench_reveal(args: argparse.Namespace) -> None:
    from fedfm.experiments.bench_protocol import run_reveal_benchmark

    config, federation, _ = _protocol_from_args(args)
    run_reveal_benchmark(
        _run_from_args(args, args.workdir),
        config,
        federation,
        reveals=args.reveals,
        results_dir=args.results_dir,
        progress=not args.no_progress,
        command=args.command_line,
    )


def _say_ckks_stays_on_the_cpu(args: argparse.Namespace, what: str) -> None:
    from fedfm.models.device import cpu_only_note, resolve_device

    note = cpu_only_note(resolve_device(args.device), what)
    if note is not None:
        print(note)


def _bench_ckks(args: argparse.Namespace) -> None:
    from fedfm.experiments.bench_ckks import run_ckks_benchmark

    _say_ckks_stays_on_the_cpu(args, "CKKS (the benchmarked blocks)")

    run_ckks_benchmark(
        _run_from_args(args, args.workdir),
        backend_name=args.backend,
        batch_sizes=args.batch_sizes,
        block=args.block - 1,
        forward_batch=args.forward_batch,
        calibrate=args.calibrate,
        repeats=args.repeats,
        results_dir=args.results_dir,
        command=args.command_line,
    )


def _bench_ckks_text(args: argparse.Namespace) -> None:
    from fedfm.experiments.bench_ckks_text import run_text_ckks_benchmark

    run_text_ckks_benchmark(
        model=args.model,
        backend_name=args.backend,
        batch_sizes=args.batch_sizes,
        block=args.block - 1,
        forward_batch=args.forward_batch,
        repeats=args.repeats,
        student_dir=args.student_dir,
        results_dir=args.results_dir,
        command=args.command_line,
    )


def _bench_runtime(args: argparse.Namespace) -> None:
    from fedfm.experiments.bench_runtime import DEFAULT_SIZES, run_runtime_benchmark

    run_runtime_benchmark(
        sizes=args.sizes or DEFAULT_SIZES,
        repeats=args.repeats,
        vector_length=args.vector_length,
        results_dir=args.results_dir,
        command=args.command_line,
    )


def _helix_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ridge", type=float, default=0.1, help="ridge coefficient lambda")
    parser.add_argument("--seed", type=int, default=0, help="seed of the docstring draw")
    parser.add_argument("--public-size", type=int, default=2048, help="public docstrings")
    parser.add_argument("--train-per-class", type=int, default=200, help="provider's, per class")
    parser.add_argument("--queries-per-class", type=int, default=100, help="client's, per class")
    parser.add_argument("--ood-size", type=int, default=700, help="OOD docstrings")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path("runs/helix-cache"), help="embedding cache"
    )
    parser.add_argument("--results-dir", type=Path, default=Path("results"))
    _add_device_argument(parser)


def _helix_data_options(args: argparse.Namespace) -> dict:
    return {
        "ridge": args.ridge,
        "seed": args.seed,
        "public_size": args.public_size,
        "train_per_class": args.train_per_class,
        "queries_per_class": args.queries_per_class,
        "ood_size": args.ood_size,
        "results_dir": args.results_dir,
        "cache_dir": args.cache_dir,
        "command": args.command_line,
        "device": args.device,
    }


def _helix_eval(args: argparse.Namespace) -> None:
    from fedfm.errors import ConfigError
    from fedfm.experiments.helix_evaluation import run_helix_evaluation

    pairs = [tuple(pair.split(",")) for pair in args.pairs]
    if any(len(pair) != 2 for pair in pairs):
        raise ConfigError(f"--pairs takes 'provider,client' encoder pairs, got {args.pairs}")
    run_helix_evaluation(
        pairs=pairs, repeats=args.repeats, shadows=args.shadows, **_helix_data_options(args)
    )


def _bench_helix(args: argparse.Namespace) -> None:
    from fedfm.experiments.helix_bench import run_helix_benchmark

    _say_ckks_stays_on_the_cpu(args, "HELIX's CKKS inference")

    run_helix_benchmark(
        provider_spec=args.provider,
        client_spec=args.client,
        batch_size=args.batch_size,
        repeats=args.repeats,
        **_helix_data_options(args),
    )


def _paper(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from fedfm.distillation.pipeline import load_data, obtain_student
    from fedfm.experiments.paper import load_table, run_efficiency_table, run_table

    spec = (
        None
        if args.table == "table4"
        else load_table(args.table, args.config, seeds=args.seeds, rounds=args.rounds)
    )
    run = _run_from_args(args, args.workdir)
    splits, _ = load_data(run)
    if spec is None:
        student = obtain_student(run, progress=not args.no_progress)
        run_efficiency_table(
            student,
            splits,
            results_dir=args.results_dir,
            command=args.command_line,
            device=args.device,
        )
        return
    # a student per distillation source; those distilled on other data than D_aux live beside
    # --workdir (runs/distill-sample-photos for runs/distill) and are distilled when missing
    students = {}
    for source in sorted({setting.distill_data for setting in spec.settings}):
        workdir = (
            args.workdir
            if source == "aux"
            else args.workdir.with_name(f"{args.workdir.name}-{source}")
        )
        students[source] = obtain_student(
            replace(run, distill_data=source, workdir=workdir), progress=not args.no_progress
        )
    run_table(
        spec,
        students,
        splits,
        workdir=args.cells_dir,
        results_dir=args.results_dir,
        command=args.command_line,
        device=args.device,
    )


def _paper_text(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from fedfm.errors import ConfigError
    from fedfm.experiments.paper import load_table
    from fedfm.experiments.text_adaptation import run_text_table
    from fedfm.experiments.text_lr import (
        SELECTABLE_METHODS,
        SELECTION_SEEDS,
        select_text_lr,
    )

    # the selection's seeds are its own (the table's stay the table's)
    table_seeds = None if args.select_lr else args.seeds
    spec = load_table(args.table, args.config, seeds=table_seeds, rounds=args.rounds)
    if args.methods is not None:
        spec = replace(spec, methods=tuple(m for m in spec.methods if m in args.methods))
    elif args.hide_text_lengths:  # full fine-tuning has no server to hide lengths from
        spec = replace(spec, methods=tuple(m for m in spec.methods if m != "full-finetune"))
    if args.settings is not None:
        unknown = sorted(set(args.settings) - {s.label for s in spec.settings})
        if unknown:
            raise ConfigError(
                f"no settings {unknown} in table {spec.name!r}; it has "
                f"{[s.label for s in spec.settings]}"
            )
        spec = replace(spec, settings=tuple(s for s in spec.settings if s.label in args.settings))
    if args.select_lr:
        if args.protocol or args.kept_only:
            raise ConfigError(
                "--select-lr runs the client rule on cached block outputs: drop --protocol and "
                "--kept-only"
            )
        select_text_lr(
            spec,
            student_dir=args.student_dir,
            workdir=args.cells_dir,
            results_dir=args.results_dir,
            model=args.model,
            grid=args.lr_grid,  # None: the methods' own grid
            seeds=args.seeds or SELECTION_SEEDS,
            methods=args.methods or SELECTABLE_METHODS,
            hide_text_lengths=args.hide_text_lengths,
            command=args.command_line,
            progress=not args.no_progress,
        )
        return
    if args.lr_grid is not None:
        raise ConfigError("--lr-grid is the grid of --select-lr")
    run_text_table(
        spec,
        student_dir=args.student_dir,
        workdir=args.cells_dir,
        results_dir=args.results_dir,
        model=args.model,
        command=args.command_line,
        progress=not args.no_progress,
        run_missing=not args.kept_only,
        protocol=args.protocol,
        hide_text_lengths=args.hide_text_lengths,
    )


def decoder_source(args: argparse.Namespace) -> DecoderSource:
    """The embedded decoder ``fedfm train-llm``'s options describe (with no options: the one
    ``load_decoder()`` loads)."""
    from fedfm.models.decoder.artefact import DecoderSource
    from fedfm.models.decoder.config import DecoderTraining

    training = DecoderTraining(
        **{field.name: getattr(args, field.name) for field in fields(DecoderTraining)}
    )
    return DecoderSource(
        name=args.model, cache_dir=args.cache_dir, training=training, text_root=args.text_root
    )


def _train_llm(args: argparse.Namespace) -> None:
    from fedfm.experiments.decoder import run_train_llm

    run_train_llm(
        decoder_source(args),
        restart=args.restart,
        threads=args.threads,
        progress=not args.no_progress,
        results_dir=args.results_dir,
        command=args.command_line,
        device=args.device,
    )


def _add_train_llm_arguments(parser: argparse.ArgumentParser) -> None:
    """``fedfm train-llm``'s options; the training ones are :class:`DecoderTraining`'s fields
    with its defaults (one table)."""
    from fedfm.models.decoder.config import (
        DEFAULT_CACHE_DIR,
        DEFAULT_DECODER,
        EMBEDDED_DECODERS,
        TRAINING_HELP,
        DecoderTraining,
    )

    parser.add_argument("--model", choices=sorted(EMBEDDED_DECODERS), default=DEFAULT_DECODER)
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="where the decoder is cached"
    )
    group = parser.add_argument_group("training (the cache key hashes these)")
    defaults = DecoderTraining()
    for field in fields(DecoderTraining):
        default = getattr(defaults, field.name)
        kind = float if isinstance(default, float) else int
        group.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=kind,
            default=default,
            help=f"{TRAINING_HELP[field.name]} (default {default})",
        )
    parser.add_argument(
        "--text-root",
        type=Path,
        default=None,
        help="train on the docstrings of this folder's .py files (default: the standard library)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads while training (default 1: on a busy 2-core machine two threads "
        "contend; not part of the cache key)",
    )
    _add_device_argument(parser)
    parser.add_argument(
        "--restart",
        action="store_true",
        help="discard the saved training state and any cached decoder, and train anew",
    )
    parser.add_argument("--results-dir", type=Path, default=Path("results"))
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedfm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    distill = commands.add_parser(
        "distill", help="train the teacher and distill its FHE-friendly student"
    )
    _add_run_arguments(distill)
    distill.add_argument("--workdir", type=Path, default=Path("runs/distill"))
    distill.add_argument(
        "--distill-data",
        choices=("aux", "sample-photos"),
        default="aux",
        help="distill on D_aux (in-distribution) or on crops of scikit-learn's sample photographs "
        "(out-of-distribution, labelled by the teacher); the teacher is pretrained on D_aux",
    )
    distill.add_argument(
        "--restart",
        action="store_true",
        help="discard a saved distillation state instead of resuming it",
    )
    distill.set_defaults(handler=_distill)

    distill_text = commands.add_parser(
        "distill-text",
        help="distill a BERT-family encoder + linear head into its FHE-friendly student on the "
        "docstring task (results/text_distillation.*)",
    )
    from fedfm.distillation.text_defaults import TEXT_DISTILL_DEFAULTS as text_defaults

    distill_text.add_argument(
        "--model",
        default=text_defaults.model,
        help="'minilm' (packaged, offline) or a BERT/DistilBERT name or folder on this machine",
    )
    distill_text.add_argument(
        "--keep-student",
        type=Path,
        default=None,
        metavar="DIR",
        help="only distil (or find) the student that `fedfm paper-text` and the double-blind "
        "apps (run config dataset='docstrings') adapt, and keep it in DIR (e.g. runs/text)",
    )
    distill_text.add_argument("--max-tokens", type=int, default=text_defaults.max_tokens)
    distill_text.add_argument("--seed", type=int, default=text_defaults.seed)
    distill_text.add_argument(
        "--aux-per-class",
        type=int,
        default=text_defaults.aux_per_class,
        help="D_aux texts per family (teacher head and distillation)",
    )
    distill_text.add_argument(
        "--pool-per-class",
        type=int,
        default=text_defaults.pool_per_class,
        help="the data owners' pool texts per family (never distilled on); `fedfm paper-text`'s "
        "split is --pool-per-class 100 --test-per-class 60",
    )
    distill_text.add_argument("--test-per-class", type=int, default=text_defaults.test_per_class)
    distill_text.add_argument(
        "--distill-data",
        choices=("stdlib", "aux", "public"),
        default=text_defaults.distill_data,
        help="distill on --distill-texts docstrings of every standard-library module outside "
        "the test texts and the data owners' pool (stdlib), on the labelled D_aux (aux), or on "
        "as many public docstrings of other modules (public); unlabelled texts are labelled "
        "by the teacher",
    )
    distill_text.add_argument(
        "--distill-texts",
        type=int,
        default=text_defaults.distill_texts,
        help="how many texts --distill-data stdlib distills on",
    )
    distill_text.add_argument(
        "--gelu-degree",
        type=int,
        default=text_defaults.gelu_degree,
        help="degree of the least-squares GELU fit (2: depth 2, 4: depth 3); 0: the paper's "
        "quadratic Quad without a channel scale",
    )
    distill_text.add_argument(
        "--gelu-radius",
        type=float,
        default=text_defaults.gelu_radius,
        help="the GELU fit's domain [-radius, radius]",
    )
    distill_text.add_argument(
        "--no-gelu-channel-scale",
        action="store_true",
        help="no per-channel input scale around the GELU polynomial",
    )
    distill_text.add_argument(
        "--no-ablation",
        action="store_true",
        help="skip scoring the teacher's weights with one approximation at a time",
    )
    distill_text.add_argument("--epochs", type=int, default=text_defaults.epochs)
    distill_text.add_argument("--batch-size", type=int, default=text_defaults.batch_size)
    distill_text.add_argument("--lr-stage1", type=float, default=text_defaults.lr_stage1)
    distill_text.add_argument("--lr-stage2", type=float, default=text_defaults.lr_stage2)
    distill_text.add_argument(
        "--calibration-batches", type=int, default=text_defaults.calibration_batches
    )
    distill_text.add_argument("--results-dir", type=Path, default=Path("results"))
    distill_text.add_argument("--no-progress", action="store_true", help="no progress bar")
    distill_text.set_defaults(handler=_distill_text)

    sweep = commands.add_parser(
        "sweep", help="Tables 5/6: vary the exp degree or inverse iterations"
    )
    _add_run_arguments(sweep)
    sweep.add_argument("--kind", choices=("exp", "inverse"), required=True)
    sweep.add_argument(
        "--values",
        type=_optional_int,
        nargs="+",
        default=None,
        help="degrees/iterations to try (default: the paper's list plus exact)",
    )
    sweep.add_argument("--workdir", type=Path, default=Path("runs/sweep"))
    sweep.add_argument("--results-dir", type=Path, default=Path("results"))
    sweep.set_defaults(handler=_sweep)

    bench = commands.add_parser("bench", help="latency of the FHE-friendly vs the exact model")
    _add_run_arguments(bench)
    bench.add_argument("--bench-batch-size", type=int, default=8)
    bench.add_argument("--repeats", type=int, default=20)
    bench.add_argument("--workdir", type=Path, default=Path("runs/bench"))
    bench.add_argument("--results-dir", type=Path, default=Path("results"))
    bench.set_defaults(handler=_bench)

    adapt = commands.add_parser(
        "adapt", help="federated adaptation in one process (ours, linear probing, full FT)"
    )
    _add_run_arguments(adapt, protocol=True)
    _add_protocol_arguments(adapt)
    adapt.add_argument(
        "--method", choices=("ours", "linear-probe", "full-finetune"), default="ours"
    )
    adapt.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="save after every round and resume from there when run again",
    )
    adapt.add_argument(
        "--output", type=Path, default=None, help="JSON history (default runs/adapt/<method>.json)"
    )
    adapt.set_defaults(handler=_adapt)

    bench_protocol = commands.add_parser(
        "bench-protocol", help="wall time, round trips and bytes per round; ours vs LP vs FT"
    )
    _add_run_arguments(bench_protocol, protocol=True)
    _add_protocol_arguments(bench_protocol)
    bench_protocol.add_argument("--results-dir", type=Path, default=Path("results"))
    bench_protocol.add_argument(
        "--repeats", type=int, default=4, help="runs of ours and of LP (ABBA order) for timing"
    )
    bench_protocol.add_argument(
        "--threads", type=int, default=1, help="torch threads while timing (CPU time = work)"
    )
    bench_protocol.set_defaults(handler=_bench_protocol)

    bench_extraction = commands.add_parser(
        "bench-extraction", help="model-extraction attacks from a curious client's view"
    )
    _add_run_arguments(bench_extraction, protocol=True)
    _add_protocol_arguments(bench_extraction, rounds=3)
    bench_extraction.add_argument("--results-dir", type=Path, default=Path("results"))
    bench_extraction.add_argument(
        "--no-mlp", action="store_true", help="skip the MLP fit of attack (b) (faster)"
    )
    bench_extraction.set_defaults(handler=_bench_extraction)

    red_team = commands.add_parser(
        "red-team",
        help="every attack on fedfm's promises against the current code (results/red_team.*)",
    )
    _add_run_arguments(red_team, protocol=True)
    _add_protocol_arguments(red_team, rounds=3)
    red_team.add_argument("--results-dir", type=Path, default=Path("results"))
    red_team.add_argument(
        "--skip-extraction",
        action="store_true",
        help="leave out the extraction attacks (they need the distilled student in --workdir)",
    )
    red_team.add_argument(
        "--protocols",
        default="all",
        help="protocol attack suites to run besides double-blind's: 'all', 'none' or a comma "
        "list (e.g. fedrag)",
    )
    red_team.set_defaults(handler=_red_team)

    bench_reveal = commands.add_parser(
        "bench-reveal", help="tap sets: accuracy against a curious client's fits"
    )
    _add_run_arguments(bench_reveal, protocol=True)
    _add_protocol_arguments(bench_reveal)
    bench_reveal.add_argument("--results-dir", type=Path, default=Path("results"))
    bench_reveal.add_argument(
        "--reveals", nargs="+", default=["all", "every-other", "last-two"], help="tap sets"
    )
    bench_reveal.set_defaults(handler=_bench_reveal)

    bench_ckks = commands.add_parser(
        "bench-ckks", help="one encrypted block under CKKS: time, refreshes, bytes, error"
    )
    _add_run_arguments(bench_ckks)
    bench_ckks.add_argument("--workdir", type=Path, default=Path("runs/distill"))
    bench_ckks.add_argument("--backend", default="ckks", help="ckks (N=16384) or ckks-8192")
    bench_ckks.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[16, 64, 256], help="samples per batch"
    )
    bench_ckks.add_argument("--block", type=int, default=1, help="which block (1-based)")
    bench_ckks.add_argument(
        "--forward-batch",
        type=int,
        default=16,
        help="also run every block on this many images and compare predictions (0: skip)",
    )
    bench_ckks.add_argument(
        "--calibrate",
        action="store_true",
        help="also record the largest refreshed value per refresh place over every block "
        "(the refresh's value bound; untimed)",
    )
    bench_ckks.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure each batch size this many times and report the median run",
    )
    bench_ckks.add_argument("--results-dir", type=Path, default=Path("results"))
    bench_ckks.set_defaults(handler=_bench_ckks)

    bench_text = commands.add_parser(
        "bench-ckks-text",
        help="one encrypted block of the FHE-friendly MiniLM under CKKS, and a forward pass",
    )
    bench_text.add_argument(
        "--model",
        default="minilm",
        help="'minilm' (packaged, offline) or a BERT/DistilBERT name or folder on this machine",
    )
    bench_text.add_argument(
        "--backend", default="ckks-8192", help="ckks-8192 (default) or ckks (N=16384)"
    )
    bench_text.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[64], help="texts per batch"
    )
    bench_text.add_argument("--block", type=int, default=1, help="which block (1-based)")
    bench_text.add_argument(
        "--forward-batch",
        type=int,
        default=8,
        help="also run every block on this many texts and compare predictions (0: skip)",
    )
    bench_text.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure each batch size this many times and report the median run",
    )
    bench_text.add_argument(
        "--student-dir",
        type=Path,
        default=Path("runs/text"),
        help="the kept text student (`fedfm paper-text`'s; distilled when missing)",
    )
    bench_text.add_argument("--results-dir", type=Path, default=Path("results"))
    bench_text.set_defaults(handler=_bench_ckks_text)

    bench_runtime = commands.add_parser(
        "bench-runtime", help="end-to-end channel vs plain relaying: bytes and time per message"
    )
    bench_runtime.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="payload sizes in bytes (default: 1 KiB, 64 KiB, 1 MiB, 16 MiB)",
    )
    bench_runtime.add_argument("--repeats", type=int, default=20, help="messages per size")
    bench_runtime.add_argument(
        "--vector-length", type=int, default=1024, help="length of the masked-sum example's vectors"
    )
    bench_runtime.add_argument("--results-dir", type=Path, default=Path("results"))
    bench_runtime.set_defaults(handler=_bench_runtime)

    helix_eval = commands.add_parser(
        "helix-eval", help="HELIX: Tables 1/4 accuracy and OOD AUROC, App. J membership inference"
    )
    _helix_data_arguments(helix_eval)
    helix_eval.add_argument(
        "--pairs",
        nargs="+",
        default=["minilm,lsa", "lsa,minilm"],
        help="provider,client encoder pairs: minilm, lsa[:<dims>], hf:<name|path>",
    )
    helix_eval.add_argument("--repeats", type=int, default=3, help="few-shot draws per setting")
    helix_eval.add_argument("--shadows", type=int, default=100, help="App. J shadow mappers")
    helix_eval.set_defaults(handler=_helix_eval)

    bench_helix = commands.add_parser(
        "bench-helix", help="HELIX inference: ms and bytes per query, encrypted vs plaintext"
    )
    _helix_data_arguments(bench_helix)
    bench_helix.add_argument("--provider", default="minilm", help="provider's encoder")
    bench_helix.add_argument("--client", default="lsa", help="client's encoder")
    bench_helix.add_argument("--batch-size", type=int, default=4096, help="queries per batch")
    bench_helix.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    bench_helix.set_defaults(handler=_bench_helix)

    paper = commands.add_parser(
        "paper", help="the paper's Tables 2-4 and Figure 3 (tables 2, 3 resume cell by cell)"
    )
    _add_run_arguments(paper)
    paper.add_argument(
        "table", help="table2, table3 (or another table of the config), table4 (efficiency)"
    )
    paper.add_argument(
        "--config",
        type=Path,
        default=None,
        help="experiment TOML (fedfm/experiments/paper.toml)",
    )
    paper.add_argument("--seeds", type=int, nargs="+", default=None, help="override the seeds")
    paper.add_argument("--rounds", type=int, default=None, help="override the rounds")
    paper.add_argument("--workdir", type=Path, default=Path("runs/distill"))
    paper.add_argument(
        "--cells-dir",
        type=Path,
        default=Path("runs/paper"),
        help="finished cells are kept here; a re-run skips them",
    )
    paper.add_argument("--results-dir", type=Path, default=Path("results"))
    paper.set_defaults(handler=_paper)

    paper_text = commands.add_parser(
        "paper-text",
        help="linear probing, ours and full fine-tuning of the FHE-friendly MiniLM on the "
        "docstring task (results/text_adaptation.*; resumes cell by cell)",
    )
    paper_text.add_argument(
        "--model",
        default="minilm",
        help="'minilm' (packaged, offline) or a BERT/DistilBERT name or folder on this machine",
    )
    paper_text.add_argument(
        "--config", type=Path, default=None, help="experiment TOML (fedfm/experiments/paper.toml)"
    )
    paper_text.add_argument(
        "--table",
        default="text",
        help="the config's text table: text (Tables 2-3: K and alpha) or text_table1 (D_aux in "
        "and out of distribution, results/text_adaptation_table1.*)",
    )
    paper_text.add_argument("--seeds", type=int, nargs="+", default=None, help="override the seeds")
    paper_text.add_argument("--rounds", type=int, default=None, help="override the rounds")
    paper_text.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=("linear-probe", "full-finetune", "ours"),
        help="run only these methods (default: the table's)",
    )
    paper_text.add_argument(
        "--settings",
        nargs="+",
        default=None,
        metavar="LABEL",
        help="run only the settings with these labels, e.g. 'K=5 alpha=1' (default: all)",
    )
    paper_text.add_argument(
        "--student-dir",
        type=Path,
        default=Path("runs/text"),
        help="distilled students are kept here (distilled when missing)",
    )
    paper_text.add_argument(
        "--cells-dir",
        type=Path,
        default=Path("runs/paper-text"),
        help="finished cells are kept here; a re-run skips them",
    )
    paper_text.add_argument("--results-dir", type=Path, default=Path("results"))
    paper_text.add_argument(
        "--kept-only",
        action="store_true",
        help="run nothing: write the table from the finished cells (a long run so far)",
    )
    paper_text.add_argument("--no-progress", action="store_true", help="one line per cell")
    paper_text.add_argument(
        "--protocol",
        action="store_true",
        help="ours and linear probing through the double-blind protocol itself (simulate "
        "backend, secure aggregation; slower): results/text_adaptation_protocol.*",
    )
    paper_text.add_argument(
        "--hide-text-lengths",
        action="store_true",
        help="ours and linear probing with every data owner hiding its texts' lengths (node "
        "config hide-text-lengths: all-real key masks; what that costs): "
        "results/text_adaptation[_protocol]_hidden_lengths.*",
    )
    paper_text.add_argument(
        "--select-lr",
        action="store_true",
        help="instead of the table: choose ours' and linear probing's learning rates on the "
        "texts each client holds out of its pool partition (never the test texts; --seeds "
        "default 100 101): results/text_lr_selection[_<table>].*, the config's lr entry; "
        "with --methods full-finetune, full fine-tuning's (its own grid and "
        "results/text_lr_selection[_<table>]_full_finetune.*); with --hide-text-lengths, "
        "the rates of data owners that hide lengths (results/text_lr_selection[_<table>]"
        "_hidden_lengths.*, the config's lr_hidden_lengths entry)",
    )
    paper_text.add_argument(
        "--lr-grid",
        type=float,
        nargs="+",
        default=None,
        metavar="LR",
        help="the rates --select-lr tries (default 0.01 0.02 0.05 0.1 0.2; full fine-tuning "
        "0.0025 0.01 0.04)",
    )
    paper_text.set_defaults(handler=_paper_text)

    train_llm = commands.add_parser(
        "train-llm",
        help="train the embedded decoder LLM (a small Llama) on standard-library docstrings, "
        "cache it, report held-out perplexity (resumes when rerun)",
    )
    _add_train_llm_arguments(train_llm)
    train_llm.set_defaults(handler=_train_llm)

    bench_fedrag = commands.add_parser(
        "bench-fedrag",
        help="FedRAG: TTFT, decode tok/s, traffic, round trips vs secret sharing and plaintext; "
        "fp32 equality with plaintext RAG; bf16 scrambler error (App. A)",
    )
    _fedrag_arguments(bench_fedrag)
    bench_fedrag.add_argument("--queries", type=int, default=20, help="accuracy queries (20)")
    bench_fedrag.add_argument("--tokens", type=int, default=32, help="tokens per query (32)")
    bench_fedrag.add_argument(
        "--contexts", default="24,48", help="tokens per owner for the timing runs (24,48)"
    )
    bench_fedrag.add_argument(
        "--bench-tokens", type=int, default=16, help="generated tokens in timing runs (16)"
    )
    bench_fedrag.add_argument("--repeats", type=int, default=3, help="timing runs (3)")
    bench_fedrag.set_defaults(handler=_bench_fedrag)

    ablation = commands.add_parser(
        "fedrag-ablation",
        help="FedRAG Table 3: baseline / +distributed / +scrambler on docstring continuation",
    )
    _fedrag_arguments(ablation)
    ablation.add_argument("--queries", type=int, default=40, help="queries (40)")
    ablation.set_defaults(handler=_fedrag_ablation)

    attacks = commands.add_parser(
        "fedrag-attacks",
        help="FedRAG §6: kNN overlap vs rows and scaling range (with bf16 error), ICA, known "
        "plaintext",
    )
    attacks.add_argument("--results-dir", type=Path, default=Path("results"))
    attacks.set_defaults(handler=_fedrag_attacks)
    _add_slip_commands(commands)
    _add_centaur_commands(commands)
    _add_site_command(commands)
    _add_executor_command(commands)
    _add_bench_round_command(commands)
    return parser


def _fedrag_attacks(args: argparse.Namespace) -> None:
    from fedfm.experiments.fedrag_attacks import run_fedrag_attacks

    run_fedrag_attacks(results_dir=args.results_dir)


def _fedrag_arguments(parser: argparse.ArgumentParser) -> None:
    from fedfm.protocols.fedrag.defaults import DEFAULTS

    parser.add_argument("--decoder", default=DEFAULTS["decoder"], help="decoder (embedded name)")
    parser.add_argument("--decoder-cache", type=Path, default=Path(str(DEFAULTS["decoder-cache"])))
    parser.add_argument("--results-dir", type=Path, default=Path("results"))


def _bench_fedrag(args: argparse.Namespace) -> None:
    from fedfm.experiments.fedrag_bench import run_fedrag_benchmark

    try:
        contexts = tuple(int(x) for x in args.contexts.split(","))
    except ValueError:
        raise FedfmError(f"--contexts takes integers like 24,48, got {args.contexts!r}") from None
    run_fedrag_benchmark(
        decoder=args.decoder,
        decoder_cache=args.decoder_cache,
        queries=args.queries,
        tokens=args.tokens,
        contexts=contexts,
        bench_tokens=args.bench_tokens,
        repeats=args.repeats,
        results_dir=args.results_dir,
    )


def _fedrag_ablation(args: argparse.Namespace) -> None:
    from fedfm.experiments.fedrag_bench import run_fedrag_ablation

    run_fedrag_ablation(
        decoder=args.decoder,
        decoder_cache=args.decoder_cache,
        queries=args.queries,
        results_dir=args.results_dir,
    )


# -- SLIP (issue 21) -------------------------------------------------------------------------------


def _add_slip_commands(commands: argparse._SubParsersAction) -> None:
    """``fedfm bench-slip``, ``fedfm slip-figures``, ``fedfm slip-finetune``."""
    from fedfm.protocols.slip.defaults import DEFAULTS

    bench = commands.add_parser(
        "bench-slip",
        help="SLIP: output error, Charlie's FLOPs share, time, bytes, round trips per "
        "configuration; David-only utility; one layer under CKKS (results/slip.json)",
    )
    bench.add_argument(
        "--models", default="minilm,llama_fedfm_tiny", help="minilm and/or decoder names"
    )
    bench.add_argument("--blocks", default=str(DEFAULTS["blocks"]), help="split blocks")
    bench.add_argument("--layers", default=str(DEFAULTS["layers"]), help="split layer types")
    bench.add_argument(
        "--rank", type=int, default=None, help="k for every model (default: minilm 16, decoder 8)"
    )
    bench.add_argument("--repeats", type=int, default=3, help="timing runs (3)")
    bench.add_argument("--no-he", action="store_true", help="skip the CKKS baseline")
    bench.add_argument("--decoder-cache", type=Path, default=Path(str(DEFAULTS["decoder-cache"])))
    bench.add_argument("--results-dir", type=Path, default=Path("results"))
    bench.set_defaults(handler=_bench_slip)
    figures = commands.add_parser(
        "slip-figures",
        help="SLIP Fig. 12 (perplexity vs singular components removed, per layer type) and "
        "Fig. 13 (bypassed blocks), with a plot",
    )
    figures.add_argument("--model", default=str(DEFAULTS["model"]), help="decoder")
    figures.add_argument("--blocks", type=int, default=8, help="held-out blocks (8)")
    figures.add_argument("--decoder-cache", type=Path, default=Path(str(DEFAULTS["decoder-cache"])))
    figures.add_argument("--results-dir", type=Path, default=Path("results"))
    figures.set_defaults(handler=_slip_figures)
    finetune = commands.add_parser(
        "slip-finetune",
        help="SLIP Fig. 14: David fine-tunes his W_D-only model on public text, per "
        "decomposition configuration",
    )
    finetune.add_argument("--model", default=str(DEFAULTS["model"]), help="decoder")
    finetune.add_argument("--steps", type=int, default=80, help="fine-tuning steps (80)")
    finetune.add_argument(
        "--public-blocks", type=int, default=256, help="public training blocks (256)"
    )
    finetune.add_argument(
        "--decoder-cache", type=Path, default=Path(str(DEFAULTS["decoder-cache"]))
    )
    finetune.add_argument("--results-dir", type=Path, default=Path("results"))
    finetune.set_defaults(handler=_slip_finetune)
    attacks = commands.add_parser(
        "slip-attacks",
        help="SLIP: David's attacks on W_C (the red team's SLIP suite) with their controls",
    )
    attacks.add_argument("--results-dir", type=Path, default=Path("results"))
    attacks.set_defaults(handler=_slip_attacks)


def _bench_slip(args: argparse.Namespace) -> None:
    from fedfm.experiments.slip_bench import run_bench_slip

    models = tuple(name.strip() for name in args.models.split(",") if name.strip())
    run_bench_slip(
        models=models,
        blocks=args.blocks,
        layers=args.layers,
        ranks={name: args.rank for name in models} if args.rank is not None else None,
        repeats=args.repeats,
        cache_dir=args.decoder_cache,
        he=not args.no_he,
        results_dir=args.results_dir,
        command=args.command_line,
    )


def _slip_figures(args: argparse.Namespace) -> None:
    from fedfm.experiments.slip_figures import run_slip_figures

    run_slip_figures(
        model=args.model,
        cache_dir=args.decoder_cache,
        blocks=args.blocks,
        results_dir=args.results_dir,
        command=args.command_line,
    )


def _slip_finetune(args: argparse.Namespace) -> None:
    from fedfm.experiments.slip_figures import run_slip_finetune

    run_slip_finetune(
        model=args.model,
        cache_dir=args.decoder_cache,
        steps=args.steps,
        public_blocks=args.public_blocks,
        results_dir=args.results_dir,
        command=args.command_line,
    )


def _slip_attacks(args: argparse.Namespace) -> None:
    from fedfm.experiments.slip_attacks import run_slip_attacks

    run_slip_attacks(results_dir=args.results_dir, command=args.command_line)


# -- CENTAUR (issue 22) ----------------------------------------------------------------------------


def _add_centaur_commands(commands: argparse._SubParsersAction) -> None:
    """CENTAUR's commands (issue 22)."""

    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--cache-dir", type=Path, default=Path("runs/cache"))
        parser.add_argument("--results-dir", type=Path, default=Path("results"))

    bench = commands.add_parser(
        "bench-centaur",
        help="CENTAUR (faithful, hardened) vs full secret sharing on the runtime: time, bytes, "
        "rounds per inference and per layer type under lan and wan; logits vs plaintext",
    )
    common(bench)
    bench.add_argument("--repeats", type=int, default=3, help="timing runs (3)")
    bench.add_argument("--queries", type=int, default=3, help="encoder inputs checked (3)")
    bench.add_argument("--tokens", type=int, default=4, help="decoder tokens generated (4)")
    bench.set_defaults(handler=_bench_centaur)
    accuracy = commands.add_parser(
        "centaur-accuracy",
        help="CENTAUR Table 2: classifier accuracy and decoder perplexity, plaintext vs CENTAUR "
        "vs MPCFormer's quadratics without distillation",
    )
    common(accuracy)
    accuracy.add_argument("--queries", type=int, default=70, help="classifier queries (70)")
    accuracy.set_defaults(handler=_centaur_accuracy)
    attacks = commands.add_parser(
        "centaur-attacks",
        help="CENTAUR Table 1 and the cloud's attacks (row, sorted-row, vocabulary matching, "
        "permutation recovery, learned inversion), faithful and hardened",
    )
    common(attacks)
    attacks.set_defaults(handler=_centaur_attacks)


def _bench_centaur(args: argparse.Namespace) -> None:
    from fedfm.experiments.centaur_bench import run_centaur_benchmark

    run_centaur_benchmark(
        results_dir=args.results_dir,
        cache_dir=args.cache_dir,
        repeats=args.repeats,
        queries=args.queries,
        tokens=args.tokens,
    )


def _centaur_accuracy(args: argparse.Namespace) -> None:
    from fedfm.experiments.centaur_bench import run_centaur_accuracy

    run_centaur_accuracy(
        results_dir=args.results_dir, cache_dir=args.cache_dir, queries=args.queries
    )


def _centaur_attacks(args: argparse.Namespace) -> None:
    from fedfm.experiments.centaur_attacks import run_centaur_attacks

    run_centaur_attacks(results_dir=args.results_dir, cache_dir=args.cache_dir)


# -- a data owner's site process (issue 23) --------------------------------------------------------


def _add_bench_round_command(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench-round",
        help="one encrypted round in process and on a local Deployment Engine with site "
        "processes: seconds, round trips, where the time went (results/deployment.*)",
    )
    bench.add_argument("--workdir", type=Path, default=Path("runs/distill"))
    bench.add_argument("--backend", default="ckks-8192", help="ckks-8192 (default), ckks, simulate")
    bench.add_argument("--clients", type=int, default=3)
    bench.add_argument("--batch-size", type=int, default=16)
    bench.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds per run (2): round 1 evaluates under encryption, later rounds on the "
        "clients' kept outputs",
    )
    bench.add_argument("--max-samples", type=int, default=None, help="cap each split")
    bench.add_argument(
        "--skip-deployment", action="store_true", help="only the in-process rounds (a)"
    )
    bench.add_argument(
        "--compare-clientapp",
        action="store_true",
        help="also run (b) with Flower's per-message ClientApp process (forwarding to site "
        "processes, and without them) instead of warm executors",
    )
    bench.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds a round trip may take (1800)"
    )
    bench.add_argument("--results-dir", type=Path, default=Path("results"))
    bench.add_argument("--name", default="deployment", help="results file name (deployment)")
    bench.set_defaults(handler=_bench_round)


def _bench_round(args: argparse.Namespace) -> None:
    from fedfm.experiments.bench_round import run_round_benchmark

    if args.clients < 2:
        raise FedfmError(f"--clients must be at least 2 (secure aggregation), got {args.clients}")
    run_round_benchmark(
        args.workdir,
        backend=args.backend,
        clients=args.clients,
        batch_size=args.batch_size,
        rounds=args.rounds,
        max_samples=args.max_samples,
        deployment=not args.skip_deployment,
        compare_clientapp=args.compare_clientapp,
        timeout=args.timeout,
        results_dir=args.results_dir,
        name=args.name,
        command=args.command_line,
        log=lambda line: print(line, flush=True),
    )


def _add_site_command(commands: argparse._SubParsersAction) -> None:
    site = commands.add_parser(
        "site",
        help="a data owner's long-lived site process beside its SuperNode: holds the role, keys "
        "and data in memory and answers the ClientApp over an owner-only local socket",
    )
    site.add_argument(
        "--dir",
        type=Path,
        required=True,
        help="the site folder (created 0700 with a fresh 0600 key); give the SuperNode "
        '--node-config "site-dir=<the same folder>"',
    )
    site.add_argument(
        "--node-config",
        default="",
        help="this data owner's own settings as key=value pairs (partition-id, num-partitions, "
        "its policy, identity-key, secagg-pins, device, ...); $FEDFM_NODE_CONFIG fills in the rest",
    )
    site.add_argument(
        "--protocol", default="double-blind", choices=["double-blind"], help="the role served"
    )
    site.set_defaults(handler=_site)


def _site(args: argparse.Namespace) -> None:
    import os
    import signal

    from fedfm.flower.apps import NODE_CONFIG_ENV, parse_node_config
    from fedfm.protocols.double_blind.client import ClientState
    from fedfm.protocols.double_blind.config import SETUP
    from fedfm.protocols.double_blind.node import data_owner_role
    from fedfm.runtime.site import Site

    own = {
        **parse_node_config(os.environ.get(NODE_CONFIG_ENV, "")),
        **parse_node_config(args.node_config),
    }
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda number, _frame: stopping.append(number))
    site = Site(
        args.dir,
        lambda run_config: data_owner_role(run_config, own),
        ClientState,
        opening=(SETUP,),
        log=lambda line: print(line, flush=True),
    )
    site.serve(stop=lambda: bool(stopping))
    print(f"[site] stopped after {site.answered} messages", flush=True)


def _add_executor_command(commands: argparse._SubParsersAction) -> None:
    executor = commands.add_parser(
        "executor",
        help="a warm ClientApp executor for a SuperNode started with --isolation process: runs "
        "every ClientApp task in one long-lived process instead of a fresh process per message",
    )
    executor.add_argument(
        "--runtime-api-address",
        required=True,
        help="host:port of the SuperNode's Runtime API (flower-supernode --port)",
    )
    executor.add_argument(
        "--root-certificates",
        type=Path,
        default=None,
        help="CA of the Runtime API's TLS certificate (flower-supernode --ssl-certfile); "
        "without it the executor talks plain HTTP on the SuperNode's own host",
    )
    executor.add_argument(
        "--superexec-auth-secret-file",
        type=Path,
        default=None,
        help="the secret file the SuperNode was started with (flower-supernode "
        "--superexec-auth-secret-file): only its holders get tasks; mode 600",
    )
    executor.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        help="seconds between two polls for a task while idle (default 0.05)",
    )
    executor.set_defaults(handler=_executor)


def _executor(args: argparse.Namespace) -> None:
    import signal

    from fedfm.flower.executor import DEFAULT_POLL_INTERVAL, ClientAppExecutor

    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda number, _frame: stopping.append(number))
    executor = ClientAppExecutor(
        args.runtime_api_address,
        root_certificates=args.root_certificates,
        auth_secret_file=args.superexec_auth_secret_file,
        poll_interval=DEFAULT_POLL_INTERVAL if args.poll_interval is None else args.poll_interval,
        log=lambda line: print(line, flush=True),
    )
    try:
        executor.serve(stop=lambda: bool(stopping))
    finally:
        executor.close()
    print(f"[executor] stopped after {executor.tasks_run} tasks", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedfm`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["fedfm", *(sys.argv[1:] if argv is None else argv)])
    try:
        if getattr(args, "device", None) is not None:
            from fedfm.models.device import resolve_device

            resolve_device(args.device)  # before any work: one line if torch sees no such GPU
        args.handler(args)
    except (FedfmError, OSError) as error:  # OSError: unusable folders, full disk, ...
        print(f"fedfm: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedfm: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
