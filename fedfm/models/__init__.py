"""Foundation models (timm ViTs) and their FHE-friendly students."""

from fedfm.models.fhe_vit import FheAttention, FheViT, Intermediates, to_fhe_friendly
from fedfm.models.foundation import (
    DEFAULT_MODEL,
    EMBEDDED_VITS,
    ModelSpec,
    check_model_name,
    load_pretrained,
    native_image_size,
)

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
