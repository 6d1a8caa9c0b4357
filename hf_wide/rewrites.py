"""Rewrites: a template module kept as it is, but for one method that runs a child's tensors on an input without
the batch dim, or whose own code multiplies the batch's rows by its rows.

MPNet's encoder computes one position bias for the whole batch: its ``relative_attention_bias`` embedding looks
up a ``(T, T)`` bucket table, and the result is expanded to the batch. Fused, that table has one row of weights
per member, and the bias must be each member's on its rows; no module of the encoder's can be swapped to do
that, so without a rewrite the whole encoder runs as one vectorised fallback. The rewrite is a subclass of the
source class (:func:`~hf_wide.registry.register_rewrite`) whose method reads the child's stacked weight,
``(N, ...)`` (or its one shared copy), and returns the folded ``(N*B, ...)`` result; everything else, the layers
included, runs as planned: wide linears, fused blocks. The planner uses a rewrite only while the children it
reads are stacked or shared, and verification checks the rewritten module's output with the rest (a kept module
that disagrees becomes a fallback).

CLIP's model (and SigLIP's) scores every text against every image of the batch, ``(B, D) @ (D, B')``: folded, each
member's texts would meet every member's images, so the whole model ran vectorised, its towers too (N copies of a
base that LoRA members share). Its rewrite (``mixes_rows``: it computes per member what its source's own code
computes over the batch's rows) scores each member's texts against its own images in one batched product; the
towers run as planned. The planner takes it while the model's own tensors (``logit_scale``, SigLIP's ``logit_bias``)
are the same in every member (adapters of one base); where the members' differ, the model still runs vectorised
whole.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.clip.modeling_clip import (CLIPModel, CLIPOutput, _get_vector_norm,
                                                    image_text_contrastive_loss)
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder
from transformers.models.siglip.modeling_siglip import SiglipModel, SiglipOutput
from transformers.utils.generic import can_return_tuple

from .packing import active as packing_of_this_call
from .primitives.embedding import WideEmbedding
from .registry import register_rewrite


@register_rewrite(MPNetEncoder, reads=("relative_attention_bias",))
class WideMPNetEncoder(MPNetEncoder):
    """MPNet's encoder; each member's position bias from its own ``relative_attention_bias`` table."""

    def compute_position_bias(self, x, position_ids=None, num_buckets=32):
        if position_ids is not None:  # the encoder never passes them (nor could the source handle them)
            raise NotImplementedError("hf-wide's MPNet encoder computes the position bias without position_ids.")
        packing = packing_of_this_call()  # hf_wide.packing: x is the batch's real tokens only, (N, K, D)
        rows, length = (x.shape[0], x.shape[1]) if packing is None else (x.shape[0] * packing.batch, packing.length)
        position = torch.arange(length, dtype=torch.long, device=x.device)
        buckets = self.relative_position_bucket(position[None, :] - position[:, None], num_buckets=num_buckets)
        if type(self.relative_attention_bias) not in (WideEmbedding, nn.Embedding):  # the planner sees to it
            raise RuntimeError("hf-wide's MPNet encoder needs its relative_attention_bias stacked or shared.")
        table = self.relative_attention_bias.weight  # (N, K, H) stacked, or (K, H): one copy for every member
        values = table[..., buckets, :]  # (N, T, T, H) or (T, T, H)
        values = values.reshape(-1, length, length, table.shape[-1]).permute(0, 3, 1, 2)  # (n, H, T, T), n in {N, 1}
        n = values.shape[0]  # (N*B, H, T, T) below: the padded layout, which the attentions use in a packed encoder
        return values[:, None].expand(n, rows // n, *values.shape[1:]).reshape(rows, *values.shape[1:]).contiguous()


def _per_member(fold, texts: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """Each member's texts against its own images: ``(N*B, P)`` and ``(N*B', P)`` -> ``(N, B, B')``."""
    n = fold.num_members
    texts, images = texts.view(n, -1, texts.shape[-1]), images.view(n, -1, images.shape[-1])
    return torch.matmul(texts, images.transpose(1, 2).to(texts.device))


def _output(output_class: type, loss, logits_per_text: torch.Tensor, text_embeds, image_embeds, text_outputs,
            vision_outputs):
    """transformers' output of a contrastive pair, its ``(N, B, B')`` logits folded member-major: per image
    ``(N*B', B)``, per text ``(N*B, B')``."""
    n, texts, images = logits_per_text.shape
    return output_class(loss=loss, logits_per_image=logits_per_text.transpose(1, 2).reshape(n * images, texts),
                        logits_per_text=logits_per_text.reshape(n * texts, images), text_embeds=text_embeds,
                        image_embeds=image_embeds, text_model_output=text_outputs, vision_model_output=vision_outputs)


@register_rewrite(CLIPModel, reads=())
class WideCLIPModel(CLIPModel):
    """CLIP's model; each member's texts scored against its own images (transformers' ``CLIPModel.forward``, but
    for the product of texts by images, batched over the members). ``fold``: the wide model's, given at the swap."""

    mixes_rows = True

    @can_return_tuple
    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None, return_loss=None,
                interpolate_pos_encoding=False, **kwargs) -> CLIPOutput:
        # Every batched input comes folded (WideModel's own_batches); each tower runs with its own rows as the
        # forward's, for its wide modules to split members and expand broadcasts by: N*B' images, N*B texts
        with self.fold.rows_of(pixel_values):
            vision_outputs: BaseModelOutputWithPooling = self.get_image_features(
                pixel_values=pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs)
        with self.fold.rows_of(input_ids):
            text_outputs: BaseModelOutputWithPooling = self.get_text_features(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        image_embeds = vision_outputs.pooler_output  # (N*B', P): each member's images
        text_embeds = text_outputs.pooler_output  # (N*B, P): each member's texts
        image_embeds = image_embeds / _get_vector_norm(image_embeds)
        text_embeds = text_embeds / _get_vector_norm(text_embeds)
        logits_per_text = _per_member(self.fold, text_embeds, image_embeds)  # (N, B, B')
        logits_per_text = logits_per_text * self.logit_scale.exp().to(text_embeds.device)
        loss = None
        if return_loss:  # each member's, (N,)
            loss = torch.stack([image_text_contrastive_loss(member) for member in logits_per_text])
        return _output(CLIPOutput, loss, logits_per_text, text_embeds, image_embeds, text_outputs, vision_outputs)


@register_rewrite(SiglipModel, reads=())
class WideSiglipModel(SiglipModel):
    """SigLIP's model; each member's texts scored against its own images, as :class:`WideCLIPModel` does CLIP's
    (transformers' ``SiglipModel.forward``, the product batched over the members)."""

    mixes_rows = True

    @can_return_tuple
    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None, return_loss=None,
                interpolate_pos_encoding=False, **kwargs) -> SiglipOutput:
        with self.fold.rows_of(pixel_values):  # (as WideCLIPModel's: every input folded, each tower its own rows)
            vision_outputs: BaseModelOutputWithPooling = self.vision_model(
                pixel_values=pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs)
        with self.fold.rows_of(input_ids):
            text_outputs: BaseModelOutputWithPooling = self.text_model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        image_embeds = vision_outputs.pooler_output
        text_embeds = text_outputs.pooler_output
        image_embeds = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)
        text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
        logits_per_text = _per_member(self.fold, text_embeds, image_embeds)  # (N, B, B')
        logit_scale, logit_bias = self.logit_scale.to(text_embeds.device), self.logit_bias.to(text_embeds.device)
        logits_per_text = logits_per_text * logit_scale.exp() + logit_bias
        loss = None
        if return_loss:  # each member's, (N,): SigLIP's sigmoid loss on its own (B, B) logits
            eye = torch.eye(logits_per_text.shape[1], device=logits_per_text.device)
            loglik = torch.nn.functional.logsigmoid((2 * eye - 1) * logits_per_text)
            loss = -loglik.sum(-1).mean(-1)
        return _output(SiglipOutput, loss, logits_per_text, text_embeds, image_embeds, text_outputs, vision_outputs)
