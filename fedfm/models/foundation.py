"""The server's foundation model: a timm ``VisionTransformer``, built, loaded, adapted and cached.

Two sources (spec ``001`` §2, assumptions i-ii):

* any timm ViT by name, with pretrained weights from the hub when it is reachable or from a local
  weights file (``checkpoint=``), adapted to the task on the auxiliary data ``D_aux``;
* an embedded default, a small ViT sized for a CPU (:data:`EMBEDDED_VITS`), that fedfm pretrains
  from scratch on ``D_aux`` ("preliminary adaptation") and caches to a file.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from huggingface_hub import constants as hub_constants

from fedfm.errors import CheckpointError, ConfigError, ModelError
from fedfm.hub import hub_unreachable_reason
from fedfm.models.checkpoints import (
    cache_key,
    load_state_strict,
    read_checkpoint,
    save_checkpoint,
)

if TYPE_CHECKING:
    from timm.models.vision_transformer import VisionTransformer


def _timm() -> Any:
    """timm, imported when a model is built or named: a data owner's ClientApp process, which
    starts once per message on the Deployment Engine, never pays for it (seconds of imports)."""
    import timm

    return timm


def _vision_transformer() -> type[VisionTransformer]:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer


# Model variants as data (timm style). The tiny default reads 16x16 inputs in 4x4 patches: 16
# patches + 1 class token (the 8x8 digits lose nothing at 16 px), because under CKKS attention costs
# grow with the square of the tokens (65 tokens at 32 px cost about 4x more per sample).
EMBEDDED_VITS: dict[str, dict[str, Any]] = {
    "vit_fedfm_tiny": dict(
        img_size=16, patch_size=4, embed_dim=96, depth=4, num_heads=3, mlp_ratio=2.0
    ),
    # Two blocks of width 16 on 8x8 inputs (4 patches + 1 token): encrypted smoke runs in CI.
    "vit_fedfm_micro": dict(
        img_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0
    ),
    "vit_fedfm_small": dict(
        img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=2.0
    ),
}
DEFAULT_MODEL = "vit_fedfm_tiny"
TEACHER_FORMAT = "fedfm-teacher/1"


@dataclass(frozen=True)
class ModelSpec:
    """What is needed to rebuild a foundation model's architecture (not its weights)."""

    name: str
    num_classes: int
    img_size: int

    def __post_init__(self) -> None:
        if self.num_classes < 2:
            raise ConfigError(f"num_classes must be >= 2, got {self.num_classes}")
        if self.img_size < 1:
            raise ConfigError(f"image size must be >= 1, got {self.img_size}")

    @property
    def embedded(self) -> bool:
        return self.name in EMBEDDED_VITS

    def build(self) -> VisionTransformer:
        """The architecture with freshly initialised weights."""
        check_model_name(self.name)
        if self.embedded:
            config = {**EMBEDDED_VITS[self.name], "img_size": self.img_size}
            model = _vision_transformer()(**config, num_classes=self.num_classes)
        else:
            model = _timm().create_model(
                self.name, pretrained=False, num_classes=self.num_classes, img_size=self.img_size
            )
        model = _require_vit(model, self.name)
        patch = max(model.patch_embed.patch_size)
        if self.img_size < patch:
            raise ConfigError(
                f"image size {self.img_size} is smaller than {self.name}'s patch size {patch}"
            )
        return model


def native_image_size(name: str) -> int:
    """The input size a model is built for (32 for the embedded ViTs, timm's default otherwise)."""
    check_model_name(name)
    if name in EMBEDDED_VITS:
        return int(EMBEDDED_VITS[name]["img_size"])
    return int(_timm().get_pretrained_cfg_value(name, "input_size")[-1])


def check_model_name(name: str) -> None:
    """Raise :class:`ModelError` unless ``name`` is an embedded ViT or a timm ViT name."""
    if name in EMBEDDED_VITS:
        return
    timm = _timm()
    if timm.is_model(name):
        module = timm.models.model_entrypoint(name).__module__
        if module != _vision_transformer().__module__:
            raise ModelError(
                f"model {name!r} is defined in {module}; fedfm needs a timm VisionTransformer "
                "(models from timm.models.vision_transformer)"
            )
        return
    candidates = list(EMBEDDED_VITS) + timm.list_models("vit_*")
    close = difflib.get_close_matches(name, candidates, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ModelError(
        f"unknown model {name!r}: use one of {sorted(EMBEDDED_VITS)} or a timm ViT name "
        f"(timm.list_models('vit_*')).{hint}"
    )


def _require_vit(model: torch.nn.Module, name: str) -> VisionTransformer:
    if not isinstance(model, _vision_transformer()):
        raise ModelError(
            f"model {name!r} is a {type(model).__name__}; fedfm needs a timm VisionTransformer"
        )
    return model


def load_pretrained(spec: ModelSpec, *, checkpoint: str | Path | None = None) -> VisionTransformer:
    """A timm ViT with pretrained weights, from a local weights file or else from the hub.

    The classifier is re-initialised for ``spec.num_classes`` and position embeddings are resampled
    to ``spec.img_size`` by timm. Fails with :class:`ModelError` when the weights cannot be had.
    """
    check_model_name(spec.name)
    if spec.embedded:
        raise ModelError(
            f"{spec.name!r} is fedfm's embedded ViT: it has no pretrained weights; fedfm pretrains "
            "it on the auxiliary data"
        )
    overlay: dict[str, Any] = {}
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_file():
            raise ModelError(f"weights file {path} does not exist")
        overlay = {"file": str(path)}
    # Offline, load only from the local Hugging Face cache instead of retrying for a minute.
    offline = checkpoint is None and hub_unreachable_reason() is not None
    saved_offline = hub_constants.HF_HUB_OFFLINE
    try:
        hub_constants.HF_HUB_OFFLINE = saved_offline or offline
        model = _timm().create_model(
            spec.name,
            pretrained=True,
            pretrained_cfg_overlay=overlay or None,
            num_classes=spec.num_classes,
            img_size=spec.img_size,
        )
    except Exception as error:  # timm raises many types (network, key, format errors)
        where = f"file {checkpoint}" if checkpoint else "the Hugging Face hub"
        hint = "" if checkpoint else "; offline, pass a local weights file with --checkpoint"
        raise ModelError(
            f"could not load pretrained weights for {spec.name!r} from {where}: "
            f"{type(error).__name__}: {error}{hint}"
        ) from error
    finally:
        hub_constants.HF_HUB_OFFLINE = saved_offline
    return _require_vit(model, spec.name)


def teacher_cache_key(**settings: Any) -> str:
    """A short hash of everything that determines a pretrained teacher."""
    return cache_key(**settings)


def load_teacher(path: str | Path) -> tuple[VisionTransformer, dict[str, Any]]:
    """Rebuild a cached teacher and return it with its metadata (spec, history, accuracy)."""
    payload = read_checkpoint(path, expected_format=TEACHER_FORMAT)
    try:
        spec = ModelSpec(**payload["model"])
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path} has no valid model description") from error
    model = spec.build()
    load_state_strict(model, payload["state_dict"], source=f"checkpoint {path}")
    return model, payload


def save_teacher(
    path: Path, model: VisionTransformer, spec: ModelSpec, metadata: dict[str, Any]
) -> None:
    """Cache a teacher with the description needed to rebuild it."""
    save_checkpoint(
        path,
        {
            "format": TEACHER_FORMAT,
            "model": asdict(spec),
            "state_dict": model.state_dict(),
            **metadata,
        },
    )


def obtain_teacher(
    spec: ModelSpec,
    *,
    cache_dir: Path,
    train: Callable[[VisionTransformer], dict[str, Any]],
    checkpoint: str | Path | None = None,
    cache_settings: dict[str, Any],
    log: Callable[[str], None] = print,
) -> tuple[VisionTransformer, dict[str, Any]]:
    """Load the cached teacher for these settings, or build, adapt on ``D_aux`` and cache it.

    ``train`` adapts the model in place on the auxiliary data and returns metadata to store
    (history, accuracy). The cache file name hashes ``spec`` and ``cache_settings``.
    """
    key = teacher_cache_key(model=asdict(spec), checkpoint=checkpoint, **cache_settings)
    path = cache_dir / f"teacher-{spec.name}-{key}.pt"
    if path.exists():
        log(f"[fedfm] teacher: loading cached {path}")
        return load_teacher(path)
    if spec.embedded:
        log(f"[fedfm] teacher: pretraining embedded {spec.name} on D_aux (cached to {path})")
        model = spec.build()
    else:
        log(f"[fedfm] teacher: adapting pretrained {spec.name} on D_aux (cached to {path})")
        model = load_pretrained(spec, checkpoint=checkpoint)
    metadata = train(model)
    save_teacher(path, model, spec, metadata)
    return model, {"model": asdict(spec), **metadata}
