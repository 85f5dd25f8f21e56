"""Foundation models (timm ViTs), their FHE-friendly students, text encoders and the decoder LLM.

The names below load on first use (PEP 562), so that light modules of this package (the
decoder's :mod:`~fedfm.models.decoder.config`, read by the ``fedfm`` command to build its options)
do not import timm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfm.models.fhe_vit import FheAttention, FheViT, Intermediates, to_fhe_friendly
    from fedfm.models.foundation import (
        DEFAULT_MODEL,
        EMBEDDED_VITS,
        ModelSpec,
        check_model_name,
        load_pretrained,
        native_image_size,
    )

_HOME = {
    "FheAttention": "fhe_vit",
    "FheViT": "fhe_vit",
    "Intermediates": "fhe_vit",
    "to_fhe_friendly": "fhe_vit",
    "DEFAULT_MODEL": "foundation",
    "EMBEDDED_VITS": "foundation",
    "ModelSpec": "foundation",
    "check_model_name": "foundation",
    "load_pretrained": "foundation",
    "native_image_size": "foundation",
}
__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_VITS",
    "FheAttention",
    "FheViT",
    "Intermediates",
    "ModelSpec",
    "check_model_name",
    "load_pretrained",
    "native_image_size",
    "to_fhe_friendly",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
