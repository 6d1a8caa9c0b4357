"""Fused (Flux-style) blocks. Importing this package fills the block registry."""

from .attention import WideAttention
from .base import WideBlock
from .deberta import WideDebertaAttention
from .deberta_v2 import WideDebertaV2Attention
from .lora import WideLoraLinear
from .lora_embedding import WideLoraEmbedding
from .mlp import WideGatedMLP, WidePlainMLP
from .mpnet import WideMPNetAttention
from .vit_embeddings import WideViTEmbeddings

__all__ = [
    "WideAttention", "WideBlock", "WideDebertaAttention", "WideDebertaV2Attention", "WideGatedMLP", "WideLoraEmbedding",
    "WideLoraLinear", "WideMPNetAttention", "WidePlainMLP", "WideViTEmbeddings",
]
