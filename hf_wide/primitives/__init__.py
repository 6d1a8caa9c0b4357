"""Wide primitives, one file per family. Importing this package fills the registry."""

from .base import WideModule
from .conv import WideConv
from .embedding import WideEmbedding
from .fallback import PerMemberFallback
from .linear import WideConv1D, WideLinear
from .norm import WideBatchNorm, WideGroupNorm, WideLayerNorm, WideLlamaRMSNorm, WideRMSNorm
from .vectorised import VectorisedFallback

__all__ = [
    "WideModule",
    "WideConv",
    "WideEmbedding",
    "PerMemberFallback",
    "VectorisedFallback",
    "WideConv1D",
    "WideLinear",
    "WideBatchNorm",
    "WideGroupNorm",
    "WideLayerNorm",
    "WideLlamaRMSNorm",
    "WideRMSNorm",
]
