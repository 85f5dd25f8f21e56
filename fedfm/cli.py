"""The ``fedfm`` command line.

``fedfm distill``  the server's offline step: teacher on D_aux, FHE-friendly student, report.
``fedfm sweep``    Tables 5/6 style sweeps of the exp degree or the inverse iterations.
``fedfm bench``    plaintext latency of the FHE-friendly model relative to the exact model.

Errors fedfm raises on purpose are printed as one line (``fedfm: error: ...``), exit status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from fedfm.errors import FedfmError


def _optional_int(text: str) -> int | None:
    """An integer, or ``exact`` for the exact function."""
    if text.lower() in {"exact", "none", "inf"}:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'exact', got {text!r}") from None


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
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
        help="embedded ViT (vit_fedfm_tiny, vit_fedfm_small) or a timm ViT name",
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
    data.add_argument("--seed", type=int, default=0)
    approx = parser.add_argument_group("approximations (integer or 'exact')")
    approx.add_argument("--exp-degree", type=_optional_int, default=6)
    approx.add_argument("--inverse-iterations", type=_optional_int, default=7)
    approx.add_argument("--inv-sqrt-iterations", type=_optional_int, default=5)
    approx.add_argument("--exact-gelu", action="store_true", help="keep GELU exact")
    train = parser.add_argument_group("training")
    train.add_argument("--teacher-epochs", type=int, default=40)
    train.add_argument("--epochs", type=int, default=8, help="distillation epochs, half per stage")
    train.add_argument("--batch-size", type=int, default=16)
    train.add_argument("--lr-stage1", type=float, default=1e-4)
    train.add_argument("--lr-stage2", type=float, default=1e-5)
    train.add_argument("--temperature", type=float, default=5.0)
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("runs/cache"),
        help="where pretrained teachers are cached",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _run_from_args(args: argparse.Namespace, workdir: Path):  # -> DistillRun
    from fedfm.distill import DistillConfig
    from fedfm.pipeline import ApproxSettings, DistillRun
    from fedfm.training import PretrainConfig

    return DistillRun(
        dataset=args.dataset,
        data_root=args.data_root,
        model=args.model,
        checkpoint=args.checkpoint,
        image_size=args.image_size,
        max_samples=args.max_samples,
        seed=args.seed,
        approx=ApproxSettings(
            exp_degree=args.exp_degree,
            inverse_iterations=args.inverse_iterations,
            inv_sqrt_iterations=args.inv_sqrt_iterations,
            gelu=not args.exact_gelu,
        ),
        teacher=PretrainConfig(epochs=args.teacher_epochs, seed=args.seed),
        distill=DistillConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr_stage1=args.lr_stage1,
            lr_stage2=args.lr_stage2,
            temperature=args.temperature,
            seed=args.seed,
        ),
        workdir=workdir,
        cache_dir=args.cache_dir,
    )


def _distill(args: argparse.Namespace) -> None:
    from fedfm.pipeline import run_distillation

    run_distillation(
        _run_from_args(args, args.workdir), restart=args.restart, progress=not args.no_progress
    )


def _sweep(args: argparse.Namespace) -> None:
    from fedfm.sweep import run_sweep

    run_sweep(
        _run_from_args(args, args.workdir),
        kind=args.kind,
        values=args.values,
        results_dir=args.results_dir,
        progress=not args.no_progress,
        command=args.command_line,
    )


def _bench(args: argparse.Namespace) -> None:
    from fedfm.bench import run_latency_benchmark

    run_latency_benchmark(
        _run_from_args(args, args.workdir),
        batch_size=args.bench_batch_size,
        repeats=args.repeats,
        results_dir=args.results_dir,
        command=args.command_line,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedfm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    distill = commands.add_parser(
        "distill", help="train the teacher and distill its FHE-friendly student"
    )
    _add_run_arguments(distill)
    distill.add_argument("--workdir", type=Path, default=Path("runs/distill"))
    distill.add_argument(
        "--restart",
        action="store_true",
        help="discard a saved distillation state instead of resuming it",
    )
    distill.set_defaults(handler=_distill)

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedfm`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["fedfm", *(sys.argv[1:] if argv is None else argv)])
    try:
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
