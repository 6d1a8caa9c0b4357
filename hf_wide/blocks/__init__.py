"""Fused (Flux-style) blocks. Importing this package fills the block registry."""

from .attention import WideAttention
from .base import WideBlock
from .deberta import WideDisentangledAttention
from .mlp import WideGatedMLP, WidePlainMLP
from .vit_embeddings import WideViTEmbeddings

__all__ = ["WideAttention", "WideBlock", "WideDisentangledAttention", "WideGatedMLP", "WidePlainMLP", "WideViTEmbeddings"]
