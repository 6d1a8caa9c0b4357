"""Sample inputs for a transformers model, built from its config and its main input: what the trace, the
verification and ``validate`` run when the caller gives none.

    sample_inputs(model)   # {"input_ids", "attention_mask"}; {"pixel_values"}; {"input_values"}; ...

An encoder-decoder model (T5, BART, Marian, Whisper) also gets ``decoder_input_ids``: its forward needs them
(or labels), and the decoder's modules must be traced and verified too. A model whose inputs cannot be told from
its config is refused with a message that asks for sample inputs.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

SAMPLE_BATCH, SAMPLE_SEQ = 2, 8
AUDIO_SAMPLES = 16_000  # a second of 16 kHz audio: wav2vec2's feature extractor needs a few hundred at least
AUDIO_FRAMES = 49  # what a second of it becomes in wav2vec2's feature extractor (strides 5 x 2^6: 320 samples a frame)


def sample_inputs(model: nn.Module, batch: int = SAMPLE_BATCH, seq_len: int = SAMPLE_SEQ) -> dict:
    """Tiny inputs for a transformers model, built from its config and main input."""
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    if config is None or main is None:
        raise ValueError(f"{type(model).__name__} is not a transformers model: pass sample inputs for the trace.")
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    if main == "pixel_values":
        size = getattr(config, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        channels = getattr(config, "num_channels", 3)
        sample = {"pixel_values": torch.randn(batch, channels, size, size, device=device, dtype=dtype)}
    elif main == "input_ids":
        sample = _token_ids(model, config, batch, seq_len, device)
    elif main == "input_values":  # raw audio (wav2vec2, HuBERT, WavLM, ...): (B, samples)
        sample = {"input_values": torch.randn(batch, _audio_samples(config), device=device, dtype=dtype)}
    elif main == "input_features" and hasattr(config, "num_mel_bins") and hasattr(config, "max_source_positions"):
        # log-mel frames (Whisper): the encoder's two convs halve them to exactly its positions
        frames = 2 * config.max_source_positions
        sample = {"input_features": torch.randn(batch, config.num_mel_bins, frames, device=device, dtype=dtype)}
    else:
        raise ValueError(f"Cannot build sample inputs for main input {main!r}: pass sample inputs for the trace.")
    vision = getattr(config, "vision_config", None)
    inner = _inner(model)  # a PeftModel's forward takes **kwargs: its model's says what it takes
    if main != "pixel_values" and vision is not None and {"pixel_values", "return_loss"} <= set(
            inspect.signature(inner.forward).parameters):  # a contrastive pair of encoders (CLIP, SigLIP): images too
        size = getattr(vision, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        channels = getattr(vision, "num_channels", 3)
        sample["pixel_values"] = torch.randn(batch, channels, size, size, device=device, dtype=dtype)
    patch = getattr(config, "patch_size", None)
    if main == "pixel_values" and isinstance(patch, int) and "noise" in inspect.signature(inner.forward).parameters:
        # ViT-MAE masks patches at random, unless given the noise to rank them by: the same for every member
        side = sample["pixel_values"].shape[-1] // patch
        sample["noise"] = torch.rand(batch, side * side, device=device)
    if getattr(config, "is_encoder_decoder", False) and not _reads_eos(model):
        vocab = _vocab_size(config)
        sample["decoder_input_ids"] = torch.randint(0, vocab, (batch, max(2, seq_len // 2)), device=device)
    return sample


def _audio_samples(config) -> int:
    """Samples of raw audio that the config's convolutional feature extractor (``conv_kernel``, ``conv_stride``)
    makes :data:`AUDIO_FRAMES` frames of: a second, for wav2vec2 and its kin as released; far less for a small
    config that downsamples less (10x: 500 samples, where a second made 1,600 frames, which WavLM's and SEW-D's
    relative attention took tens of seconds over). :data:`AUDIO_SAMPLES` without such a config."""
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if not kernels or not strides or len(kernels) != len(strides):
        return AUDIO_SAMPLES
    samples = AUDIO_FRAMES
    for kernel, stride in zip(reversed(kernels), reversed(strides)):  # each conv: out = (in - kernel) // stride + 1
        samples = (samples - 1) * stride + kernel
    return samples


def _inner(model: nn.Module) -> nn.Module:
    """A PeftModel's transformers model; any other model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _reads_eos(model: nn.Module) -> bool:
    """An encoder-decoder's classifier (BART's, T5's, ...): it reads each text's last eos, and makes its decoder's
    inputs from its own (given others, the eos positions of the one do not fit the states of the other)."""
    inner = _inner(model)
    return getattr(inner.config, "is_encoder_decoder", False) and type(inner).__name__.endswith(
        ("ForSequenceClassification", "ForQuestionAnswering"))


def _token_ids(model: nn.Module, config, batch: int, seq_len: int, device) -> dict:
    """Random ids without the special ones (an eos or pad drawn by chance changes what a head reads), an eos at each
    text's end for an encoder-decoder's classifier (BART's needs exactly one per text), and ``(B, 2, T)`` choices
    for a multiple-choice head."""
    vocab = _vocab_size(config)
    ids = torch.randint(0, vocab, (batch, seq_len), device=device)
    text = config.get_text_config()
    specials = set()
    for name in ("pad", "bos", "eos", "decoder_start"):  # an int, None, or a list (Llama 3 Instruct's eos ids)
        value = getattr(text, f"{name}_token_id", None)
        specials.update(value if isinstance(value, (list, tuple)) else [value])
    specials = sorted(i for i in specials if isinstance(i, int) and 0 <= i < vocab)
    plain = next((i for i in range(vocab) if i not in specials), None)
    if specials and plain is not None:
        ids[torch.isin(ids, torch.tensor(specials, device=device))] = plain
    eos = getattr(text, "eos_token_id", None)
    if _reads_eos(model) and isinstance(eos, int):
        ids[:, -1] = eos
    if type(_inner(model)).__name__.endswith("ForMultipleChoice"):
        ids = torch.stack([ids, ids.roll(1, dims=-1)], 1)  # (B, 2, T)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _vocab_size(config) -> int:
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int):  # CANINE reads characters: its config names no vocabulary
        raise ValueError(f"{type(config).__name__} has no vocab_size to draw sample input_ids from: load the "
                         "members with transformers and pass sample inputs for the trace, "
                         "WideModel.from_models(models, {'input_ids': ...}).")
    return vocab


def sample_kwargs(model: nn.Module, kwargs: dict) -> dict:
    """The sample's keyword arguments as the trace and verification run them: without a KV cache (a cache would be
    extended by every call) and without router logits, which a config may ask for (the load-balancing loss that
    comes with them is computed over all rows: :mod:`hf_wide.routers` splits it by member in a wide forward)."""
    kwargs = dict(kwargs)
    config = getattr(model, "config", None)
    forward = getattr(model, "forward", None)
    takes = inspect.signature(forward).parameters if callable(forward) else {}
    if getattr(config, "use_cache", None) is not None or "use_cache" in takes:  # (an EncoderDecoderModel's config
        kwargs.setdefault("use_cache", False)  # has none of its own; its decoder's asks for a cache)
    if getattr(config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", False)
    return kwargs
