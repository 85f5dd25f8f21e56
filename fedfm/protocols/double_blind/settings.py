"""The run configuration of the double-blind Flower apps, as plain values.

Flower hands both apps ``context.run_config``: the ``[tool.flwr.app.config]`` table of the app's
``pyproject.toml`` with ``flwr run --run-config`` overrides, kebab-case keys, TOML scalars. This
module turns such a mapping into the library's settings objects, so that the ServerApp, the
ClientApp and the in-process runner build exactly the same data, federation and protocol
configuration from the same values. It knows nothing of Flower itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fedfm.data.text_task import TEXT_DATASET
from fedfm.errors import ConfigError
from fedfm.models.foundation import DEFAULT_MODEL
from fedfm.models.student import StudentSource, TextStudentSource
from fedfm.protocols.double_blind.config import DoubleBlindConfig
from fedfm.protocols.double_blind.defaults import FEDERATION, PROTOCOL
from fedfm.protocols.double_blind.runner import Federation

RunValue = int | float | str | bool


def _kebab(name: str) -> str:
    return name.replace("_", "-")


# Every key the apps read, with its default: the protocol's and the federation's from the one
# table (fedfm.protocols.double_blind.defaults), the rest belong to the apps alone.
# simulations/double_blind/pyproject.toml repeats them (a test checks that both agree). Empty
# strings and zeros mean "not set" where noted in README.
DEFAULTS: dict[str, RunValue] = {
    **{_kebab(name): value for name, value in PROTOCOL._asdict().items()},
    # public: seeds the data split and the partition, never a party's secret (the server's
    # draws come from its own secret stream; see strategies/double_blind.py)
    "seed": FEDERATION.seed,
    # data and federation
    "dataset": StudentSource.dataset,
    "data-root": "",
    "num-clients": FEDERATION.num_clients,
    "partition": FEDERATION.scheme,
    "dirichlet-alpha": FEDERATION.alpha,
    # the server's model: the distilled student in `workdir` (made offline by `fedfm distill`)
    "model": DEFAULT_MODEL,
    "image-size": 0,
    "max-samples": 0,
    "workdir": str(StudentSource.workdir),
    # the ServerApp's driver
    "strategy": "fedavg",
    "timeout": 300.0,
    "secagg-timeout": 30.0,
    "connect-timeout": 60.0,
    "pipelined": False,
    "keep-warm": False,
    "min-clients": 1,
    "checkpoint-dir": "",
    # where each app's plaintext torch runs (fedfm.models.device: auto, cpu, cuda, cuda:N); a
    # data owner's node config key 'device' overrides it for its ClientApp. In simulation,
    # Flower/Ray gives a ClientApp the GPU share of options.backend.client-resources.num-gpus.
    "device": "auto",
}


@dataclass(frozen=True)
class AppSettings:
    """Everything the double-blind apps take from a run configuration.

    Attributes
    ----------
    student:
        The server model's work directory and the data it was distilled for: the ServerApp loads
        the student from it (refusing, with the command that makes it, when there is none); both
        apps load the dataset splits with it. With ``dataset = "docstrings"`` a
        :class:`~fedfm.models.student.TextStudentSource`: a text encoder's kept student in
        ``workdir`` (refused, naming the command that makes it, when there is none) and the
        docstring task.
    protocol:
        The protocol configuration the server sends at setup.
    federation:
        Number of clients, partition scheme, Dirichlet alpha and seed of the partitioning.
    strategy:
        ``fedavg``, ``fedadam``, ``fedprox`` or ``module:attribute`` naming a Flower strategy.
    timeout:
        Seconds to wait for the replies of one round trip; ``None`` waits as long as it takes.
    secagg_timeout:
        The same for each SecAgg stage (cheap for the clients, so shorter: a client that stops
        answering delays the round by this much, not by ``timeout``).
    connect_timeout:
        Seconds the ServerApp waits for ``num_clients`` nodes to connect.
    min_clients:
        Fewest clients that must complete setup and each round's training.
    pipelined:
        Send each client its next training or evaluation request as soon as its reply is
        answered, not once every client's reply is in (the server's scheduling; what each client
        receives is the same).
    keep_warm:
        Follow each request with a hold message for its node (answered after about the
        server's usual answer time for that node), so that a Flower SuperNode is busy with the
        hold, not in its fixed 3-s idle sleep, when the node's next request goes out. For the
        Deployment Engine with warm executors (``fedfm executor``); each hold costs a ClientApp
        call, so not with a ``flwr-clientapp`` process per message.
    checkpoint_dir:
        Where the driver saves the global adapter and history after every round (``None``: no
        checkpoints, no resuming).
    device:
        Where the apps' plaintext torch runs (``auto``, ``cpu``, ``cuda``, ``cuda:N``; checked
        by :func:`fedfm.models.device.resolve_device` where it is used).
    """

    student: StudentSource | TextStudentSource
    protocol: DoubleBlindConfig
    federation: Federation
    strategy: str
    timeout: float | None
    secagg_timeout: float | None
    connect_timeout: float
    min_clients: int
    checkpoint_dir: Path | None
    device: str = "auto"
    pipelined: bool = False
    keep_warm: bool = False


def _typed(values: Mapping[str, object], key: str) -> RunValue:
    value = values.get(key, DEFAULTS[key])
    default = DEFAULTS[key]
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # TOML writes 1 for 1.0
    if type(value) is not type(default):
        raise ConfigError(f"run config {key!r} must be {type(default).__name__}, got {value!r}")
    return value


def app_settings(run_config: Mapping[str, object]) -> AppSettings:
    """Settings from a Flower run configuration (missing keys take :data:`DEFAULTS`).

    Raises
    ------
    ConfigError
        If a key is unknown, a value has the wrong type, or a setting is out of range.
    """
    unknown = sorted(set(run_config) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown run config keys {unknown}; known: {sorted(DEFAULTS)}")
    v = {key: _typed(run_config, key) for key in DEFAULTS}
    seed = int(v["seed"])
    if seed < 0:
        raise ConfigError(f"run config 'seed' must be >= 0, got {seed}")
    student: StudentSource | TextStudentSource = StudentSource(
        dataset=str(v["dataset"]),
        data_root=str(v["data-root"]) or None,
        model=str(v["model"]),
        image_size=int(v["image-size"]) or None,
        max_samples=int(v["max-samples"]) or None,
        seed=seed,
        workdir=Path(str(v["workdir"])),
    )
    if v["dataset"] == TEXT_DATASET:
        student = _text_source(v)
    protocol = DoubleBlindConfig(
        rounds=int(v["rounds"]),
        batch_size=int(v["batch-size"]),
        batches_per_round=int(v["batches-per-round"]),
        rank=int(v["rank"]),
        alpha=float(v["alpha"]),
        lr=float(v["lr"]),
        momentum=float(v["momentum"]),
        lr_decay=bool(v["lr-decay"]),
        backend=str(v["backend"]),
        eval_fraction=float(v["eval-fraction"]),
        evaluate_every=int(v["evaluate-every"]),
        reveal=str(v["reveal"]),
        secure_aggregation=bool(v["secure-aggregation"]),
        secagg_clipping_range=float(v["secagg-clipping-range"]),
        secagg_bits=int(v["secagg-bits"]),
        secagg_neighbours=int(v["secagg-neighbours"]),
        secagg_threshold=int(v["secagg-threshold"]),
    )
    federation = Federation(
        num_clients=int(v["num-clients"]),
        scheme=str(v["partition"]),
        alpha=float(v["dirichlet-alpha"]),
        seed=seed,
    )
    timeout, secagg_timeout = float(v["timeout"]), float(v["secagg-timeout"])
    if min(timeout, secagg_timeout, float(v["connect-timeout"])) < 0:
        raise ConfigError(
            "timeouts must be >= 0 (a 'timeout' or 'secagg-timeout' of 0 means no timeout)"
        )
    if int(v["min-clients"]) < 1:
        raise ConfigError(f"min-clients must be >= 1, got {v['min-clients']}")
    return AppSettings(
        student=student,
        protocol=protocol,
        federation=federation,
        strategy=str(v["strategy"]),
        timeout=timeout or None,
        secagg_timeout=secagg_timeout or None,
        connect_timeout=float(v["connect-timeout"]),
        min_clients=int(v["min-clients"]),
        checkpoint_dir=Path(str(v["checkpoint-dir"])) if v["checkpoint-dir"] else None,
        device=str(v["device"]),
        pipelined=bool(v["pipelined"]),
        keep_warm=bool(v["keep-warm"]),
    )


def _text_source(values: Mapping[str, RunValue]) -> TextStudentSource:
    """The text task's model and data; image-only keys set are refused by name."""
    if values["model"] == DEFAULT_MODEL:
        raise ConfigError(
            f"dataset {TEXT_DATASET!r} is text: set run config 'model' to a text encoder "
            "('minilm', packaged, or a BERT/DistilBERT name or folder on this machine)"
        )
    images = [key for key in ("image-size", "max-samples", "data-root") if values[key]]
    if images:
        raise ConfigError(f"run config {images} apply to image datasets, not {TEXT_DATASET!r}")
    return TextStudentSource(model=str(values["model"]), workdir=Path(str(values["workdir"])))
