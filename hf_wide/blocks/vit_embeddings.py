"""WideViTEmbeddings: ViT's patch, [CLS] and position embeddings for N members in one pass.

``ViTEmbeddings`` reads raw parameters of its own (``cls_token``, ``position_embeddings``, ``mask_token``)
besides its patch projection, so no primitive covers it: without this block it runs member by member.
Here the patch convs are one grouped conv (:class:`~hf_wide.primitives.WideConv`) and the members' tokens
and positions are stacked, with the source's masking, position interpolation and errors.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.vit.modeling_vit import ViTEmbeddings
from transformers.utils import torch_int

from ..primitives.conv import WideConv
from ..registry import register_block
from .base import WideBlock, member_slices


def _stack(mods: Sequence[nn.Module], name: str) -> nn.Parameter | None:
    tensors = [getattr(m, name) for m in mods]
    return None if tensors[0] is None else nn.Parameter(torch.stack([t.detach() for t in tensors]),
                                                        tensors[0].requires_grad)


class _WidePatchEmbeddings(nn.Module):
    """Holds the wide patch projection under the source's names (``patch_embeddings.projection``), which
    ``ViTModel`` reads (its weight's dtype), with the source's plain attributes (``num_patches``, ...)."""

    def __init__(self, source: nn.Module, projection: WideConv):
        super().__init__()
        for name, value in vars(source).items():
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        self.projection = projection


@register_block(ViTEmbeddings)
class WideViTEmbeddings(WideBlock):
    """``patch_embeddings.projection``: a WideConv of the members' patch convs; ``cls_token`` and
    ``mask_token`` (None without one): (N, 1, 1, D); ``position_embeddings``: (N, 1, P+1, D)."""

    def build(self, mods: Sequence[nn.Module]) -> None:
        projection = WideConv.from_modules([m.patch_embeddings.projection for m in mods], self.fold)
        self.patch_embeddings = _WidePatchEmbeddings(mods[0].patch_embeddings, projection)
        self.cls_token = _stack(mods, "cls_token")
        self.mask_token = _stack(mods, "mask_token")
        self.position_embeddings = _stack(mods, "position_embeddings")
        self.dropout = copy.deepcopy(mods[0].dropout)

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        state = {"cls_token": self.cls_token[i], "position_embeddings": self.position_embeddings[i],
                 **member_slices("patch_embeddings.projection", self.patch_embeddings.projection, i)}
        if self.mask_token is not None:
            state["mask_token"] = self.mask_token[i]
        return state

    def forward(self, pixel_values: torch.Tensor, bool_masked_pos: torch.BoolTensor | None = None,
                interpolate_pos_encoding: bool = False) -> torch.Tensor:  # pixel_values: (N*B, C, H, W)
        _, num_channels, height, width = pixel_values.shape
        if num_channels != self.patch_embeddings.num_channels:
            raise ValueError(
                "Make sure that the channel dimension of the pixel values match with the one set in the configuration."
                f" Expected {self.patch_embeddings.num_channels} but got {num_channels}."
            )
        patches = self.patch_embeddings.projection(pixel_values).flatten(2).transpose(1, 2)  # (N*B, P, D)
        patches = self.fold.split(patches)  # (N, b, P, D)
        n, b, _, dim = patches.shape
        if bool_masked_pos is not None:
            mask = self.fold.split(bool_masked_pos).unsqueeze(-1).type_as(patches)  # (N, b, P, 1)
            patches = patches * (1.0 - mask) + self.mask_token * mask
        embeddings = torch.cat((self.cls_token.expand(n, b, 1, dim), patches), dim=2)  # (N, b, P+1, D)
        if interpolate_pos_encoding:
            embeddings = embeddings + self._interpolated_positions(embeddings.shape[2] - 1, height, width)
        else:
            if height != self.image_size[0] or width != self.image_size[1]:
                raise ValueError(
                    f"Input image size ({height}*{width}) doesn't match model"
                    f" ({self.image_size[0]}*{self.image_size[1]})."
                )
            embeddings = embeddings + self.position_embeddings
        return self.dropout(self.fold.merge(embeddings))  # (N*B, P+1, D)

    def _interpolated_positions(self, num_patches: int, height: int, width: int) -> torch.Tensor:
        """ViTEmbeddings.interpolate_pos_encoding for every member: (N, 1, P'+1, D)."""
        num_positions = self.position_embeddings.shape[2] - 1
        if not torch.jit.is_tracing() and num_patches == num_positions and height == width:
            return self.position_embeddings
        n, dim = self.num_members, self.position_embeddings.shape[-1]
        side = torch_int(num_positions**0.5)
        grid = self.position_embeddings[:, 0, 1:].reshape(n, side, side, dim).permute(0, 3, 1, 2)  # (N, D, s, s)
        grid = F.interpolate(grid, size=(height // self.patch_size, width // self.patch_size), mode="bicubic",
                             align_corners=False)  # the members are the batch: each is resized on its own
        patch_positions = grid.permute(0, 2, 3, 1).reshape(n, 1, -1, dim)
        return torch.cat((self.position_embeddings[:, :, :1], patch_positions), dim=2)
