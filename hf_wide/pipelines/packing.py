"""Which wide models pipelines may run padding-free (:mod:`hf_wide.packing`).

An encoder carries packed states only where every module inside it is known to act on each token alone, or is a
fused attention that unpacks for its attention call, or is an attention of the family's own code, which runs padded
(an island: its input unpacked, its output packed again). The encoders of the families below qualify, whose
container modules' code was read (transformers 5.23-5.24), with wide primitives that act per token and fused
attention without rotary positions inside. Then a probe batch must give, packed, the outputs it gives padded; only
then are the hooks installed, once per model.

The last layer of an encoder whose layers run in turn (BERT's family, DistilBERT) may run at the rows' first tokens
only, where its attention is fused: for pipelines whose answers read nothing else (text classification), once a
probe batch gives every output so as padded (:func:`enable_first_tokens`).
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn
from transformers import activations

from ..blocks.attention import WideAttention
from ..blocks.deberta import WideDebertaAttention
from ..blocks.deberta_v2 import WideDebertaV2Attention
from ..blocks.lora import WideLoraLinear
from ..blocks.mpnet import WideMPNetAttention
from ..packing import install_hooks, packed
from ..primitives.linear import WideLinear
from ..primitives.norm import WideDebertaLayerNorm, WideLayerNorm
from ..registry import transformers_classes
from ..rewrites import WideMPNetEncoder
from ..compare import tf32_possible, tolerance

logger = logging.getLogger(__name__)
_LOCK = threading.RLock()  # one probe and one set of hooks per model, whichever pipeline asks first

FAMILIES = {"bert": "Bert", "roberta": "Roberta", "xlm_roberta": "XLMRoberta", "camembert": "Camembert",
            "electra": "Electra"}  # module -> class prefix: BERT's encoder code (RoBERTa's under other names)
# DeBERTa's encoders read their states' length between layers (relative positions): each layer is a region.
# MPNet's (hf-wide's rewrite of it) reads the batch's padded length from the packing for its position bias.
REGIONS = (*transformers_classes(*(f"{f}.{prefix}Encoder" for f, prefix in FAMILIES.items())),
           *transformers_classes("distilbert.Transformer", "albert.AlbertTransformer", "deberta.DebertaLayer",
                                 "deberta_v2.DebertaV2Layer"),
           WideMPNetEncoder)
# Encoders whose layers are ``layer`` and called in turn, the last one's output the encoder's: that layer may run at
# the rows' first tokens only (hf_wide.packing.packed's first_tokens)
LAYERED = transformers_classes(*(f"{f}.{prefix}Encoder" for f, prefix in FAMILIES.items()), "distilbert.Transformer")
NOT_CALLED = {WideMPNetEncoder: {"relative_attention_bias"}}  # children whose weights a region reads itself
CONTAINERS = (*transformers_classes(*(f"{f}.{prefix}{part}" for f, prefix in FAMILIES.items()
                                      for part in ("Layer", "Attention", "SelfOutput", "Intermediate", "Output"))),
              *transformers_classes("distilbert.TransformerBlock", "distilbert.FFN", "albert.AlbertLayerGroup",
                                    "albert.AlbertLayer"),
              *transformers_classes(*(f"{f}.{prefix}{part}" for f, prefix in (("deberta", "Deberta"),
                                                                              ("deberta_v2", "DebertaV2"))
                                      for part in ("Attention", "SelfOutput", "Intermediate", "Output"))),
              *transformers_classes(*(f"mpnet.MPNet{part}" for part in
                                      ("Layer", "Attention", "Intermediate", "Output"))),
              nn.ModuleList)
# Attentions left as the model's own code (around a LoRA adapter's projections, unfused on CPU; one shared by every
# member) run padded inside a packed encoder: their input unpacked, their output packed again.
ISLANDS = tuple(transformers_classes(*(f"{f}.{prefix}SelfAttention" for f, prefix in FAMILIES.items()),
                                     "distilbert.DistilBertSelfAttention", "albert.AlbertAttention",
                                     "deberta.DisentangledSelfAttention", "deberta_v2.DisentangledSelfAttention",
                                     "mpnet.MPNetSelfAttention"))
TOKENWISE = (WideLinear, WideLayerNorm, WideDebertaLayerNorm, WideLoraLinear, nn.Linear, nn.LayerNorm, nn.Dropout,
             nn.Identity, nn.GELU, nn.ReLU, nn.Tanh, nn.SiLU, nn.Sigmoid,
             *transformers_classes("deberta.DebertaLayerNorm"))  # one shared by every member: each row alone


def structure_refusal(model: nn.Module) -> str | None:
    """Why the folded ``model``'s encoders cannot carry packed states (None when every module inside is known)."""
    regions = [m for m in model.modules() if type(m) in REGIONS]
    if not regions:
        return (f"{type(model).__name__} has no encoder of a family known to act per token (BERT, RoBERTa, "
                "XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT, ALBERT, DeBERTa, DeBERTa-v2, MPNet)")
    for region in regions:
        stack = [(name, child) for name, child in region.named_children()
                 if name not in NOT_CALLED.get(type(region), ())]
        while stack:
            name, module = stack.pop()
            why = _module_refusal(module)
            if why is not None:
                return f"{name} ({type(module).__name__}) {why}"
            if type(module) in CONTAINERS:
                stack.extend((f"{name}.{child}", sub) for child, sub in module.named_children())
    return None


def islands(region: nn.Module) -> list[nn.Module]:
    """The modules inside ``region`` that run padded (:data:`ISLANDS`), outermost only."""
    found, stack = [], list(region.children())
    while stack:
        module = stack.pop()
        if type(module) in ISLANDS:
            found.append(module)
        elif type(module) in CONTAINERS:
            stack.extend(module.children())
    return found


def _module_refusal(module: nn.Module) -> str | None:
    kind = type(module)
    if kind in CONTAINERS:
        return None if not getattr(module, "chunk_size_feed_forward", 0) else "chunks its feed-forward"
    if kind in ISLANDS:
        return None
    if isinstance(module, WideAttention):
        return "has rotary positions" if module.layout.rotary else None
    if isinstance(module, (WideDebertaAttention, WideDebertaV2Attention, WideMPNetAttention)):
        return None
    if kind in TOKENWISE or kind.__module__ == activations.__name__:
        return None
    return "is not known to act on each token alone"


def enable_packing(wide) -> str | None:
    """Let pipelines pack ``wide``'s encoder (see the module's doc): install the encoder's hooks once, after a probe
    batch gave the same outputs packed as padded. Returns why not (None: packing is on); the answer is kept."""
    with _LOCK:
        if "_packing_refusal" not in wide.__dict__:
            wide.__dict__["_packing_refusal"] = _enable(wide)
        return wide.__dict__["_packing_refusal"]


def _enable(wide) -> str | None:
    model = wide.model
    if wide.members_group is not None:  # a probe on one rank would wait for the others
        return "its members are split across processes"
    why = structure_refusal(model)
    handles, lasts = [], 0
    if why is None:
        for region in (m for m in model.modules() if type(m) in REGIONS):
            last = last_layer(region)
            lasts += last is not None
            handles.extend(install_hooks(region, islands(region), last))
        try:
            why = _probe_refusal(wide)
        except Exception as error:  # noqa: BLE001 - any failure of the packed probe is a reason not to pack
            why = f"the packed probe failed: {type(error).__name__}: {error}"
        if why is not None:
            for handle in handles:
                handle.remove()
    if why is not None:
        logger.info("Pipelines run %s padded: %s.", type(model).__name__, why)
    wide.__dict__["_first_token_layers"] = lasts if why is None else 0
    return why


def last_layer(region: nn.Module) -> nn.Module | None:
    """``region``'s last layer where it may run at the rows' first tokens only: the region's output is that layer's,
    whose attention is a fused one (:class:`WideAttention`, which takes its keys and values from every token);
    else None."""
    if type(region) not in LAYERED or not len(region.layer):
        return None
    last = region.layer[-1]
    attentions = [m for m in last.modules() if isinstance(m, WideAttention)]
    return last if len(attentions) == 1 and not islands(last) else None


def enable_first_tokens(wide) -> str | None:
    """Let pipelines whose answers read each input's first token run ``wide``'s encoders' last layers on those
    tokens only (past their keys and values): where the model packs (:func:`enable_packing`), has such layers
    (:func:`last_layer`), and a probe batch gives every output so as it gives them padded. Returns why not (None:
    on); the answer is kept."""
    with _LOCK:
        if "_first_tokens_refusal" not in wide.__dict__:
            wide.__dict__["_first_tokens_refusal"] = _enable_first_tokens(wide)
        return wide.__dict__["_first_tokens_refusal"]


def _enable_first_tokens(wide) -> str | None:
    why = enable_packing(wide)
    if why is not None:
        return f"it runs padded: {why}"
    if not wide.__dict__.get("_first_token_layers"):
        return ("no encoder of it ends in a layer that can (a BERT-family or DistilBERT encoder whose last layer's "
                "attention is fused)")
    try:
        why = _probe_refusal(wide, first_tokens=True)
    except Exception as error:  # noqa: BLE001 - any failure of the probe is a reason not to take it
        why = f"the probe failed: {type(error).__name__}: {error}"
    if why is not None:
        logger.info("Pipelines run %s's last layers at every token: %s.", type(wide.model).__name__, why)
    return why


def _probe_refusal(wide, first_tokens: bool = False) -> str | None:
    """Run three rows (8, 5 and 1 tokens) padded and packed (with ``first_tokens``: and the encoders' last layers
    at the rows' first tokens only); why their outputs differ, if they do."""
    config = wide.config
    vocab = getattr(config, "vocab_size", None) or 2
    length = min(8, getattr(config, "max_position_embeddings", None) or 8)
    generator = torch.Generator().manual_seed(0)
    device = next(wide.parameters()).device
    mask = torch.arange(length) < torch.tensor([[length], [max(1, length - 3)], [1]])  # (3, T)
    inputs = {"input_ids": torch.randint(vocab, (3, length), generator=generator).to(device),
              "attention_mask": mask.long().to(device)}
    with torch.inference_mode():
        padded = wide(**inputs)
        with packed(mask, device, first_tokens) as state:
            packed_out = wide(**inputs)
            if not state.entered:
                return "the encoder was not called with the batch's padded states"
            if first_tokens and not state.cut:
                return "its encoders' last layers were not called with the packed states"
    for key, ref in padded.items():
        got = packed_out[key]
        if not isinstance(ref, torch.Tensor):
            continue
        if ref.dim() >= 3 and tuple(ref.shape[1:3]) == tuple(mask.shape):  # (N, B, T, ...): the real tokens only
            ref, got = ref[:, mask.to(device)], got[:, mask.to(device)]
        error = (ref - got).abs().max().item() if ref.numel() else 0.0
        if not error <= tolerance(ref, tf32_possible(wide.model)):
            how = "at first tokens" if first_tokens else "packed"
            return f"{how}, its {key} differ from the padded forward's by {error:.3g}"
    return None
